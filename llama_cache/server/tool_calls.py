"""A named function's call in OpenAI's response shapes, from a chat completion whose content is its arguments.

A request that names the function to call (``tool_choice: {"type": "function", "function": {"name":
...}}``, or the legacy ``function_call: {"name": ...}``) is generated as a plain chat completion whose
text is constrained to the function's arguments (:mod:`.constraints`); these functions reshape that
completion as OpenAI answers such a request:

- ``tools``: ``message.tool_calls = [{"id": "call_...", "type": "function", "function": {"name",
  "arguments"}}]``, ``message.content = null``, ``finish_reason = "tool_calls"``; streamed, the first
  delta carries the call's ``index`` (0), ``id``, ``type`` and ``name``, the next ones fragments of
  its ``arguments`` (``{"tool_calls": [{"index": 0, "function": {"arguments": ...}}]}``).
- ``functions`` (legacy): ``message.function_call = {"name", "arguments"}``, ``finish_reason =
  "function_call"``; streamed as ``delta.function_call`` fragments.

A generation cut short by ``max_tokens`` keeps ``finish_reason = "length"`` (its arguments are not
complete JSON). Everything else (ids, usage, timestamps) is the completion's own.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

__all__ = ["as_function_call", "as_function_call_chunks"]


def _call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _finish_reason(reason: str | None, legacy: bool) -> str | None:
    if reason is None or reason == "length":
        return reason
    return "function_call" if legacy else "tool_calls"


def as_function_call(completion: dict[str, Any], name: str, *, legacy: bool = False) -> dict[str, Any]:
    """``completion`` (a ``chat.completion`` whose content is the arguments) as a call of ``name``.

    Returns:
        A new response; ``completion`` is left as it was.
    """
    choice = completion["choices"][0]
    arguments = choice["message"].get("content") or ""
    function = {"name": name, "arguments": arguments}
    message: dict[str, Any] = {"role": "assistant", "content": None}
    if legacy:
        message["function_call"] = function
    else:
        message["tool_calls"] = [{"id": _call_id(), "type": "function", "function": function}]
    shaped_choice = {**choice, "message": message, "finish_reason": _finish_reason(choice.get("finish_reason"), legacy)}
    return {**completion, "choices": [shaped_choice]}


def as_function_call_chunks(chunks: Iterator[dict[str, Any]], name: str, *,
                            legacy: bool = False) -> Iterator[dict[str, Any]]:
    """Stream chunks of a call of ``name``, from a ``chat.completion.chunk`` stream of its arguments.

    Every chunk of ``chunks`` gives one chunk, in order, and the iteration runs ``chunks`` to its end
    (llama-cpp-python saves the completion's state there).
    """
    call_id = _call_id()
    for chunk in chunks:
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        reason = choice.get("finish_reason")
        shaped: dict[str, Any]
        if "role" in delta:
            opening = {"name": name, "arguments": ""}
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
        yield {**chunk, "choices": [{**choice, "delta": shaped, "finish_reason": _finish_reason(reason, legacy)}]}
