"""Who may call the server: API keys and CORS, checked before a request reaches any route.

:func:`access_middleware` gives the middleware stack, outermost first:

1. Starlette's ``CORSMiddleware``, when origins are configured. It answers a browser's preflight
   (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) itself, so a preflight never needs
   a key (browsers send none with it), and it adds the CORS headers to every other response, refusals
   included, so a page can read why it was refused. A disallowed origin gets no CORS headers.
2. :class:`ApiKeyMiddleware`, when keys are configured. With no key configured every request passes, as
   on a server without this module.

Keys are never logged, echoed in a response or kept in plain text by the middleware (only their
SHA-256 digests). A request let through with a key carries that key's digest in its scope
(:func:`request_key_digest`): the routes keep each key's prompt cache apart with it, and name the key
in the metrics by :func:`key_id`.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Callable, Iterable
from typing import Any

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from llama_cache.server.errors import ApiError

__all__ = ["ApiKeyMiddleware", "access_middleware", "is_loopback", "key_id", "request_key_digest"]

_HOW = "send it as 'Authorization: Bearer KEY' or 'X-Api-Key: KEY'"
_SCOPE_KEY = "llama_cache.api_key_digest"


class ApiKeyMiddleware:
    """A pure ASGI middleware that lets through only HTTP requests carrying one of ``keys``.

    Contract:

    - A request to one of ``public_paths`` (exact match of the path) passes without a key.
    - Any other HTTP request passes when its ``Authorization: Bearer KEY`` (scheme case-insensitive) or
      its ``X-Api-Key: KEY`` header holds one of the keys (the first such key's SHA-256 digest is then
      in its scope: :func:`request_key_digest`); otherwise it is answered 401 with OpenAI's
      error body (``type`` ``invalid_request_error``, ``code`` ``invalid_api_key``, ``param`` null) and
      ``WWW-Authenticate: Bearer``, its body left unread and its connection closed, and ``on_refused``
      is called with its path. ``refusal_body`` may give that body another API's shape, by path (the
      Messages API's routes answer in Anthropic's).
      Unknown paths ask for a key too: a client without one learns nothing of the routes.
    - The comparison takes the same time whichever key matches, however many characters of a key a
      guess shares and whatever the keys' lengths: the presented key's SHA-256 digest is compared with
      every configured key's digest by :func:`hmac.compare_digest`, all of them, without stopping at a
      match.
    - Other scopes (``lifespan``) pass untouched; the app has no WebSocket routes.

    Args:
        app: the application behind it.
        keys: the accepted keys, at least one.
        public_paths: paths served without a key.
        on_refused: called with the path of each request refused, before the 401 is sent (to count it).
        refusal_body: the 401's body for a path and the error (default: OpenAI's, ``error.body()``).

    Raises:
        ValueError: ``keys`` is empty.
    """

    def __init__(self, app: ASGIApp, *, keys: Iterable[str], public_paths: Iterable[str] = ("/health",),
                 on_refused: Callable[[str], None] | None = None,
                 refusal_body: Callable[[str, ApiError], dict[str, Any]] | None = None) -> None:
        self.app = app
        self._digests = tuple(_digest(key.encode()) for key in keys)
        if not self._digests:
            raise ValueError("ApiKeyMiddleware needs at least one key")
        self._public = frozenset(public_paths)
        self._on_refused = on_refused
        self._refusal_body = refusal_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._public:
            await self.app(scope, receive, send)
            return
        presented = _presented_keys(scope["headers"])
        accepted = [self._accepts(key) for key in presented]  # a list: every presented key is checked
        digest = next((found for found in accepted if found is not None), None)
        if digest is not None:
            scope[_SCOPE_KEY] = digest
            await self.app(scope, receive, send)
            return
        if self._on_refused is not None:
            self._on_refused(scope["path"])
        message = f"this server asks for an API key: {_HOW}" if not presented else "the API key is not valid"
        # Closed after the answer: a client without a key holds no connection (nor trickles a body into it).
        error = ApiError(401, message, code="invalid_api_key",
                         headers={"WWW-Authenticate": "Bearer", "Connection": "close"})
        body = self._refusal_body(scope["path"], error) if self._refusal_body is not None else error.body()
        await JSONResponse(body, status_code=error.status, headers=error.headers)(scope, receive, send)

    def _accepts(self, key: bytes) -> bytes | None:
        """``key``'s digest if it is one of the keys, else None (every configured key compared)."""
        digest = _digest(key)
        matched = False
        for known in self._digests:
            matched |= hmac.compare_digest(digest, known)
        return digest if matched else None


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def request_key_digest(scope: Scope) -> bytes | None:
    """The SHA-256 digest of the API key the request was let through with; None without keys."""
    digest = scope.get(_SCOPE_KEY)
    return digest if isinstance(digest, bytes) else None


def key_id(digest: bytes | None) -> str:
    """How the metrics name a key: ``key-`` and 8 hex digits of a hash of its digest (``none`` without
    one). Not the key, and too short to test guesses of a strong key against."""
    if digest is None:
        return "none"
    return "key-" + hashlib.blake2b(digest, digest_size=4, person=b"llc-key-id").hexdigest()


def _presented_keys(headers: Iterable[tuple[bytes, bytes]]) -> list[bytes]:
    """The keys a request presents: the token of each ``Authorization: Bearer`` and each ``X-Api-Key``."""
    keys = []
    for name, value in headers:  # ASGI header names are lower-case
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                keys.append(token.strip())
        elif name == b"x-api-key" and value.strip():
            keys.append(value.strip())
    return keys


def access_middleware(*, api_keys: Iterable[str] = (), cors_origins: Iterable[str] = (),
                      public_paths: Iterable[str] = ("/health",),
                      on_refused: Callable[[str], None] | None = None,
                      refusal_body: Callable[[str, ApiError], dict[str, Any]] | None = None) -> list[Middleware]:
    """The access middleware for Starlette's ``middleware=``, outermost first (see the module docstring).

    Args:
        api_keys: accepted keys; none: no key asked for.
        cors_origins: origins whose pages may call the API (``*``: any); none: no CORS middleware.
        public_paths: paths served without a key.
        on_refused, refusal_body: see :class:`ApiKeyMiddleware`.
    """
    stack = []
    origins = list(cors_origins)
    if origins:
        # Any request header: browser clients send their own (openai-node sends X-Stainless-*), and
        # a key is what grants access here, not a header list. No credentials (cookies): keys are headers.
        stack.append(Middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"],
                                allow_headers=["*"], max_age=600))
    keys = list(api_keys)
    if keys:
        stack.append(Middleware(ApiKeyMiddleware, keys=keys, public_paths=tuple(public_paths),
                                on_refused=on_refused, refusal_body=refusal_body))
    return stack


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` reaches only this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface
