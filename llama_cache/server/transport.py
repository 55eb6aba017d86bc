"""How a request's bytes come in and a stream's go out: a bounded body read, a disconnect watcher, and
server-sent events fed by a worker thread.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from llama_cache.server.config import DEFAULT_BODY_TIMEOUT
from llama_cache.server.errors import ApiError
from llama_cache.server.jobs import Job

__all__ = ["END", "Disconnect", "EventStream", "read_body"]

END = object()
"""Put on an :class:`EventStream`'s queue: the stream ends (with ``data: [DONE]``)."""


async def read_body(request: Request, limit: int, timeout: float = DEFAULT_BODY_TIMEOUT) -> bytes:
    """The request's body, refused once it passes ``limit`` bytes or takes more than ``timeout`` seconds.

    A body declared larger (``Content-Length``) is refused before any of it is read; one sent in chunks
    is read up to the first chunk past the limit. Memory held is at most ``limit`` plus one chunk. The
    deadline bounds the whole read, from this call to the body's last byte: a client trickling its body
    (a byte a second) is refused when it passes, and nothing more of that body is read.

    Raises:
        ApiError: 413 with code ``request_too_large``; 408 with code ``request_timeout`` and
            ``Connection: close`` (the server then drops the connection, the rest of the body unread).
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and (len(declared.lstrip("0")) > 18 or int(declared) > limit):  # no int() of 5,000 digits
        raise _too_large(limit)
    try:
        return await asyncio.wait_for(_read_chunks(request, limit), timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} seconds",
                       code="request_timeout", headers={"Connection": "close"}) from None


async def _read_chunks(request: Request, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server's limit of {limit} bytes",
                    code="request_too_large")


class Disconnect:
    """Watches a request's ``receive`` channel and cancels its job when the client goes away."""

    def __init__(self, request: Request, job: Job) -> None:
        self.gone = asyncio.Event()
        self._job = job
        self._task = asyncio.ensure_future(self._watch(request.receive))

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._job.cancel.set()
                self.gone.set()
                return

    def close(self) -> None:
        self._task.cancel()


class EventStream(Response):
    """A ``text/event-stream`` response fed by a worker thread through an asyncio queue.

    Each queued item (a chunk, or an :class:`ApiError`) is sent as ``encode`` makes it (default
    :meth:`encode`, OpenAI's: one ``data:`` event per chunk or error body; empty bytes: nothing sent)
    until :data:`END`, which sends ``ending`` (default :attr:`closing`, ``data: [DONE]``). Another API's
    events come from a subclass overriding both, or from the two arguments.
    """

    closing = b"data: [DONE]\n\n"

    def __init__(self, queue: asyncio.Queue[Any], finish: Callable[[], None],
                 encode: Callable[[Any], bytes] | None = None, ending: bytes | None = None) -> None:
        # Not Response.__init__: it would declare a Content-Length of 0.
        self.status_code = 200
        self.background = None
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        self._queue = queue
        self._finish = finish
        self._encode = encode if encode is not None else self.encode
        self._ending = ending if ending is not None else self.closing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            while True:
                item = await self._queue.get()
                if item is END:
                    break
                body = self._encode(item)
                if body:
                    await send({"type": "http.response.body", "body": body, "more_body": True})
            await send({"type": "http.response.body", "body": self._ending, "more_body": False})
        except OSError:  # the client went away while we wrote (ASGI 2.4 servers raise)
            pass
        finally:
            self._finish()

    def encode(self, item: Any) -> bytes:
        """The bytes sent for one queued item (a chunk or an :class:`ApiError`); empty: nothing sent."""
        payload = json.dumps(item.body()) if isinstance(item, ApiError) else json.dumps(item, ensure_ascii=False)
        return f"data: {payload}\n\n".encode()
