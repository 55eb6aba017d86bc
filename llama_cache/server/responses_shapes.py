"""The Responses API's shapes: the response object, its output items and usage, and its stream's events,
made from the chat completions (and chunks) the server generates.

A chat answer gives the output items OpenAI's Responses API gives: its text as one ``message`` item
(``{"type": "message", "id": "msg_...", "role": "assistant", "content": [{"type": "output_text",
"text"}]}``), each tool call as a ``function_call`` item (``{"type": "function_call", "id": "fc_...",
"call_id": "call_...", "name", "arguments"}``). A generation cut by ``max_output_tokens`` (chat's
``finish_reason: "length"``) is ``status: "incomplete"`` with ``incomplete_details: {"reason":
"max_output_tokens"}``. Usage: ``input_tokens``, ``input_tokens_details.cached_tokens`` (the prompt
tokens not evaluated: restored from the prompt cache or live in the context), ``output_tokens``,
``output_tokens_details.reasoning_tokens`` (0: the model answers without a reasoning channel),
``total_tokens``.

Output item ids name their response: ``msg_`` or ``fc_``, the response id's 48 hex digits, then the item's
index in the output as 2 hex digits (:func:`item_id`, :func:`item_origin`), so that an item a client
sends back (an agent re-sending its whole history) leads to the stored response that made it. They are
as unguessable as the response id, and only ever shown to the key that made the response.

:class:`ResponseEvents` turns a chat chunk stream into the documented event sequence, every event with
its ``sequence_number`` (0, 1, ...): ``response.created``, ``response.in_progress``, then per output
item ``response.output_item.added``; for a message ``response.content_part.added``,
``response.output_text.delta`` ..., ``response.output_text.done``, ``response.content_part.done``; for a
call ``response.function_call_arguments.delta`` ..., ``response.function_call_arguments.done``; then
``response.output_item.done``; last ``response.completed`` (``response.incomplete`` when cut short).
"""

from __future__ import annotations

import itertools
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Output", "ResponseEvents", "item_id", "item_origin", "output_of", "usage_of"]

_ITEM_ID = re.compile(r"(?:msg|fc)_([0-9a-f]{48})([0-9a-f]{2})")
_MAX_ITEMS = 256


def item_id(kind: str, response_id: str, index: int) -> str:
    """The id of output item ``index`` (``kind`` ``"message"`` or ``"function_call"``) of ``response_id``."""
    prefix = "msg" if kind == "message" else "fc"
    return f"{prefix}_{response_id.removeprefix('resp_')}{index % _MAX_ITEMS:02x}"


def item_origin(value: object) -> tuple[str, int] | None:
    """The response id and output index an item id made by :func:`item_id` names; None for any other."""
    match = _ITEM_ID.fullmatch(value) if isinstance(value, str) else None
    return None if match is None else ("resp_" + match.group(1), int(match.group(2), 16))


def _random_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    """An assistant ``message`` output item holding ``text``."""
    return {"type": "message", "id": item_id or _random_id("msg"), "status": status, "role": "assistant",
            "content": [_text_part(text)] if status != "in_progress" else []}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed",
              item_id: str | None = None) -> dict[str, Any]:
    """A ``function_call`` output item."""
    return {"type": "function_call", "id": item_id or _random_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


@dataclass
class Output:
    """What a chat answer gives: its output items and its status (``completed`` or ``incomplete``)."""

    items: list[dict[str, Any]]
    status: str

    @property
    def incomplete_details(self) -> dict[str, Any] | None:
        return {"reason": "max_output_tokens"} if self.status == "incomplete" else None


def output_of(completion: dict[str, Any], response_id: str) -> Output:
    """The output of a (shaped) ``chat.completion`` made for ``response_id``: its tool calls as
    ``function_call`` items, or its text as one ``message``."""
    choice = completion["choices"][0]
    message = choice.get("message") or {}
    status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
    calls = message.get("tool_calls") or []
    if calls:
        return Output([call_item(call["id"], call["function"]["name"], call["function"]["arguments"],
                                 item_id=item_id("function_call", response_id, index))
                       for index, call in enumerate(calls)], status)
    return Output([message_item(message.get("content") or "", status, item_id("message", response_id, 0))], status)


def usage_of(usage: dict[str, Any] | None) -> dict[str, Any]:
    """A chat completion's ``usage`` in the Responses API's shape."""
    usage = usage or {}
    prompt = int(usage.get("prompt_tokens", 0))
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    completion = int(usage.get("completion_tokens", 0))
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": max(prompt - cached, 0)},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


Snapshot = Callable[[str, list[dict[str, Any]], dict[str, Any] | None, dict[str, Any] | None], dict[str, Any]]
"""Makes the response object: ``(status, output items, usage, incomplete_details) -> response``."""


@dataclass
class _Open:
    """An output item being streamed."""

    index: int
    item: dict[str, Any]
    parts: list[str] = field(default_factory=list)


class ResponseEvents:
    """The events of one streamed response, from its chat chunks.

    Args:
        snapshot: makes the response object at each stage (see :data:`Snapshot`).
        response_id: the response's id (its items' ids name it: :func:`item_id`).

    Call :meth:`start` first, :meth:`chunk` for each chat chunk that has a choice, then :meth:`finish`
    once with the usage. :attr:`output` is the output streamed so far and :attr:`status` its status.
    ``sequence_number`` is drawn atomically, so :meth:`error` may be called from another thread.
    """

    def __init__(self, snapshot: Snapshot, response_id: str) -> None:
        self._snapshot = snapshot
        self._response_id = response_id
        self._numbers = itertools.count()
        self._message: _Open | None = None
        self._calls: dict[int, _Open] = {}  # the chat call's index -> its item
        self.output: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.closed = False

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": next(self._numbers), **fields}

    def start(self) -> list[dict[str, Any]]:
        response = self._snapshot("in_progress", [], None, None)
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events one chat chunk gives (none for a chunk without a choice)."""
        choices = chunk.get("choices") or []
        if not choices or self.closed:
            return []
        choice = choices[0]
        delta = choice.get("delta") or {}
        events: list[dict[str, Any]] = []
        for call in delta.get("tool_calls") or []:
            events += self._call_delta(call)
        content = delta.get("content")
        if isinstance(content, str) and not delta.get("tool_calls"):
            events += self._text_delta(content)
        reason = choice.get("finish_reason")
        if reason is not None:
            events += self._close("incomplete" if reason == "length" else "completed")
        return events

    def finish(self, usage: dict[str, Any] | None) -> list[dict[str, Any]]:
        """The last events: whatever is still open closed, then ``response.completed`` (or
        ``response.incomplete``) with the whole response."""
        events = [] if self.closed else self._close("completed")
        details = {"reason": "max_output_tokens"} if self.status == "incomplete" else None
        response = self._snapshot(self.status, self.output, usage, details)
        kind = "response.incomplete" if self.status == "incomplete" else "response.completed"
        return [*events, self.event(kind, response=response)]

    def error(self, code: str | None, message: str, param: str | None) -> dict[str, Any]:
        """An ``error`` event (the stream ends after it)."""
        return self.event("error", code=code, message=message, param=param)

    # -- items -----------------------------------------------------------------------------------

    def _next_id(self, kind: str) -> str:
        return item_id(kind, self._response_id, len(self.output))

    def _open(self, item: dict[str, Any]) -> tuple[_Open, dict[str, Any]]:
        opened = _Open(len(self.output), item)
        self.output.append(item)
        return opened, self.event("response.output_item.added", output_index=opened.index, item=dict(item))

    def _text_delta(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._message is None:
            self._message, added = self._open(message_item("", "in_progress", self._next_id("message")))
            events += [added, self.event("response.content_part.added", item_id=self._message.item["id"],
                                         output_index=self._message.index, content_index=0, part=_text_part(""))]
        if text:
            self._message.parts.append(text)
            events.append(self.event("response.output_text.delta", item_id=self._message.item["id"],
                                     output_index=self._message.index, content_index=0, delta=text, logprobs=[]))
        return events

    def _call_delta(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        index = int(call.get("index", 0))
        function = call.get("function") or {}
        events = []
        opened = self._calls.get(index)
        if opened is None:
            opened, added = self._open(call_item(call.get("id") or _random_id("call"), function.get("name") or "", "",
                                                 "in_progress", self._next_id("function_call")))
            self._calls[index] = opened
            events.append(added)
        fragment = function.get("arguments") or ""
        if fragment:
            opened.parts.append(fragment)
            events.append(self.event("response.function_call_arguments.delta", item_id=opened.item["id"],
                                     output_index=opened.index, delta=fragment))
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        self.closed = True
        self.status = status
        events = []
        message = self._message
        if message is not None:
            text = "".join(message.parts)
            item_id = message.item["id"]
            done = message_item(text, status, item_id)
            self.output[message.index] = done
            events += [
                self.event("response.output_text.done", item_id=item_id, output_index=message.index,
                           content_index=0, text=text, logprobs=[]),
                self.event("response.content_part.done", item_id=item_id, output_index=message.index,
                           content_index=0, part=_text_part(text)),
                self.event("response.output_item.done", output_index=message.index, item=done),
            ]
        for opened in self._calls.values():
            arguments = "".join(opened.parts)
            item = opened.item
            done = call_item(item["call_id"], item["name"], arguments, status, item["id"])
            self.output[opened.index] = done
            events += [
                self.event("response.function_call_arguments.done", item_id=item["id"], output_index=opened.index,
                           name=item["name"], arguments=arguments),
                self.event("response.output_item.done", output_index=opened.index, item=done),
            ]
        if not self.output:  # nothing was generated: an empty message, as a whole answer would give
            item = message_item("", status, self._next_id("message"))
            self.output.append(item)
            events += [self.event("response.output_item.added", output_index=0, item=message_item("", "in_progress",
                                                                                                   item["id"])),
                       self.event("response.output_item.done", output_index=0, item=item)]
        return events
