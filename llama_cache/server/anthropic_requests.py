"""Anthropic Messages API requests, checked and turned into the OpenAI chat completions bodies they ask for.

:func:`chat_body` takes a ``POST /v1/messages`` (or ``/v1/messages/count_tokens``) body and gives the
chat body the server's chat route then validates and serves as any other (:mod:`.dialects`). Every
field Anthropic defines is checked here first, so that a refusal names the Anthropic field at fault
(``messages[1].content[0].type``); what the chat validation checks after it (the limits on messages,
text and tools, the schemas, the context size) it checks for both APIs alike.

The conversation becomes chat messages as OpenAI clients write the same conversation, so that both
render to the same prompt (and so share the prompt cache):

- ``system`` (a string, or text blocks joined): a ``system`` message first; an empty one is none;
- a message whose ``content`` is a string: the same message;
- an assistant's blocks: one ``assistant`` message, its text blocks joined as its ``content`` (``""``
  when it has none), its ``tool_use`` blocks as ``tool_calls`` (``arguments`` the input as compact
  JSON), its ``thinking`` blocks' text as ``reasoning_content`` (the key templates of reasoning models
  read; ``redacted_thinking`` is dropped);
- a user's blocks: each ``tool_result`` as a ``tool`` message (``tool_call_id``, its text as
  ``content``, ``is_error`` kept as a key), in order, then one ``user`` message holding the text blocks
  joined, if there are any (or if there was no block at all);
- an empty ``messages`` list: one empty user turn (llama-server accepts it too; Anthropic refuses it).

``image`` and ``document`` blocks, anywhere, are refused: the served model reads text only. So are
other block types (server tools' blocks, search results), and tools other than client tools.

Options: ``max_tokens`` (required, except to count tokens), ``stop_sequences`` (as ``stop``: at most
as many as the chat route takes), ``temperature`` (0 to 1, Anthropic's range), ``top_p``, ``top_k``,
``stream``, ``tools`` (``{"name", "description"?, "input_schema"}`` as function tools),
``tool_choice`` (``auto``, ``none``, ``any`` as ``"required"``, ``tool`` as a named function: a forced
call is generated under the chat route's schema constraint), ``output_config.format``
(``{"type": "json_schema", "schema"}``, Anthropic's structured outputs, as a ``json_schema``
``response_format``: the text is an instance of the schema), ``cache_salt`` (this server's, as on the
chat route). ``metadata``, ``thinking`` and ``output_config.effort`` are checked for their shape and
have no effect; ``cache_control`` (top level or on a block) has none either: the prompt cache is
automatic. Unknown fields are ignored, as the chat route ignores them (``temperature``, ``top_p`` and
``top_k``, which the current ``anthropic`` client no longer sends, are still honoured).
"""

from __future__ import annotations

import json
from typing import Any

from llama_cache.server.errors import ApiError
from llama_cache.server.protocol import FUNCTION_NAME, MAX_STOP_SEQUENCES
from llama_cache.server.refusals import short

__all__ = ["UNSUPPORTED_MEDIA", "chat_body"]

ROLES = ("user", "assistant")
UNSUPPORTED_MEDIA = "input is not supported: this server's model reads text only"
"""Said after ``image`` or ``document`` in the refusal of such a block."""
# Client tools: a type of "custom", or none. Anthropic's server tools (bash_20250124, web_search_...)
# run on Anthropic's side.
_CLIENT_TOOL_TYPES = (None, "custom")
_THINKING_TYPES = ("enabled", "disabled", "adaptive", "between_tools")


def _error(param: str, message: str) -> ApiError:
    return ApiError(400, f"'{param}' {message}", param=param, code="invalid_value")


def _type_error(param: str, expected: str, value: object) -> ApiError:
    return ApiError(400, f"'{param}' must be {expected}, got {type(value).__name__}: {short(value)}",
                    param=param, code="invalid_type")


def _number(body: dict[str, Any], name: str, low: float, high: float, chat: dict[str, Any]) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise _type_error(name, "a number", value)
    if not low <= value <= high:
        raise _error(name, f"must be between {low:g} and {high:g}, got {value}")
    chat[name] = value


def chat_body(body: dict[str, Any], *, counting: bool = False) -> dict[str, Any]:
    """The OpenAI chat completions body an Anthropic Messages ``body`` asks for (see the module docstring).

    Args:
        body: the decoded JSON object.
        counting: the body is a ``count_tokens`` request: ``max_tokens`` is not required, and the
            options that only shape the generation are not carried over.

    Raises:
        ApiError: 400 naming the first field that Anthropic's API defines otherwise or that this
            server does not serve (an image, a server tool).
    """
    chat: dict[str, Any] = {}
    model = body.get("model")
    if model is None:
        raise ApiError(400, "'model' is required", param="model", code="missing")
    if not isinstance(model, str):
        raise _type_error("model", "a string", model)
    chat["model"] = model
    messages = _system(body.get("system")) + _messages(body.get("messages"), "messages" in body)
    if not any(message["role"] != "system" for message in messages):
        messages.append({"role": "user", "content": ""})
    chat["messages"] = messages
    chat.update(_tools(body.get("tools"), body.get("tool_choice")))
    chat.update(_output_config(body.get("output_config"), forced=chat.get("tool_choice") not in (None, "auto", "none")))
    _metadata(body.get("metadata"))
    _thinking(body.get("thinking"))
    salt = body.get("cache_salt")
    if salt is not None:
        chat["cache_salt"] = salt  # checked by the chat validation
    if counting:
        return chat
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise ApiError(400, "'max_tokens' is required", param="max_tokens", code="missing")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise _type_error("max_tokens", "an integer", max_tokens)
    if max_tokens < 1:
        raise _error("max_tokens", f"must be at least 1, got {max_tokens}")
    chat["max_tokens"] = max_tokens
    stream = body.get("stream")
    if stream is not None:
        if not isinstance(stream, bool):
            raise _type_error("stream", "a boolean", stream)
        chat["stream"] = stream
        if stream:  # the usage comes last, for message_delta
            chat["stream_options"] = {"include_usage": True}
    _number(body, "temperature", 0.0, 1.0, chat)
    _number(body, "top_p", 0.0, 1.0, chat)
    top_k = body.get("top_k")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int):
            raise _type_error("top_k", "an integer", top_k)
        if top_k < 0:
            raise _error("top_k", f"must be at least 0, got {top_k}")
        chat["top_k"] = top_k  # bounded by the vocabulary in the chat validation
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(stop, str) for stop in stops):
            raise _type_error("stop_sequences", "a list of strings", stops)
        if len(stops) > MAX_STOP_SEQUENCES:
            raise _error("stop_sequences", f"holds at most {MAX_STOP_SEQUENCES} sequences on this server, "
                         f"got {len(stops)}")
        chat["stop"] = stops
    return chat


def _text_blocks(param: str, value: object) -> str:
    """The text of a list of text blocks (``system``, a tool result's content), joined."""
    if not isinstance(value, list):
        raise _type_error(param, "a string or a list of text blocks", value)
    texts = []
    for index, block in enumerate(value):
        where = f"{param}[{index}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in ("image", "document"):
            raise ApiError(400, f"'{where}': {kind} {UNSUPPORTED_MEDIA}", param=where, code="unsupported_content")
        if kind != "text":
            raise _error(where, f"must be a text block ({{\"type\": \"text\", \"text\": ...}}), got {short(block)}")
        texts.append(_text(where, block))
    return "".join(texts)


def _text(where: str, block: dict[str, Any]) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _type_error(f"{where}.text", "a string", text)
    return text


def _system(value: object) -> list[dict[str, Any]]:
    if value is None:
        return []
    text = value if isinstance(value, str) else _text_blocks("system", value)
    return [{"role": "system", "content": text}] if text else []


def _messages(value: object, present: bool) -> list[dict[str, Any]]:
    if not present:
        raise ApiError(400, "'messages' is required", param="messages", code="missing")
    if not isinstance(value, list):
        raise _type_error("messages", "a list of messages", value)
    chat: list[dict[str, Any]] = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise _type_error(where, "an object", message)
        role = message.get("role")
        if role not in ROLES:
            raise _error(f"{where}.role", f"must be 'user' or 'assistant', got {short(role)}")
        content = message.get("content")
        if isinstance(content, str):
            chat.append({"role": role, "content": content})
        elif isinstance(content, list):
            chat.extend(_assistant_blocks(where, content) if role == "assistant" else _user_blocks(where, content))
        else:
            raise _type_error(f"{where}.content", "a string or a list of content blocks", content)
    return chat


def _block_kind(where: str, block: object, allowed: tuple[str, ...], role: str) -> str:
    """A block's type, checked: one of ``allowed`` (media refused as such, other types named)."""
    if not isinstance(block, dict):
        raise _type_error(where, "a content block (an object)", block)
    kind = block.get("type")
    if kind in ("image", "document"):
        raise ApiError(400, f"'{where}': {kind} {UNSUPPORTED_MEDIA}", param=where, code="unsupported_content")
    if kind not in allowed:
        raise _error(f"{where}.type", f"must be one of {', '.join(allowed)} in a {role} message, got {short(kind)}")
    return str(kind)


def _assistant_blocks(where: str, blocks: list[Any]) -> list[dict[str, Any]]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    thinking: list[str] = []
    for index, block in enumerate(blocks):
        at = f"{where}.content[{index}]"
        kind = _block_kind(at, block, ("text", "tool_use", "thinking", "redacted_thinking"), "assistant")
        if kind == "text":
            texts.append(_text(at, block))
        elif kind == "tool_use":
            calls.append(_tool_call(at, block))
        elif kind == "thinking":
            text = block.get("thinking")
            if not isinstance(text, str):
                raise _type_error(f"{at}.thinking", "a string", text)
            thinking.append(text)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    return [message]


def _tool_call(where: str, block: dict[str, Any]) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not call_id:
        raise _type_error(f"{where}.id", "a non-empty string", call_id)
    if not isinstance(name, str) or not name:
        raise _type_error(f"{where}.name", "a non-empty string", name)
    if not isinstance(arguments, dict):
        raise _type_error(f"{where}.input", "an object", arguments)
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))}}


def _user_blocks(where: str, blocks: list[Any]) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    texts: list[str] = []
    for index, block in enumerate(blocks):
        at = f"{where}.content[{index}]"
        kind = _block_kind(at, block, ("text", "tool_result"), "user")
        if kind == "text":
            texts.append(_text(at, block))
            continue
        tool_use_id = block.get("tool_use_id")
        if not isinstance(tool_use_id, str) or not tool_use_id:
            raise _type_error(f"{at}.tool_use_id", "a non-empty string", tool_use_id)
        content = block.get("content")
        text = "" if content is None else content if isinstance(content, str) else _text_blocks(f"{at}.content", content)
        result: dict[str, Any] = {"role": "tool", "tool_call_id": tool_use_id, "content": text}
        is_error = block.get("is_error")
        if is_error is not None:
            if not isinstance(is_error, bool):
                raise _type_error(f"{at}.is_error", "a boolean", is_error)
            result["is_error"] = is_error
        results.append(result)
    if texts or not results:
        results.append({"role": "user", "content": "".join(texts)})
    return results


def _tools(tools: object, choice: object) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` as the chat route's ``tools`` and ``tool_choice``."""
    chat: dict[str, Any] = {}
    names: list[str] = []
    if tools is not None:
        if not isinstance(tools, list):
            raise _type_error("tools", "a list of tools", tools)
        declared = []
        for index, tool in enumerate(tools):
            where = f"tools[{index}]"
            if not isinstance(tool, dict):
                raise _type_error(where, "an object", tool)
            if tool.get("type") not in _CLIENT_TOOL_TYPES:
                raise _error(f"{where}.type", f"names a server tool ({short(tool.get('type'))}); this server "
                             "serves client tools only ({\"name\", \"description\", \"input_schema\"})")
            name, description, schema = tool.get("name"), tool.get("description"), tool.get("input_schema")
            if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
                raise _error(f"{where}.name", f"must be 1 to 64 letters, digits, '_' or '-', got {short(name)}")
            if description is not None and not isinstance(description, str):
                raise _type_error(f"{where}.description", "a string", description)
            if not isinstance(schema, dict):
                raise _type_error(f"{where}.input_schema", "a JSON schema object", schema)
            function: dict[str, Any] = {"name": name, "parameters": schema}
            if description is not None:
                function["description"] = description
            declared.append({"type": "function", "function": function})
            names.append(name)
        if declared:
            chat["tools"] = declared
    if choice is None:
        return chat
    kind = choice.get("type") if isinstance(choice, dict) else None
    shape = '{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": ...} or {"type": "none"}'
    if kind not in ("auto", "any", "tool", "none"):
        raise _error("tool_choice", f"must be {shape}, got {short(choice)}")
    assert isinstance(choice, dict)
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise _type_error("tool_choice.disable_parallel_tool_use", "a boolean", parallel)
    if kind in ("auto", "none"):
        if names:
            chat["tool_choice"] = kind
        return chat
    if not names:
        raise _error("tool_choice", f"is {short(choice)} but 'tools' declares no tool")
    if kind == "any":
        chat["tool_choice"] = "required"
        return chat
    name = choice.get("name")
    if not isinstance(name, str):
        raise _type_error("tool_choice.name", "a string", name)
    if name not in names:
        raise _error("tool_choice.name", f"names the tool {short(name)}, which 'tools' does not declare")
    chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    return chat


def _output_config(value: object, forced: bool) -> dict[str, Any]:
    """``output_config``: its ``format`` as the chat route's ``response_format`` (``effort`` checked only)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _type_error("output_config", "an object", value)
    effort = value.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise _type_error("output_config.effort", "a string", effort)
    spec = value.get("format")
    if spec is None:
        return {}
    if not isinstance(spec, dict) or spec.get("type") != "json_schema":
        raise _error("output_config.format", f"must be {{\"type\": \"json_schema\", \"schema\": {{...}}}}, "
                     f"got {short(spec)}")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise _type_error("output_config.format.schema", "a JSON schema object", schema)
    if forced:
        raise _error("output_config.format", "cannot be combined with a tool_choice that forces a tool")
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}}


def _metadata(value: object) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise _type_error("metadata", "an object", value)
    user = value.get("user_id")
    if user is not None and not isinstance(user, str):
        raise _type_error("metadata.user_id", "a string", user)


def _thinking(value: object) -> None:
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in _THINKING_TYPES:
        raise _error("thinking", f"must be {{\"type\": \"enabled\", \"budget_tokens\": ...}}, {{\"type\": "
                     f"\"disabled\"}} or {{\"type\": \"adaptive\"}}, got {short(value)}")
    assert isinstance(value, dict)
    budget = value.get("budget_tokens")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)):
        raise _type_error("thinking.budget_tokens", "an integer", budget)
