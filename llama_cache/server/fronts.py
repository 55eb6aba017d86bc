"""The seam through which another API rides the chat route: a :class:`ChatFront` per request.

An API other than chat completions (OpenAI's Responses API, :mod:`.openai_responses`) is served by
translating each of its requests into the chat completion request the server already serves, and that
request's answer back: the same validation, limits, tenants, routing, prompt cache, metrics and drain.
The app (:meth:`._Server._complete`) calls a front at four points of a request's life, in this order:

1. :meth:`ChatFront.chat_body` in the parsing thread, with the decoded body: the chat request's body;
2. :meth:`ChatFront.rendered` in the parsing thread, with the prompt's tokens once rendered: the
   tokens to route and evaluate instead;
3. in the request's worker thread, with its context: :meth:`ChatFront.substitute` as the context's
   ``prompt_substitute``, then :meth:`ChatFront.whole` with the chat completion (not streamed), or
   :meth:`ChatFront.stream` over the chat chunks (streamed);
4. :meth:`ChatFront.encode` on the event loop, for each item a stream sends (errors included).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

__all__ = ["ChatFront"]


class ChatFront(Protocol):
    """One request of another API, translated to and from a chat completion."""

    def chat_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat completion body that serves ``body`` (this API's request, decoded).

        May block (a store read). Raises :class:`~.errors.ApiError` for a request to refuse.
        """
        ...

    def rendered(self, tokens: list[int]) -> list[int]:
        """The tokens to evaluate for the chat request's rendered prompt ``tokens`` (before it is queued):
        ``tokens``, or tokens of the same text."""
        ...

    def substitute(self, prompt: list[int]) -> list[int]:
        """The tokens to evaluate for a completion's ``prompt``: what :meth:`rendered` returned when
        ``prompt`` is the rendered prompt, else ``prompt``."""
        ...

    def whole(self, completion: dict[str, Any], llama: Any) -> dict[str, Any]:
        """The answer to send for a chat completion generated on ``llama`` (its context, now holding the
        prompt and the answer). Runs in the worker thread, the slot still held; may block."""
        ...

    def stream(self, chunks: Iterator[Any], llama: Any) -> Iterator[Any]:
        """The items to stream for the chat chunks generated on ``llama``. Every item of ``chunks`` that
        is not a chunk (a dict), such as :data:`~.choices.ANSWERED`, must be passed on in place, and
        ``chunks`` run to its end. Runs in the worker thread."""
        ...

    def encode(self, item: Any) -> bytes:
        """One streamed item (or an :class:`~.errors.ApiError` ending the stream) as server-sent event bytes."""
        ...

    @property
    def ending(self) -> bytes:
        """The bytes that end a stream (chat's ``data: [DONE]``, or nothing)."""
        ...
