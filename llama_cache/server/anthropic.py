"""The Anthropic Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) over the chat route.

A Messages request is checked and turned into the chat request it asks for
(:mod:`.anthropic_requests`), which the chat route serves as any other (:mod:`.dialects`); this module
shapes what comes back as Anthropic's API does:

- A whole answer (:func:`message`): ``{"id": "msg_...", "type": "message", "role": "assistant",
  "model", "content": [blocks], "stop_reason", "stop_sequence", "usage"}``. The content is one ``text``
  block (its text possibly empty), or, for a forced tool (``tool_choice`` ``any`` or ``tool``), one
  ``tool_use`` block ``{"id": "toolu_...", "name", "input"}`` whose ``input`` is the generated
  arguments parsed (``{}`` when ``max_tokens`` cut them short).
- ``stop_reason``: ``end_turn`` (the model ended its turn), ``stop_sequence`` (one of the
  ``stop_sequences`` ended it: ``stop_sequence`` names which), ``max_tokens`` (``max_tokens`` or the
  constraint's limits cut it short), ``tool_use`` (a complete forced call).
- ``usage``: ``input_tokens`` the prompt tokens evaluated for this request, ``cache_read_input_tokens``
  those served from the prompt cache (the chat route's ``cached_tokens``; the two add up to the prompt),
  ``cache_creation_input_tokens`` 0 (every prompt is saved into the cache, at no cost to report),
  ``output_tokens`` the completion's tokens.
- A stream (:class:`MessageEvents`): ``message_start`` (the message without content, and the prompt's
  usage), then per content block ``content_block_start``, ``content_block_delta`` items
  (``text_delta``, or ``input_json_delta`` fragments of a tool's input) and ``content_block_stop``,
  with block ``index`` from 0; one ``ping`` after the first block's start; then ``message_delta``
  (``stop_reason``, ``stop_sequence`` and the whole usage) and ``message_stop``. Each is a server-sent
  event with its type as the ``event:`` name; a failure mid-stream is an ``error`` event. Nothing
  follows ``message_stop`` (no ``[DONE]``).
- Errors (:func:`error_body`): ``{"type": "error", "error": {"type", "message"}}`` with the status the
  chat route gives, the type Anthropic's for that status (``invalid_request_error`` for a 400,
  ``authentication_error`` 401, ``not_found_error`` 404, ``request_too_large`` 413,
  ``overloaded_error`` for a 503 of a full queue or a drain, ``api_error`` for a 500).
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import JSONResponse, Response

from llama_cache.server.anthropic_requests import chat_body
from llama_cache.server.choices import Usage
from llama_cache.server.dialects import Answers, Dialect
from llama_cache.server.errors import ApiError
from llama_cache.server.protocol import ChatRequest, CompletionRequest
from llama_cache.server.jobs import Job
from llama_cache.server.transport import EventStream

__all__ = ["AnthropicDialect", "MessageEvents", "StopSequences", "error_body", "is_messages_path", "message"]

MESSAGES_PATH = "/v1/messages"
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 529: "overloaded_error"}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def is_messages_path(path: str) -> bool:
    """Whether a request path is one of the Messages API's (its refusals are then Anthropic-shaped)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_body(error: ApiError) -> dict[str, Any]:
    """``error`` in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``.

    The message is the chat route's, a function's parameters named as the tool's ``input_schema``, the
    ``response_format`` schema as ``output_config.format.schema``.
    """
    kind = _ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    text = error.message.replace(".function.parameters", ".input_schema").replace(
        "response_format.json_schema.schema", "output_config.format.schema")
    return {"type": "error", "error": {"type": kind, "message": text}}


def _message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def _tool_use_id() -> str:
    return "toolu_" + secrets.token_hex(12)


def _usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, int]:
    return {"input_tokens": max(prompt_tokens - cached_tokens, 0), "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached_tokens, "output_tokens": output_tokens}


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as a tool's ``input``: ``{}`` when they are not a whole JSON object (cut short)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


@dataclass
class StopSequences:
    """Which of a request's stop sequences ended its text, from the text and the tokens it sampled.

    llama-cpp-python answers ``"stop"`` for an end-of-turn token and a stop sequence alike, and cuts the
    sequence from the text; the sampled tokens' text still holds it right after the answer's text.
    """

    sequences: list[str]
    generated: Callable[[], bytes]
    """The text of every token sampled for the answer (asked once it is finished)."""

    def which(self, text: str) -> str | None:
        """The stop sequence that ended an answer whose returned text is ``text``; None: none did."""
        if not self.sequences:
            return None
        full, head = self.generated(), text.encode("utf-8")
        rest = full[len(head):] if full.startswith(head) else full
        for stop in self.sequences:
            if stop and rest.startswith(stop.encode("utf-8")):
                return stop
        return next((stop for stop in self.sequences if stop and stop.encode("utf-8") in rest), None)

    def reason(self, finish: str | None, text: str) -> tuple[str, str | None]:
        """``(stop_reason, stop_sequence)`` for a choice's ``finish_reason`` and its text."""
        if finish in _STOP_REASONS:
            return _STOP_REASONS[finish], None
        stop = self.which(text)
        return ("stop_sequence", stop) if stop is not None else ("end_turn", None)


def message(completion: dict[str, Any], stops: StopSequences, message_id: str | None = None) -> dict[str, Any]:
    """A ``chat.completion`` (shaped by :mod:`.responses` for a forced tool) as an Anthropic ``message``."""
    choice = completion["choices"][0]
    chat = choice.get("message") or {}
    text = chat.get("content") or ""
    content: list[dict[str, Any]] = []
    for call in chat.get("tool_calls") or []:
        function = call.get("function") or {}
        content.append({"type": "tool_use", "id": _tool_use_id(), "name": function.get("name", ""),
                        "input": _input(function.get("arguments") or "")})
    if text or not content:
        content.insert(0, {"type": "text", "text": text})
    reason, sequence = stops.reason(choice.get("finish_reason"), text)
    usage = completion.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"id": message_id or _message_id(), "type": "message", "role": "assistant",
            "model": completion.get("model", ""), "content": content, "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": _usage(usage.get("prompt_tokens", 0), cached, usage.get("completion_tokens", 0))}


Event = tuple[str, dict[str, Any]]


@dataclass
class MessageEvents:
    """Turns one request's ``chat.completion.chunk`` stream into Anthropic's events, chunk by chunk.

    Feed every chunk, in order, to :meth:`events`; the usage chunk that ends the chat stream
    (``"choices": []``) gives ``message_delta`` and ``message_stop``. ``usage`` is asked at the first
    chunk, once the prompt is evaluated, for ``message_start``'s prompt counts.
    """

    stops: StopSequences
    usage: Callable[[], Usage | None]
    message_id: str = field(default_factory=_message_id)
    _started: bool = field(default=False, init=False)
    _pinged: bool = field(default=False, init=False)
    _blocks: int = field(default=0, init=False)  # blocks started so far: the next one's index
    _open: int | None = field(default=None, init=False)
    _tools: dict[int, int] = field(default_factory=dict, init=False)  # chat tool call index -> block index
    _text: list[str] = field(default_factory=list, init=False)
    _reason: tuple[str, str | None] = field(default=("end_turn", None), init=False)

    def events(self, chunk: dict[str, Any]) -> list[Event]:
        out: list[Event] = []
        if not self._started:
            self._started = True
            usage = self.usage() or Usage()
            out.append(("message_start", {"type": "message_start", "message": {
                "id": self.message_id, "type": "message", "role": "assistant", "model": chunk.get("model", ""),
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": _usage(usage.prompt_tokens, usage.cached_tokens, 0)}}))
        if not chunk.get("choices"):
            counts = chunk.get("usage") or {}
            cached = (counts.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            reason, sequence = self._reason
            out.append(("message_delta", {"type": "message_delta",
                                          "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                          "usage": _usage(counts.get("prompt_tokens", 0), cached,
                                                          counts.get("completion_tokens", 0))}))
            out.append(("message_stop", {"type": "message_stop"}))
            return out
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        text = delta.get("content")
        if text:
            if self._open is None or self._open in self._tools.values():
                self._start(out, {"type": "text", "text": ""})
            self._text.append(text)
            out.append(("content_block_delta", {"type": "content_block_delta", "index": self._open,
                                                "delta": {"type": "text_delta", "text": text}}))
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id") is not None or call.get("index") not in self._tools:
                self._start(out, {"type": "tool_use", "id": _tool_use_id(), "name": function.get("name", ""),
                                  "input": {}})
                self._tools[call.get("index", 0)] = self._blocks - 1
            arguments = function.get("arguments")
            if arguments:
                out.append(("content_block_delta", {"type": "content_block_delta",
                                                    "index": self._tools[call.get("index", 0)],
                                                    "delta": {"type": "input_json_delta", "partial_json": arguments}}))
        finish = choice.get("finish_reason")
        if finish is not None:
            if not self._blocks:
                self._start(out, {"type": "text", "text": ""})
            self._close(out)
            self._reason = self.stops.reason(finish, "".join(self._text))
        return out

    def _start(self, out: list[Event], block: dict[str, Any]) -> None:
        self._close(out)
        self._open = self._blocks
        self._blocks += 1
        out.append(("content_block_start", {"type": "content_block_start", "index": self._open,
                                            "content_block": block}))
        if not self._pinged:
            self._pinged = True
            out.append(("ping", {"type": "ping"}))

    def _close(self, out: list[Event]) -> None:
        if self._open is not None:
            out.append(("content_block_stop", {"type": "content_block_stop", "index": self._open}))
            self._open = None


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


class MessageEventStream(EventStream):
    """The Messages API's event stream, fed with the chat route's chunks (see :class:`MessageEvents`)."""

    closing = b""

    def __init__(self, queue: asyncio.Queue[Any], finish: Callable[[], None], events: MessageEvents) -> None:
        super().__init__(queue, finish)
        self._events = events

    def encode(self, item: Any) -> bytes:
        if isinstance(item, ApiError):
            return _event("error", error_body(item))
        return b"".join(_event(name, data) for name, data in self._events.events(item))


class MessageAnswers(Answers):
    """One Messages request's answer, whole or streamed (see the module docstring)."""

    def __init__(self, stops: StopSequences, usage: Callable[[], Usage | None]) -> None:
        self._stops = stops
        self._usage = usage

    def whole(self, result: dict[str, Any]) -> Response:
        return JSONResponse(message(result, self._stops))

    def stream(self, queue: asyncio.Queue[Any], finish: Callable[[], None]) -> Response:
        return MessageEventStream(queue, finish, MessageEvents(self._stops, self._usage))


class AnthropicDialect(Dialect):
    """The Messages API on the chat route.

    Args:
        detokenize: the model's tokens' text (special tokens' as nothing): finds which stop sequence
            ended an answer.
        counting: for ``count_tokens`` (``max_tokens`` not required).
    """

    def __init__(self, detokenize: Callable[[list[int]], bytes], *, counting: bool = False) -> None:
        self._detokenize = detokenize
        self._counting = counting

    def chat_body(self, body: dict[str, Any]) -> dict[str, Any]:
        return chat_body(body, counting=self._counting)

    def error(self, error: ApiError) -> Response:
        return JSONResponse(error_body(error), status_code=error.status, headers=error.headers)

    def answers(self, parsed: ChatRequest | CompletionRequest, job: Job) -> Answers:
        def generated() -> bytes:
            run = job.run
            return self._detokenize(list(run.samplings[0].sampled)) if run is not None and run.samplings else b""

        stops = StopSequences(list(parsed.options.get("stop") or []), generated)
        return MessageAnswers(stops, lambda: job.usage)
