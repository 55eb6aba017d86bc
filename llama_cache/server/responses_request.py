"""A Responses API request (``POST /v1/responses``) checked, and its fields as the chat request's.

:func:`parse_responses_request` checks the body field by field (a 400 naming the Responses field at
fault, in OpenAI's error shape) and gives a :class:`ResponsesRequest`: the new input as chat messages,
the chat fields that serve it (``max_tokens``, ``temperature``, ``top_p``, ``tools``, ``tool_choice``,
``response_format``, and the extensions ``seed``, ``top_k``, ``min_p``, ``cache_salt``), and what the
response object echoes. Fields the API defines that this server cannot honour are refused, never
ignored (see :mod:`.openai_responses`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from llama_cache.server.errors import ApiError
from llama_cache.server.limits import RequestLimits, limit_error
from llama_cache.server.responses_shapes import item_origin

__all__ = ["ResponsesRequest", "call_text", "parse_responses_request", "text_content"]

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_INPUT_PARTS = {"input_text", "output_text", "text", "refusal"}
_PASSED = ("seed", "top_k", "min_p", "cache_salt")
_REFUSED = {"background": "background responses", "conversation": "the Conversations API",
            "prompt": "prompt templates"}
_MAX_METADATA = 16


@dataclass
class ResponsesRequest:
    """A checked ``POST /v1/responses`` body: its new input as chat messages, and what the response
    object echoes (``echo``: instructions, tools, tool_choice, text, ... as OpenAI returns them).

    ``origins``: the assistant items of ``input`` that this server made (their ids name their response:
    :func:`.responses_shapes.item_origin`), as (index in ``messages``, response id, output index, item).
    """

    messages: list[dict[str, Any]]
    instructions: str | None
    previous_response_id: str | None
    store: bool
    stream: bool
    model: str | None
    chat: dict[str, Any] = field(default_factory=dict)
    echo: dict[str, Any] = field(default_factory=dict)
    origins: list[tuple[int, str, int, dict[str, Any]]] = field(default_factory=list)


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"'{param}' {message}", param=param, code=code)


def _unsupported(param: str, what: str) -> ApiError:
    return ApiError(400, f"'{param}': {what} is not supported by this server", param=param,
                    code="unsupported_parameter")


def _short(value: object) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_responses_request(body: dict[str, Any], limits: RequestLimits, n_ctx: int) -> ResponsesRequest:
    """Check a ``/v1/responses`` body; the chat fields it gives are in ``chat`` (checked again, with the
    chat route's limits, when the chat request is parsed). ``n_ctx`` bounds ``max_output_tokens``.

    Raises:
        ApiError: 400 naming the first field at fault.
    """
    for name, what in _REFUSED.items():
        if body.get(name) not in (None, False):
            raise _unsupported(name, what)
    if body.get("truncation") not in (None, "disabled"):
        raise _unsupported("truncation", "truncation other than \"disabled\"")
    if body.get("top_logprobs") not in (None, 0):
        raise _unsupported("top_logprobs", "log probabilities")
    flags = {}
    for name, default in (("store", True), ("stream", False), ("parallel_tool_calls", True)):
        value = body.get(name)
        if value is None:
            value = default
        if not isinstance(value, bool):
            raise _bad(name, f"must be a boolean, got {_short(value)}", "invalid_type")
        flags[name] = value
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", f"must be a string, got {_short(model)}", "invalid_type")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("instructions", f"must be a string, got {_short(instructions)}", "invalid_type")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise _bad("previous_response_id", f"must be a string, got {_short(previous)}", "invalid_type")
    if "input" not in body or body["input"] is None:
        raise ApiError(400, "'input' is required", param="input", code="missing")
    messages, origins = _input_messages(body["input"], limits)
    chat: dict[str, Any] = {}
    max_output = body.get("max_output_tokens")
    if max_output is not None:
        if isinstance(max_output, bool) or not isinstance(max_output, int):
            raise _bad("max_output_tokens", f"must be an integer, got {_short(max_output)}", "invalid_type")
        if not 1 <= max_output <= n_ctx:
            raise _bad("max_output_tokens", f"must be between 1 and the context size ({n_ctx} tokens), "
                       f"got {max_output}")
        chat["max_tokens"] = max_output
    for name in ("temperature", "top_p", *_PASSED):
        if body.get(name) is not None:
            chat[name] = body[name]
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
                         for tool in tools]
    tool_choice = body.get("tool_choice")
    chat_choice = _tool_choice(tool_choice, tools)
    if chat_choice is not None:
        chat["tool_choice"] = chat_choice
    text = body.get("text")
    text_echo, response_format = _text(text)
    if response_format is not None:
        chat["response_format"] = response_format
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > _MAX_METADATA or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in metadata.items())):
        raise _bad("metadata", f"must map at most {_MAX_METADATA} keys (up to 64 characters) to strings "
                   "(up to 512 characters)")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("user", f"must be a string, got {_short(user)}", "invalid_type")
    echo = {
        "instructions": instructions, "max_output_tokens": max_output, "metadata": metadata or {},
        "parallel_tool_calls": flags["parallel_tool_calls"], "previous_response_id": previous,
        "store": flags["store"], "temperature": chat.get("temperature"), "top_p": chat.get("top_p"),
        "text": text_echo, "tool_choice": tool_choice if tool_choice is not None else "auto", "tools": tools,
        "truncation": "disabled", "user": user, "reasoning": {"effort": None, "summary": None},
        "background": False, "service_tier": "default",
    }
    return ResponsesRequest(messages=messages, instructions=instructions, previous_response_id=previous,
                            store=flags["store"], stream=flags["stream"], model=model, chat=chat, echo=echo,
                            origins=origins)


def _input_messages(value: object, limits: RequestLimits
                    ) -> tuple[list[dict[str, Any]], list[tuple[int, str, int, dict[str, Any]]]]:
    """``input`` as chat messages, and the origins of the assistant items this server made (see
    :class:`ResponsesRequest`)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}], []
    if not isinstance(value, list):
        raise _bad("input", f"must be a string or a list of items, got {_short(value)}", "invalid_type")
    if len(value) > limits.max_messages:
        raise limit_error("input", f"holds {len(value)} items; this server accepts at most {limits.max_messages}")
    messages: list[dict[str, Any]] = []
    origins = []
    for index, item in enumerate(value):
        param = f"input[{index}]"
        if not isinstance(item, dict):
            raise _bad(param, f"must be an object, got {_short(item)}", "invalid_type")
        kind = item.get("type", "message")
        origin = item_origin(item.get("id")) if kind in ("message", "function_call") else None
        if origin is not None and (kind == "function_call" or item.get("role") == "assistant"):
            origins.append((len(messages), origin[0], origin[1], item))
        if kind == "message":
            messages.append(_message(param, item))
        elif kind == "function_call":
            messages.append(_call_message(param, item))
        elif kind == "function_call_output":
            messages.append(_call_output(param, item))
        elif kind == "reasoning":
            continue
        else:
            raise _unsupported(f"{param}.type", f"an input item of type {_short(kind)}")
    return messages, origins


def _message(param: str, item: dict[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise _bad(f"{param}.role", f"must be one of {', '.join(_ROLES)}, got {_short(role)}")
    return {"role": _ROLES[role], "content": text_content(f"{param}.content", item.get("content"))}


def text_content(param: str, content: object) -> str:
    """A content: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(param, f"must be a string or a list of content parts, got {_short(content)}", "invalid_type")
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        kind = kind if isinstance(kind, str) else None  # a list or object is no type (nor hashable)
        if kind in ("input_image", "input_file", "input_audio"):
            raise _unsupported(f"{param}[{index}]", f"{kind} content (this server serves a text model)")
        text = part.get("refusal" if kind == "refusal" else "text") if isinstance(part, dict) else None
        if kind not in _INPUT_PARTS or not isinstance(text, str):
            raise _bad(f"{param}[{index}]", "must be a text part ({\"type\": \"input_text\", \"text\": ...}), "
                       f"got {_short(part)}")
        texts.append(text)
    return "".join(texts)


def _call_message(param: str, item: dict[str, Any]) -> dict[str, Any]:
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str):
            raise _bad(f"{param}.{name}", f"must be a string, got {_short(item.get(name))}", "invalid_type")
    return {"role": "assistant", "content": call_text(item["name"], item["arguments"])}


def call_text(name: str, arguments: str) -> str:
    """How a function call is written in a conversation's assistant turn: the JSON the model writes
    when it calls one (``{"name": ..., "arguments": {...}}``)."""
    try:
        value: Any = json.loads(arguments)
    except ValueError:
        value = arguments
    return json.dumps({"name": name, "arguments": value}, ensure_ascii=False)


def _call_output(param: str, item: dict[str, Any]) -> dict[str, Any]:
    call_id = item.get("call_id")
    if not isinstance(call_id, str):
        raise _bad(f"{param}.call_id", f"must be a string, got {_short(call_id)}", "invalid_type")
    return {"role": "tool", "content": text_content(f"{param}.output", item.get("output")), "tool_call_id": call_id}


def _tools(value: object) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _bad("tools", f"must be a list of tools, got {_short(value)}", "invalid_type")
    tools = []
    for index, tool in enumerate(value):
        param = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise _bad(param, f"must be an object, got {_short(tool)}", "invalid_type")
        if tool.get("type") != "function":
            raise _unsupported(f"{param}.type", f"a tool of type {_short(tool.get('type'))} (function tools only)")
        if not isinstance(tool.get("name"), str):
            raise _bad(f"{param}.name", f"must be a string, got {_short(tool.get('name'))}", "invalid_type")
        kept = {key: tool[key] for key in ("type", "name", "description", "parameters", "strict")
                if tool.get(key) is not None}
        tools.append(kept)
    return tools


def _tool_choice(value: object, tools: list[dict[str, Any]]) -> Any:
    """``tool_choice`` as chat's."""
    if value is None or value in ("auto", "none"):
        return value if tools else None
    if value == "required":
        return "required"
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise _bad("tool_choice", "must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"name\": ...}, "
               f"got {_short(value)}")


def _text(value: object) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``text`` as echoed, and chat's ``response_format`` for its ``format`` (None for plain text)."""
    if value is None:
        return {"format": {"type": "text"}}, None
    if not isinstance(value, dict):
        raise _bad("text", f"must be an object, got {_short(value)}", "invalid_type")
    spec = value.get("format")
    if spec is None:
        return {**value, "format": {"type": "text"}}, None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "text":
        return dict(value), None
    if kind == "json_object":
        return dict(value), {"type": "json_object"}
    if kind != "json_schema":
        raise _bad("text.format", "must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                   f"{{\"type\": \"json_schema\", \"name\": ..., \"schema\": {{...}}}}, got {_short(spec)}")
    assert isinstance(spec, dict)
    if not isinstance(spec.get("name"), str):
        raise _bad("text.format.name", f"must be a string, got {_short(spec.get('name'))}", "invalid_type")
    if not isinstance(spec.get("schema"), dict):
        raise _bad("text.format.schema", f"must be a JSON schema object, got {_short(spec.get('schema'))}",
                   "invalid_type")
    inner = {key: spec[key] for key in ("name", "description", "schema", "strict") if spec.get(key) is not None}
    return dict(value), {"type": "json_schema", "json_schema": inner}
