"""How an API other than OpenAI's rides the chat route: its requests become chat requests, and the chat
answers leave in its own shapes.

The chat route (:mod:`.app`) reads, validates, renders, queues and runs every request the same way,
under the same limits, access control, tenants, metrics and drain; a :class:`Dialect` changes only its
edges:

- :meth:`Dialect.chat_body`: the API's request body, checked in the API's own terms, as the OpenAI chat
  completions body it asks for (which the chat validation then checks too, as any chat request);
- :meth:`Dialect.error`: how a refusal is answered;
- :meth:`Dialect.answers`: per request, how its whole answer (:meth:`Answers.whole`, from a
  ``chat.completion``) or its stream (:meth:`Answers.stream`, from ``chat.completion.chunk`` items on
  the request's queue) leaves.

The base classes are OpenAI's own shapes, unchanged: the chat and completions routes use them. Since
a dialect's requests are chat requests, a prompt one API renders is the prompt another renders from
the same conversation, and the prompt cache serves them alike.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse, Response

from llama_cache.server.errors import ApiError
from llama_cache.server.protocol import ChatRequest, CompletionRequest
from llama_cache.server.jobs import Job
from llama_cache.server.transport import EventStream

__all__ = ["OPENAI", "Answers", "Dialect"]


class Answers:
    """How one request's answer leaves the server: as OpenAI's, unchanged."""

    def whole(self, result: dict[str, Any]) -> Response:
        """The response for a finished, non-streamed ``result`` (a completion as :mod:`.choices` makes it)."""
        return JSONResponse(result)

    def stream(self, queue: asyncio.Queue[Any], finish: Callable[[], None]) -> Response:
        """The streamed response reading ``queue`` (chunks, :class:`ApiError` items, then ``END``);
        ``finish`` is called once it ends, however it ends."""
        return EventStream(queue, finish=finish)


class Dialect:
    """The API a route speaks (see the module docstring); this base speaks OpenAI's."""

    def chat_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat completions body ``body`` asks for (OpenAI's: ``body`` itself).

        Raises:
            ApiError: 400 for a body this API refuses.
        """
        return body

    def error(self, error: ApiError) -> Response:
        """The response refusing a request with ``error``."""
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    def answers(self, parsed: ChatRequest | CompletionRequest, job: Job) -> Answers:
        """How the answer to ``parsed`` leaves; ``job`` is the request's run (its usage and sampled tokens
        are read once the answer is known)."""
        return Answers()


OPENAI = Dialect()
"""OpenAI's shapes, for the chat and completions routes."""
