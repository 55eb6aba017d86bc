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

Without a function (``response_format: {"type": "json_object"}``) the text stays the message's content.

Either way, a generation cut short keeps or gets ``finish_reason = "length"``: by ``max_tokens``, or
by the constraint giving up mid-way (a limit reached, see :class:`.SequenceConstraint`), which ends the
generation with an end token that would otherwise read as a normal ``"stop"``. The text is then not
complete JSON. Everything else (ids, usage, timestamps) is the completion's own.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["structured_chunks", "structured_completion"]


def _call_id() -> str:
    return "call_" + secrets.token_hex(12)


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
        function: the function called (the content is its arguments), or None (the content stays).
        legacy: answer with ``function_call`` rather than ``tool_calls``.
        cut_short: the constraint gave up while generating (see the module's docstring).

    Returns:
        A new response.
    """
    choice = completion["choices"][0]
    reason = _finish_reason(choice.get("finish_reason"), function, legacy, cut_short)
    message = choice["message"]
    if function is not None:
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
