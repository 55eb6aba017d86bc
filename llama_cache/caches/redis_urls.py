"""Redis URLs fit to show: passwords kept out of log lines, ``repr`` and error messages.

Plain string work, apart from :mod:`llama_cache.caches.redis_client` so that a program that only shows a
configured URL (the server's configuration) does not import redis-py. Stateless and thread-safe.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

__all__ = ["redact_url", "url_secrets"]

_PASSWORD_ARGUMENT = re.compile(r"([?&]password=)([^&#]*)", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` fit for a log line: its password, and any ``password=`` query argument, as ``***``.

    ``redis://user:secret@host:6379/0`` becomes ``redis://user:***@host:6379/0`` and
    ``redis://:secret@host:6379`` ``redis://:***@host:6379``. User information without a colon
    (``redis://secret@host``, often meant as a password) is replaced whole. Everything up to the last
    ``@`` counts as user information, so an ``@`` inside an unescaped password is covered too. A URL
    without credentials is returned unchanged.
    """
    scheme, separator, rest = url.partition("://")
    if not separator:
        scheme, rest = "", url
    userinfo, at, location = rest.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        rest = f"{user}:***@{location}" if colon else f"***@{location}"
    return scheme + separator + _PASSWORD_ARGUMENT.sub(r"\1***", rest)


def url_secrets(url: str) -> list[str]:
    """What :func:`redact_url` hides, as written and percent-decoded, longest first: to scrub messages."""
    rest = url.partition("://")[2] or url
    userinfo, at, _ = rest.rpartition("@")
    user, colon, password = userinfo.partition(":")
    secrets = [password if colon else user] if at else []
    secrets += [match.group(2) for match in _PASSWORD_ARGUMENT.finditer(rest)]
    found = {text for secret in secrets for text in (secret, unquote(secret)) if text}
    return sorted(found, key=len, reverse=True)
