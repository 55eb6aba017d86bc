"""Answers to structured-output requests in OpenAI's shapes, from llama-cpp-python's chat completions.

A request for structured output is generated as a plain chat completion whose text the constraint
(:mod:`.constraints`) keeps to the schema; these functions give its answer the shape OpenAI's API gives.

A named function (``tool_choice: {"type": "function", "function": {"name": ...}}``, or the legacy
``function_call: {"name": ...}``): the text is the call's arguments.

- ``tools``: ``message.tool_calls = [{"id": "call_...", "type": "function", "function": {"name",
  "arguments"}}]``, ``message.content = null``, ``finish_reason = "tool_calls"``; streamed, the first
  delta carries the call's ``index`` (0), ``id``, ``type`` and ``name``, the next ones fragments of
  its ``arguments`` (``{"tool_calls": [{"index": 0, "function": {"arguments": ...}}]}``).
- ``functions`` (legacy): ``message.function_call = {"name", "arguments"}``, ``finish_reason =
  "function_call"``; streamed as ``delta.function_call`` fragments.

Any declared function (``tool_choice: "required"``): the text is ``{"name": ..., "arguments": {...}}``
naming one of them, and the answer is that call, in the ``tools`` shape. Streamed, the text is held
until the generation ends, then sent as one delta holding the whole call (its name is not known before).

Without a function (``response_format``'s ``json_object`` or ``json_schema``) the text stays the
message's content.

Either way, a generation cut short keeps or gets ``finish_reason = "length"``: by ``max_tokens``, or
by the constraint giving up mid-way (a limit reached, see :class:`.SequenceConstraint`), which ends the
generation with an end token that would otherwise read as a normal ``"stop"``. The text is then not
complete JSON. Everything else (ids, usage, timestamps) is the completion's own.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["ANY_FUNCTION", "cut_short_chunks", "cut_short_completion", "structured_chunks", "structured_completion"]

ANY_FUNCTION = "*"
"""``function`` for an answer that calls whichever declared function its text names (``"required"``)."""


def _call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _named_call(text: str) -> dict[str, str] | None:
    """The call a ``"required"`` answer's text makes (``{"name", "arguments"}``), or None if it is cut short."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or "arguments" not in value:
        return None
    return {"name": value["name"], "arguments": json.dumps(value["arguments"], ensure_ascii=False)}


def _finish_reason(reason: str | None, function: str | None, legacy: bool, cut_short: bool) -> str | None:
    if reason is None:
        return None
    if reason == "length" or cut_short:
        return "length"
    if function is None:
        return reason
    return "function_call" if legacy else "tool_calls"


def structured_completion(completion: dict[str, Any], *, function: str | None, legacy: bool = False,
                          cut_short: bool = False) -> dict[str, Any]:
    """``completion`` (a ``chat.completion``) shaped as the answer to a structured-output request.

    Args:
        completion: llama-cpp-python's chat completion; left as it was.
        function: the function called (the content is its arguments), :data:`ANY_FUNCTION` (the content
            names the function and holds its arguments), or None (the content stays).
        legacy: answer with ``function_call`` rather than ``tool_calls``.
        cut_short: the constraint gave up while generating (see the module's docstring).

    Returns:
        A new response.
    """
    choice = completion["choices"][0]
    reason = _finish_reason(choice.get("finish_reason"), function, legacy, cut_short)
    message = choice["message"]
    if function == ANY_FUNCTION:
        named = _named_call(message.get("content") or "")
        if named is None:  # cut short: no call to make; the text is left as it is
            return {**completion, "choices": [{**choice, "finish_reason": "length"}]}
        message = {"role": "assistant", "content": None,
                   "tool_calls": [{"id": _call_id(), "type": "function", "function": named}]}
    elif function is not None:
        call = {"name": function, "arguments": message.get("content") or ""}
        message = {"role": "assistant", "content": None}
        if legacy:
            message["function_call"] = call
        else:
            message["tool_calls"] = [{"id": _call_id(), "type": "function", "function": call}]
    return {**completion, "choices": [{**choice, "message": message, "finish_reason": reason}]}


def structured_chunks(chunks: Iterator[dict[str, Any]], *, function: str | None, legacy: bool = False,
                      cut_short: Callable[[], bool] = lambda: False) -> Iterator[dict[str, Any]]:
    """A ``chat.completion.chunk`` stream shaped as the answer to a structured-output request.

    Every chunk of ``chunks`` gives one chunk, in order, and the iteration runs ``chunks`` to its end
    (llama-cpp-python saves the completion's state there). ``cut_short`` is asked when the chunk with
    the finish reason comes; the other arguments are :func:`structured_completion`'s.
    """
    if function == ANY_FUNCTION:
        yield from _held_call_chunks(chunks, cut_short)
        return
    call_id = _call_id()
    for chunk in chunks:
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        reason = choice.get("finish_reason")
        shaped: dict[str, Any] = delta
        if function is not None:
            if "role" in delta:
                opening = {"name": function, "arguments": ""}
                shaped = {"role": "assistant", "content": None}
                if legacy:
                    shaped["function_call"] = opening
                else:
                    shaped["tool_calls"] = [{"index": 0, "id": call_id, "type": "function", "function": opening}]
            elif "content" in delta:
                fragment = {"arguments": delta["content"] or ""}
                shaped = {"function_call": fragment} if legacy else {"tool_calls": [{"index": 0, "function": fragment}]}
            else:
                shaped = {}
        finish = _finish_reason(reason, function, legacy, reason is not None and cut_short())
        yield {**chunk, "choices": [{**choice, "delta": shaped, "finish_reason": finish}]}


def _held_call_chunks(chunks: Iterator[dict[str, Any]], cut_short: Callable[[], bool]) -> Iterator[dict[str, Any]]:
    """A ``"required"`` answer's stream: the role first, then the whole call, then the finish reason."""
    text: list[str] = []
    for chunk in chunks:
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        reason = choice.get("finish_reason")
        if "role" in delta:
            yield {**chunk, "choices": [{**choice, "delta": {"role": "assistant", "content": None}}]}
            continue
        text.append(delta.get("content") or "")
        if reason is None:
            continue
        named = None if reason == "length" or cut_short() else _named_call("".join(text))
        if named is None:
            yield {**chunk, "choices": [{**choice, "delta": {"content": "".join(text)}, "finish_reason": None}]}
            yield {**chunk, "choices": [{**choice, "delta": {}, "finish_reason": "length"}]}
            continue
        call = {"index": 0, "id": _call_id(), "type": "function", "function": named}
        yield {**chunk, "choices": [{**choice, "delta": {"tool_calls": [call]}, "finish_reason": None}]}
        yield {**chunk, "choices": [{**choice, "delta": {}, "finish_reason": "tool_calls"}]}


def cut_short_completion(completion: dict[str, Any], cut_short: bool) -> dict[str, Any]:
    """A text completion made under a grammar: ``finish_reason`` ``"length"`` if the grammar gave up mid-way."""
    if not cut_short:
        return completion
    return {**completion, "choices": [{**choice, "finish_reason": "length"} for choice in completion["choices"]]}


def cut_short_chunks(chunks: Iterator[dict[str, Any]], cut_short: Callable[[], bool]) -> Iterator[dict[str, Any]]:
    """The same for a text completion's chunks: the finish reason is checked when it comes."""
    for chunk in chunks:
        choice = chunk["choices"][0]
        if choice.get("finish_reason") is not None and cut_short():
            chunk = {**chunk, "choices": [{**choice, "finish_reason": "length"}]}
        yield chunk
