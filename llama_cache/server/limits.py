"""What one request may cost, checked before any work on it begins.

Every bound here is enforced on the decoded body, before a template is rendered, a prompt tokenized, a
schema compiled or a context touched, so that the work a request can cause is bounded by a documented
limit and a request past one gets a 400 naming it (code ``limit_exceeded``):

- the body as JSON: every string valid Unicode (no lone surrogate), integers of at most 64 bits;
- a chat request: at most :attr:`RequestLimits.max_messages` messages, at most
  :attr:`RequestLimits.max_tools` tools, and text that could still fit the context (see
  :attr:`RequestLimits.max_prompt_bytes`);
- a JSON schema (a tool's parameters, a response format): at most :attr:`RequestLimits.max_schema_bytes`
  bytes as JSON, :attr:`RequestLimits.max_schema_depth` levels, :attr:`RequestLimits.max_enum_values`
  values in its ``enum``/``const`` lists together, and repetition bounds (``minLength``, ``maxLength``,
  ``minItems``, ``maxItems``, ``minProperties``, ``maxProperties``, ``{n,m}`` in a ``pattern``) of at
  most :attr:`RequestLimits.max_repetition`.

Token ids and ``logit_bias`` keys are checked against the vocabulary by :mod:`.protocol`. The cost of
each check is linear in the body's size, which the server bounds first (``max_body_bytes``).
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from typing import Any

import llama_cpp

from llama_cache.detokenizer import Detokenizer
from llama_cache.server.errors import ApiError

__all__ = ["PromptTextBound", "RequestLimits", "check_json_values", "check_schema", "limit_error"]

_INT64_LOW, _UINT64_HIGH = -(1 << 63), 1 << 64
_REPETITION_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
                        "minContains", "maxContains")
# {n}, {n,}, {n,m} in a regular expression (an escaped brace is not a quantifier).
# Keywords whose values are data, not schemas; keywords mapping names to schemas (one level, not two).
_LITERALS = frozenset({"enum", "const", "default", "examples"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_SUSPICIOUS = re.compile(rb"\\u[dD][89a-fA-F]|\d{19}")
_QUANTIFIER = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


@dataclass(frozen=True)
class RequestLimits:
    """The bounds on one request, besides the body size (``ServerConfig.max_body_bytes``).

    Attributes:
        max_messages: messages in one chat request.
        max_choices: choices one request may ask for (``n``); they share one evaluation of the prompt,
            then generate one after another on the request's context.
        max_tools: tools (or legacy functions) in one chat request.
        max_prompt_bytes: bytes of text (message contents, a completion prompt) that one request may
            bring; a longer text is refused as ``context_length_exceeded`` without being tokenized. Set
            by the engine to its :attr:`PromptTextBound.max_bytes`.
        max_schema_bytes: a JSON schema's size, as compact JSON.
        max_schema_depth: a JSON schema's nesting levels, counted in subschemas (an object's property
            is one level below the object).
        max_enum_values: values of every ``enum`` and ``const`` of one schema together.
        max_grammar_bytes, max_grammar_rules: a GBNF ``grammar``'s size in UTF-8 bytes and its rules
            (``::=``): converting it costs time in the square of its rules.
        max_repetition: the largest repetition bound of a schema (``maxLength``, ``minItems``, ...,
            ``{n,m}`` in a ``pattern``). The structured-output engine compiles bounds up to this in
            about a millisecond (its own fuel limits bound the rest); a larger one is refused unread.
    """

    max_messages: int = 1024
    max_choices: int = 8
    max_tools: int = 128
    max_prompt_bytes: int = 1 << 20
    max_schema_bytes: int = 64 << 10
    max_schema_depth: int = 32
    max_enum_values: int = 4096
    max_repetition: int = 100_000
    max_grammar_bytes: int = 8 << 10
    max_grammar_rules: int = 128

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class PromptTextBound:
    """Whether a text could tokenize to fewer than ``n_ctx`` tokens, decided in O(its length) before tokenizing.

    llama.cpp's tokenizer costs more than linear time: with special tokens parsed, each one found in the
    text copies the rest of it (8,000 ``<|im_end|>`` in 88 KB took 1.9 s here, 4x as long for twice as
    many), and a 512 KB text takes about 0.9 s. A text can fit only when it is at most ``n_ctx`` times
    the longest token's text (every token stands for at most that many bytes) and, with special tokens
    parsed, holds fewer than ``n_ctx`` of them (each is one token), so checking both first bounds what
    tokenizing an accepted text costs by the context's size.

    Attributes:
        n_ctx: the context size in tokens.
        max_bytes: ``n_ctx`` times the longest token's text in bytes.
        special: matches the text of every special (control or user-defined) token; None if none.
    """

    n_ctx: int
    max_bytes: int
    special: re.Pattern[bytes] | None

    @classmethod
    def for_model(cls, llama: llama_cpp.Llama, n_ctx: int) -> PromptTextBound:
        """The bound for ``llama``'s vocabulary (see :meth:`for_vocabulary`)."""
        vocab = llama_cpp.llama_model_get_vocab(llama.model)
        return cls.for_vocabulary(vocab, Detokenizer.for_llama(llama), int(llama.n_vocab()), n_ctx)

    @classmethod
    def for_vocabulary(cls, vocab: llama_cpp.llama_vocab_p, pieces: Detokenizer, n_vocab: int,
                       n_ctx: int) -> PromptTextBound:
        """The bound for a vocabulary (its every piece whole, from ``pieces``): O(vocabulary), about
        0.25 s for 50,000 tokens; once per model."""
        longest = 1
        specials: list[bytes] = []
        special_kinds = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
        for token in range(n_vocab):
            piece = pieces.piece(token, special=True)
            longest = max(longest, len(piece))
            if piece and llama_cpp.llama_vocab_get_attr(vocab, token) & special_kinds:
                specials.append(piece)
        pattern = b"|".join(re.escape(text) for text in sorted(set(specials), key=len, reverse=True))
        return cls(n_ctx=n_ctx, max_bytes=n_ctx * longest, special=re.compile(pattern) if pattern else None)

    def overflow(self, text: bytes, special: bool) -> str | None:
        """None if ``text`` may fit the context; else how big it is, for an error message."""
        if len(text) > self.max_bytes:
            return f"{len(text)} bytes of text"
        if special and self.special is not None:
            found = sum(1 for _ in itertools.islice(self.special.finditer(text), self.n_ctx))
            if found >= self.n_ctx:
                return f"at least {found} special tokens"
        return None


def limit_error(param: str, message: str) -> ApiError:
    """A 400 for a request past one of this server's limits (code ``limit_exceeded``)."""
    return ApiError(400, f"'{param}' {message}", param=param, code="limit_exceeded")


def check_json_values(raw: bytes, body: Any) -> None:
    """Check every string and integer of a decoded JSON body (``raw``, decoded into ``body``).

    Only a body whose text could hold a bad value is walked: one with a ``\\uD800``-``\\uDFFF`` escape
    or bytes that are not UTF-8 (a lone surrogate), or a run of 19 digits (an integer of more than 64
    bits); others cost one scan of ``raw``. A walk is O(size of the body) and iterative.

    Raises:
        ApiError: 400 ``invalid_value`` naming the field, for a string holding a lone surrogate
            (``"\\ud800"`` has no UTF-8 form) or an integer outside 64 bits.
    """
    if _SUSPICIOUS.search(raw) is None and _is_utf8_bytes(raw):
        return
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _is_utf8(value):
                raise ApiError(400, f"'{path or 'body'}' holds a lone surrogate: not valid Unicode",
                               param=path or None, code="invalid_value")
        elif isinstance(value, int) and not isinstance(value, bool):
            if not _INT64_LOW <= value < _UINT64_HIGH:
                raise ApiError(400, f"'{path or 'body'}' is an integer wider than 64 bits",
                               param=path or None, code="invalid_value")
        elif isinstance(value, dict):
            for key, item in value.items():
                if not _is_utf8(key):
                    raise ApiError(400, f"a key of '{path or 'body'}' holds a lone surrogate: not valid Unicode",
                                   param=path or None, code="invalid_value")
                stack.append((item, f"{path}.{key}" if path else key))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{index}]") for index, item in enumerate(value))


def _is_utf8_bytes(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_schema(schema: Any, param: str, limits: RequestLimits) -> None:
    """Check a JSON schema against ``limits`` before anything compiles it.

    O(size of the schema).

    Raises:
        ApiError: 400 ``invalid_type`` when it is not an object (or a boolean schema);
            ``limit_exceeded`` naming the bound it passes.
    """
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ApiError(400, f"'{param}' must be a JSON schema (an object), got {type(schema).__name__}",
                       param=param, code="invalid_type")
    size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))
    if size > limits.max_schema_bytes:
        raise limit_error(param, f"is a schema of {size} bytes; this server accepts at most "
                          f"{limits.max_schema_bytes}")
    enum_values = 0
    stack: list[tuple[Any, int]] = [(schema, 0)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, dict):
            continue
        if depth > limits.max_schema_depth:
            raise limit_error(param, f"nests more than {limits.max_schema_depth} levels deep")
        for keyword, value in node.items():
            if keyword == "enum" and isinstance(value, list):
                enum_values += len(value)
            elif keyword == "const":
                enum_values += 1
            elif keyword in _REPETITION_KEYWORDS:
                _check_repetition(param, keyword, value, limits)
            elif keyword == "pattern" and isinstance(value, str):
                for low, high in _QUANTIFIER.findall(value):
                    for bound in (low, high):
                        # Digits counted before int(): Python refuses to convert more than 4,300.
                        if bound and (len(bound.lstrip("0")) > 18 or int(bound) > limits.max_repetition):
                            raise limit_error(param, f"has a pattern repeating {bound} times; this server "
                                              f"accepts repetition bounds of at most {limits.max_repetition}")
            if enum_values > limits.max_enum_values:
                raise limit_error(param, f"has more than {limits.max_enum_values} enum and const values")
            if keyword in _LITERALS:
                continue
            if keyword in _SCHEMA_MAPS and isinstance(value, dict):
                stack.extend((child, depth + 1) for child in value.values())
            elif isinstance(value, list):
                stack.extend((child, depth + 1) for child in value)
            elif isinstance(value, dict):
                stack.append((value, depth + 1))


def _check_repetition(param: str, keyword: str, value: Any, limits: RequestLimits) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"'{param}' has a {keyword} that is not a number", param=param, code="invalid_value")
    if value > limits.max_repetition:
        raise limit_error(param, f"has {keyword} {value}; this server accepts repetition bounds of at most "
                          f"{limits.max_repetition}")
