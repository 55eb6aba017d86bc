"""The server's connections: a deadline for request headers, a bound on open connections, TLS, prompt closes.

uvicorn (0.54, its h11 protocol) bounds none of these: a connection that never sends a request, or
dribbles its headers, is held until the client leaves; ``timeout_keep_alive`` starts only after a
response and any byte stops it; ``limit_concurrency`` accepts every connection and answers 503 only
once a request's headers are in, counting the asking connection itself. Over TLS, asyncio's server
waits up to 60 s for a handshake and, on every close, up to 30 s for the peer's ``close_notify``,
which an idle pooled client never reads: uvicorn's shutdown closes an idle connection, then waits for
the connection to be lost, so a SIGTERM with one idle TLS client took 30 s.

:func:`guarded_protocol` makes the protocol class to give ``uvicorn.Config(http=...)``. Its contract,
per connection:

- **Header deadline.** The request's headers must be complete within ``header_timeout`` seconds of the
  connection's opening (the TLS handshake included), and for each later request on a keep-alive
  connection within ``header_timeout`` of the previous response's end. Past it the connection is
  closed: silently if nothing of a request came, else after a ``408`` (``request_timeout``). The body
  is not covered (the app's ``--body-timeout`` is). Idle time between requests is bounded by uvicorn's
  ``timeout_keep_alive`` (a connection holding part of its next request is not idle: the deadline
  governs it).
- **Open connections.** At most ``max_connections`` are served at once; one more is answered ``503``
  (``too_many_connections``, ``Retry-After``) at once, after its TLS handshake, without reading a
  request, and closed. It is kept open for :data:`CLOSE_LINGER` seconds at most, reading and dropping
  what the client sends, so that the client reads the answer rather than a reset.
- **TLS.** Done here (``loop.start_tls``) rather than by uvicorn's listener, so that the handshake falls
  under the header deadline and a close waits at most :data:`TLS_SHUTDOWN_TIMEOUT` for the peer.
- **Prompt closes.** A connection closed while idle (keep-alive timeout, header deadline, shutdown), or
  by uvicorn after a response to a request read whole (as after a drain on shutdown), is closed at
  once: over TLS, ``close_notify`` is sent and the socket closed as soon as all is sent, without waiting
  for the peer's ``close_notify`` (an idle pooled client never reads it); that wait is bounded as above.
  On shutdown, a connection with a request running is left to uvicorn's drain.

Everything runs on the event loop's thread: the classes here are not thread-safe and take no lock.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from llama_cache.server.errors import RETRY_AFTER_SECONDS, ApiError

__all__ = ["CLOSE_LINGER", "TLS_SHUTDOWN_TIMEOUT", "GuardedProtocol", "guarded_protocol", "listening_sockets",
           "raise_open_file_limit", "tls_context"]

logger = logging.getLogger(__name__)

CLOSE_LINGER = 1.0
"""Seconds a connection answered ``503`` or ``408`` stays open, draining, before it is dropped."""
TLS_SHUTDOWN_TIMEOUT = 10.0
"""Seconds a TLS close waits for the peer's ``close_notify`` when bytes were still unsent (asyncio: 30)."""
OPEN_FILES_RESERVE = 128
"""File descriptors kept, beyond one per connection, for the model, the cache files and the rest."""
_REFUSAL_LOG_INTERVAL = 60.0
_FLUSH_POLL = 0.05


def _raw_response(status: int, reason: str, error: ApiError) -> bytes:
    """A whole HTTP/1.1 response with OpenAI's error body and ``Connection: close``, as bytes."""
    body = json.dumps(error.body()).encode()
    lines = [f"HTTP/1.1 {status} {reason}", "content-type: application/json", f"content-length: {len(body)}",
             "connection: close", *(f"{name.lower()}: {value}" for name, value in error.headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + body


@dataclass
class _Guard:
    """One server's connection settings and the connections it serves (the event loop's thread only)."""

    header_timeout: float
    max_connections: int
    tls: ssl.SSLContext | None
    tls_shutdown_timeout: float
    admitted: set[GuardedProtocol] = field(default_factory=set)
    refused: int = 0
    refusals_logged_at: float | None = None

    def admit(self, protocol: GuardedProtocol, now: float) -> bool:
        """Count ``protocol`` in, unless ``max_connections`` are served already (then log it, sparingly)."""
        if len(self.admitted) < self.max_connections:
            self.admitted.add(protocol)
            return True
        self.refused += 1
        if self.refusals_logged_at is None or now - self.refusals_logged_at >= _REFUSAL_LOG_INTERVAL:
            logger.warning("%d connection(s) refused with 503: %d open, the most --max-connections allows",
                           self.refused, self.max_connections)
            self.refused = 0
            self.refusals_logged_at = now
        return False


class GuardedProtocol(H11Protocol):
    """uvicorn's h11 protocol under the contract of this module (made by :func:`guarded_protocol`).

    Besides asyncio's protocol methods it overrides three of uvicorn's hooks on its protocols:
    ``shutdown`` (called by uvicorn's server on SIGTERM), ``on_response_complete`` (called when a
    response's last byte is written) and ``timeout_keep_alive_handler`` (uvicorn's keep-alive timer).
    Of ``H11Protocol`` it reads only attributes without an underscore (``conn``, ``cycle``,
    ``transport``, ``connections``, ``loop``), and of the h11 connection its public state
    (``their_state``, ``trailing_data``), to tell when a request's headers are in.
    """

    guard: ClassVar[_Guard]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._raw: asyncio.Transport | None = None  # the socket's transport
        self._link: asyncio.Transport | None = None  # what HTTP runs on: the socket's, or TLS over it
        self._admitted = False
        self._begun = False  # H11Protocol.connection_made called
        self._lost = False
        self._finished = False
        self._discarding = False  # answered or closing: what comes in is dropped
        self._early: list[bytes] = []  # decrypted before the handshake's waiter woke us
        self._deadline: asyncio.TimerHandle | None = None
        self._linger: asyncio.TimerHandle | None = None
        self._flush_check: asyncio.TimerHandle | None = None
        self._handshake: asyncio.Task[None] | None = None

    # -- asyncio's protocol interface -------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._raw = transport
        # In uvicorn's set from the start, so that its shutdown reaches a connection still in its handshake.
        self.connections.add(self)
        self._admitted = self.guard.admit(self, self.loop.time())
        self._deadline = self.loop.call_later(self.guard.header_timeout, self._headers_late)
        if self.guard.tls is None:
            self._begin(transport)
        else:
            self._handshake = self.loop.create_task(self._start_tls(transport, self.guard.tls))

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return
        if not self._begun:
            self._early.append(data)
            return
        super().data_received(data)
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._finish()
        if self._begun:
            super().connection_lost(exc)

    # -- uvicorn's hooks --------------------------------------------------------------------------

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            # uvicorn closes after this response (shutdown, or the response said so). With the request
            # all in, nothing the client sends is left unread, so TLS need not wait for its close_notify.
            if self.conn.their_state is h11.DONE:
                self._drop_when_flushed()
        else:
            self._watch()

    def timeout_keep_alive_handler(self) -> None:
        # Part of a next request in (pipelined with the last): not idle, the header deadline governs.
        if not self.transport.is_closing() and not self.conn.trailing_data[0]:
            self._close_idle()

    def shutdown(self) -> None:
        if not self._begun or self._discarding:
            if self._link is not None:
                self._link.abort()
            elif self._raw is not None:
                self._raw.abort()  # mid-handshake
        elif self.cycle is None or self.cycle.response_complete:
            self._close_idle()
        else:
            super().shutdown()  # a request runs: uvicorn closes the connection after its response

    # -- the contract -----------------------------------------------------------------------------

    async def _start_tls(self, raw: asyncio.Transport, context: ssl.SSLContext) -> None:
        options: dict[str, float] = {"ssl_handshake_timeout": self.guard.header_timeout}
        if sys.version_info >= (3, 11):
            options["ssl_shutdown_timeout"] = self.guard.tls_shutdown_timeout
        try:
            tls = await self.loop.start_tls(raw, self, context, server_side=True, **options)
        except asyncio.CancelledError:
            raw.abort()
            self._finish()
            raise
        except Exception as error:  # a failed or timed-out handshake, a client gone: the connection ends
            logger.debug("TLS handshake failed: %r", error)
            raw.abort()
            self._finish()
            return
        if tls is None or self._lost or self._finished:  # lost while the waiter woke us
            raw.abort()
            self._finish()
            return
        self._begin(tls)

    def _begin(self, transport: asyncio.Transport) -> None:
        """Start HTTP on ``transport``, or answer 503 there when the connection was not admitted."""
        self._link = transport
        if not self._admitted:
            self._cancel_deadline()
            transport.write(_raw_response(503, "Service Unavailable", ApiError(
                503, "the server holds as many connections as it may; retry later", type="server_error",
                code="too_many_connections", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})))
            self._linger_close(transport)
            return
        self._begun = True
        super().connection_made(transport)
        early, self._early = self._early, []
        for data in early:
            self.data_received(data)
        self._watch()

    def _waiting_for_headers(self) -> bool:
        return self.conn.their_state is h11.IDLE and not self.transport.is_closing()

    def _watch(self) -> None:
        """Run the header deadline while a request's headers are awaited, from when they began to be."""
        if self._discarding:
            return
        waiting = self._waiting_for_headers()
        if waiting and self._deadline is None:
            self._deadline = self.loop.call_later(self.guard.header_timeout, self._headers_late)
        elif not waiting:
            self._cancel_deadline()

    def _headers_late(self) -> None:
        self._deadline = None
        if not self._begun:
            if self._raw is not None and self._link is None:
                self._raw.abort()  # the handshake is not done
            return
        if self._discarding or not self._waiting_for_headers():
            return
        if self.conn.trailing_data[0]:  # part of a request came
            self.transport.write(_raw_response(408, "Request Timeout", ApiError(
                408, f"the request headers did not arrive within {self.guard.header_timeout:g} seconds",
                code="request_timeout")))
            self._linger_close(self.transport)
        else:
            self._close_idle()

    def _close_idle(self) -> None:
        """Close at once a connection with no request running (over TLS, without awaiting the peer)."""
        self._discarding = True
        self._cancel_deadline()
        self.transport.close()
        self._drop_when_flushed()

    def _drop_when_flushed(self) -> None:
        """Over TLS, end a closing connection once its bytes, ``close_notify`` included, are all with the
        kernel, rather than when the peer answers ``close_notify`` (which an idle client never reads).

        asyncio's TLS transport tells nothing of the socket's buffer, hence the socket transport's
        size, looked at until it is empty (or the connection gone; the TLS shutdown timeout bounds it).
        """
        self._flush_check = None
        if self._lost or self._link is None or self._link is self._raw or self._raw is None:
            return  # gone, or plain TCP: its close is already prompt
        if self._raw.get_write_buffer_size() == 0:
            self._link.abort()
        else:
            self._flush_check = self.loop.call_later(_FLUSH_POLL, self._drop_when_flushed)

    def _linger_close(self, transport: asyncio.Transport) -> None:
        """Close after an answer: the client's bytes are read and dropped for a while, then the socket shut."""
        self._discarding = True
        if transport.can_write_eof():
            transport.write_eof()  # the client reads the answer, then its own close ends the connection
        else:
            transport.close()  # TLS: close_notify after the answer, then asyncio drains until the peer's
        self._linger = self.loop.call_later(CLOSE_LINGER, transport.abort)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _finish(self) -> None:
        """The connection is gone: uncount it (once)."""
        if self._finished:
            return
        self._finished = True
        self._cancel_deadline()
        for timer in (self._linger, self._flush_check):
            if timer is not None:
                timer.cancel()
        self.guard.admitted.discard(self)
        self.connections.discard(self)


def guarded_protocol(header_timeout: float, max_connections: int, tls: ssl.SSLContext | None = None, *,
                     tls_shutdown_timeout: float = TLS_SHUTDOWN_TIMEOUT) -> type[GuardedProtocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` under this module's contract, with its own count.

    Args:
        header_timeout: seconds a request's headers may take (see the module's docstring).
        max_connections: connections served at once; more are answered 503.
        tls: serve HTTPS with this context (see :func:`tls_context`); give uvicorn no TLS files then.
        tls_shutdown_timeout: seconds a TLS close may wait for the peer while bytes are still unsent.
    """
    guard = _Guard(header_timeout=header_timeout, max_connections=max_connections, tls=tls,
                   tls_shutdown_timeout=tls_shutdown_timeout)
    return type("GuardedProtocol", (GuardedProtocol,), {"guard": guard})


def tls_context(certfile: Path, keyfile: Path) -> ssl.SSLContext:
    """A server's TLS context: Python's defaults for a server (TLS 1.2 or later), this key and chain.

    Raises:
        OSError, ssl.SSLError: a file cannot be read, or the key does not match the certificate.
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certfile=str(certfile), keyfile=str(keyfile))
    return context


def listening_sockets(host: str, port: int) -> list[socket.socket]:
    """Bound (not yet listening) sockets for ``host``:``port``, one per address it resolves to, as asyncio.

    Raises:
        OSError: the name does not resolve, or the address is in use.
    """
    sockets: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def raise_open_file_limit(connections: int) -> int | None:
    """Raise this process's soft limit on open files, up to the hard one, to fit ``connections`` and
    :data:`OPEN_FILES_RESERVE`; return the soft limit now in force (never lowered), or None where the
    platform has no such limit (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = connections + OPEN_FILES_RESERVE
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        if target > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    return soft
