"""Request validation for the OpenAI-compatible endpoints, and the error bodies they answer with.

A request body is checked field by field before it reaches a context: every problem becomes an
:class:`ApiError` (a 4xx with OpenAI's error shape, ``{"error": {"message", "type", "param", "code"}}``)
naming the offending field, so bad input never reaches llama.cpp. Unknown fields are ignored, as the
official client sends some that servers need not know; fields the OpenAI API defines but this server
does not honour are refused rather than ignored (``echo`` with ``logprobs``, ``best_of`` > 1).

Sampling parameters are passed to ``llama_cpp.Llama.create_completion`` / ``create_chat_completion``
under their llama-cpp-python names; what each choice samples with besides them (its seed, its
``logit_bias``, its log probabilities, its structured output) is a :class:`Sampling`, which the app turns
into one :class:`~.sequences.SequenceSampling` per choice. The prompt is resolved to tokens later.

Tools (``tools`` / ``tool_choice``, and the legacy ``functions`` / ``function_call``) are checked
here; what the answer must be (a JSON object for ``response_format: {"type": "json_object"}``, a schema's
instance for ``{"type": "json_schema"}``, a named function's arguments for a named ``tool_choice``, a call
of any declared function for ``"required"``) becomes a :class:`StructuredOutput`, which the app compiles
(:mod:`.constraints`) and enforces itself: such a request never reaches llama-cpp-python's grammar code,
which builds a GBNF grammar from the schema (llama.cpp crashes on some and takes minutes on others).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from llama_cache.server.errors import ApiError
from llama_cache.server.limits import RequestLimits, check_schema, limit_error
from llama_cache.server.refusals import SchemaPart

__all__ = ["ApiError", "ChatRequest", "CompletionRequest", "Sampling", "StructuredOutput", "parse_chat_request",
           "parse_completion_request", "parse_json_body"]

# The OpenAI API allows at most 4 stop sequences.
MAX_STOP_SEQUENCES = 4
# The OpenAI API's bound on top_logprobs (chat) and logprobs (completions, where it is 5: 20 here too).
MAX_TOP_LOGPROBS = 20
# Characters of a ``cache_salt``: a salt names a namespace, it need not be a document.
MAX_CACHE_SALT = 256
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
# OpenAI's rule for a function's name.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# The arguments of a function declared without ``parameters``: OpenAI's "empty parameter list".
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class Sampling:
    """How a request's choices are sampled, besides the options llama-cpp-python takes.

    Attributes:
        n: choices to generate (1 to ``RequestLimits.max_choices``), from one evaluation of the prompt.
        seed: the first choice's seed; choice ``i`` samples with ``seed + i`` (None: llama-cpp-python
            draws them).
        logit_bias: token id -> bias added to its logit at every step.
        logprobs: log probabilities asked for: None for none, else how many of the likeliest tokens
            to list beside each sampled one (0 to :data:`MAX_TOP_LOGPROBS`).
        include_usage: a stream ends with a chunk holding the usage (``stream_options``).
    """

    n: int = 1
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    include_usage: bool = False


@dataclass
class CompletionRequest:
    """A validated ``POST /v1/completions`` body.

    ``prompt`` is the text, or the token ids the client sent; ``options`` holds the keyword arguments
    for ``create_completion`` other than ``prompt``, ``stream``, ``max_tokens``, ``seed`` and
    ``logit_bias`` (those two are in ``sampling``); ``echo``: each choice's text starts with the
    prompt's; ``cache_salt``: the prompt cache namespace the client asked for (None: none).
    """

    prompt: str | list[int]
    stream: bool
    max_tokens: int | None
    model: str | None
    options: dict[str, Any] = field(default_factory=dict)
    sampling: Sampling = field(default_factory=Sampling)
    structured: StructuredOutput | None = None
    echo: bool = False
    cache_salt: str | None = None


@dataclass(frozen=True)
class StructuredOutput:
    """What a chat answer must be: a JSON object, or the arguments of one named function.

    ``schema`` is the JSON schema the generated text follows (``{"type": "object"}`` for
    ``json_object``); ``function`` names the function the answer calls (None: the JSON is the message's
    content); ``any_function`` is true for ``tool_choice: "required"``: the text is then
    ``{"name": ..., "arguments": {...}}`` for one of the declared functions (``schema`` is their
    ``anyOf``), which the answer turns into that call; ``legacy`` is true when it was asked for through
    ``functions`` / ``function_call`` (the answer is then a ``function_call``, not ``tool_calls``);
    ``param`` is the request field the schema came from, which an error about the schema names;
    ``parts`` the subschemas that came from fields of their own (a function's parameters: a refusal
    inside one names that field, such as ``tools[1].function.parameters``);
    ``gbnf`` is a GBNF grammar (llama-cpp-python's ``grammar`` field) the text follows instead of a schema.
    """

    schema: dict[str, Any]
    param: str
    function: str | None = None
    legacy: bool = False
    any_function: bool = False
    gbnf: str | None = None
    parts: tuple[SchemaPart, ...] = ()


@dataclass
class ChatRequest:
    """A validated ``POST /v1/chat/completions`` body.

    ``messages`` have plain-string contents (text parts joined); ``options`` holds the keyword
    arguments for ``create_chat_completion`` other than ``messages``, ``stream``, ``max_tokens``, ``seed``
    and ``logit_bias`` (those two are in ``sampling``);
    ``template_options`` those that also shape the prompt (the tools or functions, and a
    ``tool_choice`` / ``function_call`` of ``"none"`` or ``"auto"``: a named one is in ``structured``,
    never passed on, so llama-cpp-python builds no grammar for it); ``cache_salt``: the prompt cache
    namespace the client asked for (None: none).
    """

    messages: list[dict[str, Any]]
    stream: bool
    max_tokens: int | None
    model: str | None
    options: dict[str, Any] = field(default_factory=dict)
    template_options: dict[str, Any] = field(default_factory=dict)
    structured: StructuredOutput | None = None
    sampling: Sampling = field(default_factory=Sampling)
    cache_salt: str | None = None


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object.

    Raises:
        ApiError: 400 when it is not UTF-8 JSON or not an object.
    """
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as error:  # ValueError: also an integer literal of 4,300+ digits
        raise ApiError(400, f"the request body is not valid JSON: {_short(str(error))}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def _type_error(param: str, expected: str, value: object) -> ApiError:
    return ApiError(400, f"'{param}' must be {expected}, got {type(value).__name__}: {_short(value)}",
                    param=param, code="invalid_type")


def _value_error(param: str, message: str) -> ApiError:
    return ApiError(400, f"'{param}' {message}", param=param, code="invalid_value")


def _short(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(float(value)))


def _number(body: dict[str, Any], name: str, low: float, high: float, target: str | None = None,
            options: dict[str, Any] | None = None) -> None:
    value = body.get(name)
    if value is None:
        return
    if not _is_number(value):
        raise _type_error(name, "a number", value)
    if not low <= value <= high:
        raise _value_error(name, f"must be between {low:g} and {high:g}, got {value}")
    if options is not None:
        options[target or name] = float(value)


def _max_tokens(body: dict[str, Any], n_ctx: int, default: int | None) -> int | None:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(name)
    if value is None:  # absent or null: the endpoint's default (OpenAI's 16 for completions)
        value = default
    if value is None:
        return None
    if not _is_int(value):
        raise _type_error(name, "an integer", value)
    if value < 1:
        raise _value_error(name, f"must be at least 1, got {value}")
    if value > n_ctx:
        raise _value_error(name, f"must be at most the context size ({n_ctx} tokens), got {value}")
    return int(value)


def _common(body: dict[str, Any], n_ctx: int, n_vocab: int, default_max_tokens: int | None,
            limits: RequestLimits) -> tuple[bool, int | None, str | None, dict[str, Any], Sampling]:
    """The fields both endpoints share: stream, max_tokens, model, the sampling options and the
    :class:`Sampling` (its ``logprobs`` left to each endpoint, whose fields differ)."""
    options: dict[str, Any] = {}
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _type_error("stream", "a boolean", stream)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _type_error("model", "a string", model)
    max_tokens = _max_tokens(body, n_ctx, default_max_tokens)
    _number(body, "temperature", 0.0, 2.0, options=options)
    _number(body, "top_p", 0.0, 1.0, options=options)
    _number(body, "min_p", 0.0, 1.0, options=options)
    _number(body, "typical_p", 0.0, 1.0, options=options)
    _number(body, "presence_penalty", -2.0, 2.0, options=options)
    _number(body, "frequency_penalty", -2.0, 2.0, options=options)
    _number(body, "repeat_penalty", 0.0, 10.0, options=options)
    top_k = body.get("top_k")
    if top_k is not None:
        if not _is_int(top_k):
            raise _type_error("top_k", "an integer", top_k)
        if not 0 <= top_k <= n_vocab:
            raise _value_error("top_k", f"must be between 0 and the vocabulary size ({n_vocab}), got {top_k}")
        options["top_k"] = int(top_k)
    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed):
            raise _type_error("seed", "an integer", seed)
        seed = int(seed) & 0xFFFFFFFF
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise _type_error("stop", "a string or a list of strings", stop)
        if len(stop) > MAX_STOP_SEQUENCES:
            raise _value_error("stop", f"holds at most {MAX_STOP_SEQUENCES} sequences, got {len(stop)}")
        options["stop"] = [s for s in stop if s]
    n = body.get("n")
    if n is None:
        n = 1
    if not _is_int(n):
        raise _type_error("n", "an integer", n)
    if not 1 <= n <= limits.max_choices:
        raise _value_error("n", f"must be between 1 and {limits.max_choices} (this server's limit), got {n}")
    logit_bias = body.get("logit_bias")
    bias = _logit_bias(logit_bias, n_vocab) if logit_bias is not None else {}
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise _type_error("stream_options", "an object", stream_options)
        if not stream:
            raise _value_error("stream_options", "is only allowed when 'stream' is true")
        include_usage = stream_options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise _type_error("stream_options.include_usage", "a boolean", include_usage)
    sampling = Sampling(n=int(n), seed=seed, logit_bias=bias, include_usage=include_usage)
    return stream, max_tokens, model, options, sampling


def _logit_bias(value: object, n_vocab: int) -> dict[int, float]:
    """``logit_bias`` checked: token ids of this vocabulary (as decimal strings) to biases in [-100, 100]."""
    if not isinstance(value, dict):
        raise _type_error("logit_bias", "an object mapping token ids to numbers", value)
    checked: dict[int, float] = {}
    digits = len(str(n_vocab))
    for key, bias in value.items():
        # Digits counted before int(): Python refuses to convert more than 4,300 of them.
        if not (key.isascii() and key.isdigit() and len(key) <= digits) or not 0 <= int(key) < n_vocab:
            raise _value_error("logit_bias", f"maps {_short(key)}, which is not a token id of this model "
                               f"(0..{n_vocab - 1})")
        if not _is_number(bias) or not -100 <= bias <= 100:
            raise _value_error("logit_bias", f"maps token {key} to {_short(bias)}; a bias is a number "
                               "between -100 and 100")
        checked[int(key)] = float(bias)
    return checked


def parse_completion_request(body: dict[str, Any], n_ctx: int, n_vocab: int,
                             limits: RequestLimits) -> CompletionRequest:
    """Validate a ``/v1/completions`` body.

    Args:
        body: the decoded JSON object.
        n_ctx: the context size (bounds ``max_tokens`` and the prompt).
        n_vocab: the vocabulary size (bounds token ids: the prompt's, ``logit_bias``'s, ``top_k``).
        limits: bounds the prompt's text (``max_prompt_bytes``).

    Raises:
        ApiError: 400 naming the first invalid field.
    """
    stream, max_tokens, model, options, sampling = _common(body, n_ctx, n_vocab, 16, limits)
    if "prompt" not in body:
        raise ApiError(400, "'prompt' is required", param="prompt", code="missing")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(_is_int(t) for t in prompt):
            raise _type_error("prompt", "a string, a list of token ids, or a list of one of those", prompt)
        if len(prompt) >= n_ctx:
            raise context_length_error("prompt", f"{len(prompt)} tokens long", n_ctx)
        bad = next((t for t in prompt if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise _value_error("prompt", f"holds token id {bad}, outside the vocabulary (0..{n_vocab - 1})")
        prompt = [int(t) for t in prompt]
    elif not isinstance(prompt, str):
        raise _type_error("prompt", "a string, a list of token ids, or a list of one of those", prompt)
    elif len(prompt) > limits.max_prompt_bytes or len(prompt.encode("utf-8")) > limits.max_prompt_bytes:
        raise context_length_error("prompt", f"{len(prompt.encode('utf-8'))} bytes of text", n_ctx)
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise _type_error("echo", "a boolean", echo)
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise _type_error("suffix", "a string", suffix)
    logprobs = body.get("logprobs")
    if logprobs is not None and logprobs is not False:  # false: some clients' way of asking for none
        if not _is_int(logprobs):
            raise _type_error("logprobs", "an integer", logprobs)
        if not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise _value_error("logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}, got {logprobs}")
        if echo:
            raise ApiError(400, "'logprobs' with 'echo': the prompt's log probabilities are not supported by "
                           "this server (its contexts keep one row of logits, not one per prompt token)",
                           param="logprobs", code="unsupported_parameter")
        sampling = replace(sampling, logprobs=int(logprobs))
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1 and best_of != sampling.n:
        raise _value_error("best_of", "must be 1 or equal to 'n' (every choice generated is returned)")
    return CompletionRequest(prompt=prompt, stream=stream, max_tokens=max_tokens, model=model, options=options,
                             sampling=sampling, structured=_grammar(body.get("grammar"), limits), echo=bool(echo),
                             cache_salt=_cache_salt(body))


def _cache_salt(body: dict[str, Any]) -> str | None:
    """``cache_salt`` (vLLM's field): a non-empty string that keeps this request's prompt cache apart."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str):
        raise _type_error("cache_salt", "a string", salt)
    if not 0 < len(salt) <= MAX_CACHE_SALT:
        raise _value_error("cache_salt", f"must be 1 to {MAX_CACHE_SALT} characters long, got {len(salt)}")
    return salt


def context_length_error(param: str, size: str, n_ctx: int) -> ApiError:
    """The 400 for a prompt that cannot fit the context (``size`` says how big it is)."""
    return ApiError(400, f"the prompt is {size}; this server's context holds {n_ctx} tokens, prompt and "
                    "completion together", param=param, code="context_length_exceeded")


def _message_content(index: int, message: dict[str, Any]) -> str | None:
    content = message.get("content")
    param = f"messages[{index}].content"
    if content is None or isinstance(content, str):
        if content is None and message["role"] not in ("assistant", "tool", "function"):
            raise ApiError(400, f"'{param}' is required for role '{message['role']}'", param=param, code="missing")
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _value_error(param, "may only hold text parts ({\"type\": \"text\", \"text\": ...})")
            texts.append(part["text"])
        return "".join(texts)
    raise _type_error(param, "a string or a list of text parts", content)


def parse_chat_request(body: dict[str, Any], n_ctx: int, n_vocab: int, limits: RequestLimits) -> ChatRequest:
    """Validate a ``/v1/chat/completions`` body.

    Args:
        body: the decoded JSON object.
        n_ctx: the context size (bounds ``max_tokens``).
        n_vocab: the vocabulary size (bounds ``logit_bias``'s token ids, ``top_k``).
        limits: bounds the messages (``max_messages``, ``max_prompt_bytes``) and tools (``max_tools``).

    Raises:
        ApiError: 400 naming the first invalid field.
    """
    stream, max_tokens, model, options, sampling = _common(body, n_ctx, n_vocab, None, limits)
    if "messages" not in body:
        raise ApiError(400, "'messages' is required", param="messages", code="missing")
    raw = body["messages"]
    if not isinstance(raw, list):
        raise _type_error("messages", "a list of messages", raw)
    if not raw:
        raise _value_error("messages", "must hold at least one message")
    if len(raw) > limits.max_messages:
        raise limit_error("messages", f"holds {len(raw)} messages; this server accepts at most {limits.max_messages}")
    messages: list[dict[str, Any]] = []
    text_bytes = 0
    for index, message in enumerate(raw):
        if not isinstance(message, dict):
            raise _type_error(f"messages[{index}]", "an object", message)
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise _value_error(f"messages[{index}].role", f"must be one of {', '.join(sorted(CHAT_ROLES))}, "
                               f"got {_short(role)}")
        cleaned = dict(message)
        cleaned["role"] = "system" if role == "developer" else role
        cleaned["content"] = _message_content(index, message)
        text_bytes += len(cleaned["content"] or "")
        messages.append(cleaned)
    if text_bytes > limits.max_prompt_bytes:  # characters: at least as many UTF-8 bytes
        raise context_length_error("messages", f"at least {text_bytes} bytes of text", n_ctx)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _type_error("logprobs", "a boolean", logprobs)
    top_logprobs = body.get("top_logprobs")
    if top_logprobs is not None:
        if not _is_int(top_logprobs):
            raise _type_error("top_logprobs", "an integer", top_logprobs)
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise _value_error("top_logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}, got {top_logprobs}")
        if not logprobs:
            raise _value_error("top_logprobs", "needs 'logprobs': true")
    if logprobs:
        sampling = replace(sampling, logprobs=int(top_logprobs or 0))
    template_options, structured = _tools(body, limits)
    for other in (_response_format(body.get("response_format"), limits), _grammar(body.get("grammar"), limits)):
        if other is not None:
            if structured is not None:
                raise _value_error(other.param.split(".")[0], "cannot be combined with another structured output "
                                   "(a response_format, a grammar, or a tool_choice that forces a call)")
            structured = other
    return ChatRequest(messages=messages, stream=stream, max_tokens=max_tokens, model=model, options=options,
                       template_options=template_options, structured=structured, sampling=sampling,
                       cache_salt=_cache_salt(body))


def _grammar(value: object, limits: RequestLimits) -> StructuredOutput | None:
    """llama-cpp-python's ``grammar`` field checked: a GBNF grammar within the limits, or None."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise _type_error("grammar", "a GBNF grammar (a string)", value)
    size = len(value.encode("utf-8"))
    if size > limits.max_grammar_bytes:
        raise limit_error("grammar", f"is {size} bytes; this server accepts at most {limits.max_grammar_bytes}")
    rules = value.count("::=")
    if rules > limits.max_grammar_rules:
        raise limit_error("grammar", f"holds {rules} rules; this server accepts at most {limits.max_grammar_rules}")
    return StructuredOutput(schema={}, param="grammar", gbnf=value)


def _response_format(value: object, limits: RequestLimits) -> StructuredOutput | None:
    """``response_format`` checked: None for text, else the structured output it asks for.

    ``{"type": "json_schema", "json_schema": {"name", "description"?, "schema"?, "strict"?}}``: the
    answer is an instance of ``schema`` (any JSON value without one). It is enforced whether ``strict``
    is true or not: the engine masks every token the schema does not allow.
    """
    if value is None:
        return None
    shape = ('{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
             '{"name": ..., "schema": {...}}}')
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(schema={"type": "object"}, param="response_format")
    if kind != "json_schema":
        raise _value_error("response_format", f"must be {shape}, got {_short(value)}")
    spec = value.get("json_schema")
    param = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise _type_error(param, "an object", spec)
    name = spec.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise _value_error(f"{param}.name", f"must be 1 to 64 letters, digits, '_' or '-', got {_short(name)}")
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise _type_error(f"{param}.description", "a string", description)
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _type_error(f"{param}.strict", "a boolean", strict)
    schema = spec.get("schema")
    if schema is None:
        schema = {}
    if not isinstance(schema, dict):
        raise _type_error(f"{param}.schema", "a JSON schema object", schema)
    check_schema(schema, f"{param}.schema", limits)
    return StructuredOutput(schema=schema, param=f"{param}.schema")


def _tools(body: dict[str, Any], limits: RequestLimits) -> tuple[dict[str, Any], StructuredOutput | None]:
    """``tools`` / ``tool_choice`` (or the legacy ``functions`` / ``function_call``), checked.

    Returns:
        The options that shape the prompt (the tools as sent, a ``"none"`` / ``"auto"`` choice), and
        the structured output a named choice asks for (None otherwise).
    """
    legacy = body.get("functions") is not None or body.get("function_call") is not None
    if legacy and (body.get("tools") is not None or body.get("tool_choice") is not None):
        raise _value_error("functions", "cannot be combined with 'tools' (functions and function_call are "
                           "the legacy form of tools and tool_choice)")
    list_param, choice_param = ("functions", "function_call") if legacy else ("tools", "tool_choice")
    declared = body.get(list_param)
    if isinstance(declared, list) and len(declared) > limits.max_tools:
        raise limit_error(list_param, f"holds {len(declared)} functions; this server accepts at most "
                          f"{limits.max_tools}")
    schemas = _function_schemas(list_param, declared, legacy, limits) if declared is not None else {}
    choice = body.get(choice_param)
    options: dict[str, Any] = {list_param: declared} if schemas else {}
    if choice is None:
        return options, None
    if choice == "required" and not legacy:
        if not schemas:
            raise _value_error(choice_param, "is \"required\" but 'tools' declares no function")
        schema, parts = _any_call(schemas, list_param)
        return options, StructuredOutput(schema=schema, param=list_param, any_function=True, parts=parts)
    if choice in ("none", "auto"):
        if schemas:
            options[choice_param] = choice
        return options, None
    if legacy:
        name = choice.get("name") if isinstance(choice, dict) else None
        shape = '"none", "auto" or {"name": ...}'
    else:
        function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        shape = '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
    if not isinstance(name, str):
        raise _value_error(choice_param, f"must be {shape}, got {_short(choice)}")
    if name not in schemas:
        raise _value_error(choice_param, f"names the function {_short(name)}, which '{list_param}' does not declare")
    part = SchemaPart((), _parameters_field(list_param, list(schemas).index(name), legacy))
    return options, StructuredOutput(schema=schemas[name], param=list_param, function=name, legacy=legacy,
                                     parts=(part,))


def _parameters_field(list_param: str, index: int, legacy: bool) -> str:
    """The request field of the ``index``-th function's parameters: ``tools[1].function.parameters``."""
    return f"{list_param}[{index}].parameters" if legacy else f"{list_param}[{index}].function.parameters"


def _any_call(schemas: dict[str, dict[str, Any]], list_param: str) -> tuple[dict[str, Any], tuple[SchemaPart, ...]]:
    """The schema of ``{"name": ..., "arguments": ...}`` calling one of the functions (name first), and
    where each function's parameters lie in it.

    Each function's parameters get a ``$id`` of their own (unless they have one) so that their local
    references (``"#/$defs/..."``, ``"#"``) resolve inside them, as they would alone, not from this
    schema's root.
    """
    calls = [{"type": "object",
              "properties": {"name": {"const": name},
                             "arguments": schema if "$id" in schema else {"$id": f"urn:llama-cache:function:{name}",
                                                                          **schema}},
              "required": ["name", "arguments"], "additionalProperties": False}
             for name, schema in schemas.items()]
    prefixes = [("properties", "arguments")] if len(calls) == 1 else \
        [("anyOf", str(index), "properties", "arguments") for index in range(len(calls))]
    parts = tuple(SchemaPart(prefix, _parameters_field(list_param, index, False))
                  for index, prefix in enumerate(prefixes))
    return (calls[0] if len(calls) == 1 else {"anyOf": calls}), parts


def _function_schemas(param: str, declared: object, legacy: bool,
                      limits: RequestLimits) -> dict[str, dict[str, Any]]:
    """Each declared function's name and the JSON schema of its arguments, in order, each schema checked
    against ``limits`` (:func:`.limits.check_schema`) before anything renders or compiles it.

    ``tools`` items are ``{"type": "function", "function": {...}}``; ``functions`` items are the
    function objects themselves: ``{"name", "description"?, "parameters"?, "strict"?}``.
    """
    shape = "a list of functions" if legacy else 'a list of {"type": "function", "function": {...}} objects'
    if not isinstance(declared, list):
        raise _type_error(param, shape, declared)
    schemas: dict[str, dict[str, Any]] = {}
    for index, item in enumerate(declared):
        where = f"{param}[{index}]"
        if legacy:
            function = item
        else:
            if not isinstance(item, dict) or item.get("type") != "function" or "function" not in item:
                raise _value_error(param, f"must be {shape}; item {index} is {_short(item)}")
            function = item["function"]
            where += ".function"
        if not isinstance(function, dict):
            raise _value_error(param, f"must be {shape}; {where} is {_short(function)}")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise _value_error(param, f"{where}.name must be 1 to 64 letters, digits, '_' or '-', got {_short(name)}")
        if name in schemas:
            raise _value_error(param, f"declares the function {_short(name)} twice")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise _value_error(param, f"{where}.description must be a string, got {_short(description)}")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _value_error(param, f"{where}.strict must be a boolean, got {_short(strict)}")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise _value_error(param, f"{where}.parameters must be a JSON schema object, got {_short(parameters)}")
        if parameters is not None:
            check_schema(parameters, f"{param}[{index}].parameters", limits)
        schemas[name] = parameters if parameters is not None else NO_PARAMETERS
    return schemas
