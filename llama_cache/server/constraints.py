"""Structured outputs: JSON schemas compiled with bounded cost and enforced per sequence, on llguidance.

llama-cpp-python turns a JSON schema into a GBNF grammar (``LlamaGrammar.from_json_schema``) that
llama.cpp's grammar sampler then runs; a schema as plain as ``{"type": "string", "maxLength": 100000}``
crashes the process there, and an enum of 50,000 values takes minutes. This module uses llguidance
instead, the engine llama.cpp, vLLM and SGLang use for structured outputs: a schema is compiled into a
lexer and an Earley parser whose sizes and per-token work are bounded (:class:`ConstraintLimits`), and
every limit reached is an error value, never a crash.

As in llama.cpp's own schema converter, an object schema that lists ``properties`` and does not say
``additionalProperties`` (nor ``patternProperties``) allows no others: JSON Schema would allow any, and
a small model given that freedom tends to invent property after property until ``max_tokens``. Whitespace
between JSON tokens is bounded to 20 characters per gap, for the same reason.

- :class:`ConstraintCompiler`: one per model (its vocabulary, read once). :meth:`~ConstraintCompiler.compile`
  turns a schema into a :class:`SequenceConstraint`, or refuses it with a :class:`ConstraintError`
  naming the problem, before the request is queued: the grammar is built and its first token mask
  computed then, so a schema too costly to start is refused, not discovered while generating; so is
  one with no finite instance (:mod:`.schema_ending`). A refusal names the subschema at fault by its
  JSON pointer, or the GBNF rule and line, and says why (:mod:`.schema_refusals`, :mod:`.grammar_refusals`).
- :class:`SequenceConstraint`: the state of one generated sequence. It consumes the tokens sampled
  since its previous call and masks the logits of every token the grammar does not allow (once the
  grammar is complete, only end-of-generation tokens remain). It owns nothing of the context that
  evaluates the sequence: llama-cpp-python's ``logits_processor`` hook calls it (``__call__``), and a
  batched decoder can call :meth:`~SequenceConstraint.advance` and :meth:`~SequenceConstraint.mask`
  per sequence itself.

Thread-safety: a compiler may be used by any number of threads at once (llguidance's tokenizer is
immutable, and building a grammar releases the GIL); a sequence constraint by one thread at a time.

llguidance (and the GBNF converter on it) is imported at a compiler's first compile, not with this
module: a server whose clients never ask for structured outputs does not hold it (about 5 MB).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llama_cpp
import numpy as np
import numpy.typing as npt

from llama_cache.server import schema_refusals
from llama_cache.server.refusals import ConstraintError, SchemaPart, clean, is_limit
from llama_cache.server.schema_ending import unending
from llama_cache.server.schema_nodes import Pointer, SchemaIndex, pointer_text

if TYPE_CHECKING:
    import llguidance

__all__ = ["JSON_WHITESPACE_PATTERN", "ConstraintCompiler", "ConstraintError", "ConstraintLimits", "SchemaPart",
           "SequenceConstraint"]

logger = logging.getLogger(__name__)

_NEG_INF = np.float32(-np.inf)
# Whitespace between JSON tokens, as llama.cpp's own converter bounds it: nothing, one space, or one or two
# line breaks and up to 20 spaces or tabs of indentation. Enough for pretty-printed JSON, not for a small
# model to spend its tokens on blank lines (unbounded whitespace would let it pad until max_tokens).
JSON_WHITESPACE_PATTERN = r"(?:\x20|(?:\x0D?\x0A){1,2}[\x20\x09]{0,20})?"
_JSON_OPTIONS: dict[str, Any] = {"whitespace_pattern": JSON_WHITESPACE_PATTERN}


@dataclass(frozen=True)
class ConstraintLimits:
    """Bounds on what one schema may cost: llguidance's ``LLParserLimits``, tighter than its defaults.

    By llguidance's own measured speeds, ``initial_lexer_fuel`` bounds building the lexer (about 50,000
    units per ms), ``step_lexer_fuel`` and ``step_max_items`` one token's mask (about 14,000 and 20,000
    units per ms: at most ~7 ms and ~2.5 ms here); ``max_items_in_row`` bounds one grammar rule's
    alternatives, ``max_grammar_size`` the grammar's symbols. A schema past any of these when it is
    compiled, or at its first token, is refused.

    ``max_lexer_states`` bounds the lexer's memory (it builds states lazily, 1-2 kB each): a string
    with a large ``maxLength`` adds states as it grows (measured: a ``maxLength: 100000`` string reaches
    100,000 states after about 19,000 characters, some 5,000 tokens, more than a 4096-token context
    holds). A sequence that reaches it stops there (see :class:`SequenceConstraint`).
    """

    max_grammar_size: int = 200_000
    max_items_in_row: int = 2_000
    initial_lexer_fuel: int = 1_000_000
    step_lexer_fuel: int = 100_000
    step_max_items: int = 50_000
    max_lexer_states: int = 100_000

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 1 << 63:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    def parser_limits(self) -> llguidance.LLParserLimits:
        """These bounds as llguidance's ``LLParserLimits`` (error messages without the grammar's text)."""
        import llguidance

        return llguidance.LLParserLimits(
            max_items_in_row=self.max_items_in_row,
            initial_lexer_fuel=self.initial_lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel,
            step_max_items=self.step_max_items,
            max_lexer_states=self.max_lexer_states,
            max_grammar_size=self.max_grammar_size,
            verbose_errors=False,
        )


class ConstraintCompiler:
    """Compiles JSON schemas into :class:`SequenceConstraint` for one model's vocabulary.

    Args:
        vocab: the model's ``llama_vocab`` pointer (``llama_cpp.llama_model_get_vocab``); the model
            must outlive the compiler.
        n_vocab: the size of the model's logits rows (tokens past the vocabulary are never allowed).
        limits: the bounds every schema must fit.

    Building one is cheap; its first compile reads every token's text from llama.cpp into llguidance's
    tokenizer (0.3-1.3 s and about 20 MB for a 49,152-token vocabulary, changing the process's warning
    filters meanwhile), so a server whose clients never ask for structured outputs never pays for it.
    Build one per model and share it. Using it is thread-safe (the first compile's reading happens
    once, other threads waiting for it).
    """

    def __init__(self, vocab: llama_cpp.llama_vocab_p, n_vocab: int, limits: ConstraintLimits | None = None) -> None:
        if n_vocab <= 0:
            raise ValueError(f"n_vocab must be positive, got {n_vocab}")
        self.limits = limits or ConstraintLimits()
        self.n_vocab = n_vocab
        n_tokens = llama_cpp.llama_vocab_n_tokens(vocab)
        self.end_tokens = tuple(t for t in range(n_tokens) if llama_cpp.llama_vocab_is_eog(vocab, t))
        if not self.end_tokens or max(self.end_tokens) >= n_vocab:
            raise ValueError("the vocabulary has no end-of-generation token inside the logits rows")
        if importlib.util.find_spec("llguidance") is None:  # (imported at the first compile)
            raise ImportError("structured outputs need llguidance, which is not installed")
        self._vocab = vocab
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._reading = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer for the vocabulary (immutable), read at the first use (the slow part;
        see the class)."""
        tokenizer = self._tokenizer
        if tokenizer is not None:
            return tokenizer
        with self._reading:
            if self._tokenizer is None:
                import llguidance.llamacpp

                with warnings.catch_warnings():
                    # llguidance 1.9.1 reads token attributes with a call llama-cpp-python 0.3.36 deprecates
                    # (once per token); the replacement returns the same values.
                    warnings.filterwarnings("ignore", "llama_token_get_attr is deprecated", DeprecationWarning)
                    self._tokenizer = llguidance.llamacpp.lltokenizer_from_vocab(
                        self._vocab, eos_token=list(self.end_tokens))
            return self._tokenizer

    @classmethod
    def for_llama(cls, llama: llama_cpp.Llama, limits: ConstraintLimits | None = None) -> ConstraintCompiler:
        """A compiler for ``llama``'s model (the context itself is not kept)."""
        vocab = llama_cpp.llama_model_get_vocab(llama.model)
        return cls(vocab, llama.n_vocab(), limits)

    def compile(self, schema: Mapping[str, Any] | bool, parts: Sequence[SchemaPart] = ()) -> SequenceConstraint:
        """A fresh constraint making one sequence's generated text a JSON value following ``schema``.

        The grammar is built and checked against the limits, the schema checked to have a finite
        instance (one that refers to itself with no way to end has none), and the first token mask
        computed (the first step's cost is then known, and paid here rather than by the first sampled
        token). Runs in the calling thread, mostly without the GIL; bounded by :attr:`limits` and, for
        the checks and a refusal's message, linear in the schema's size.

        Args:
            schema: a JSON schema (an object, or ``true``/``false``).
            parts: subschemas that came from fields of their own (see :class:`SchemaPart`).

        Raises:
            ConstraintError: the schema is invalid, unsupported, has no finite instance, or is past a
                limit; the message names the subschema at fault (its JSON pointer) and why.
        """
        if schema is True:
            schema = {}
        elif schema is False:
            raise ConstraintError("the schema is false: no value follows it")
        elif not isinstance(schema, Mapping):
            raise ConstraintError(f"the schema must be an object or a boolean, not {_json_kind(schema)}")
        import llguidance

        try:
            text = json.dumps(_closed_objects(schema), allow_nan=False)
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, overrides=_JSON_OPTIONS)
        except RecursionError:
            raise ConstraintError("the schema nests too deeply to be read") from None
        except (TypeError, ValueError) as error:
            raise ConstraintError(_unreadable(error)) from None
        matcher = self._matcher(grammar)
        index = SchemaIndex.of(schema)
        if not matcher.is_error():
            endless = _located(schema, parts, index, unending)
            if endless is not None:
                raise endless
            constraint = self._constraint(matcher)
            if constraint.prepare():
                return constraint
        raw = matcher.get_error()
        if is_limit(raw):
            raise ConstraintError(f"the schema is too complex to enforce: {clean(raw)}", "schema_too_complex",
                                  field=next((part.field for part in parts if not part.pointer), None))
        refusal = _located(schema, parts, index, lambda where: schema_refusals.describe(where, raw))
        raise refusal or ConstraintError(f"the schema cannot be enforced: {clean(raw)}")

    def compile_gbnf(self, gbnf: str) -> SequenceConstraint:
        """A fresh constraint making one sequence's generated text follow a GBNF grammar (llama.cpp's format,
        whose rule ``root`` is the start), as llama-cpp-python's ``grammar`` field takes it.

        The grammar is converted to llguidance's Lark format (:class:`.GbnfGrammar`), checked to match
        some finite text, then compiled as :meth:`compile` does. The conversion's cost grows with the
        text's length and the square of its rules (400 rules take 0.6 s): the caller bounds both
        (:attr:`.RequestLimits.max_grammar_bytes`, ``max_grammar_rules``).

        Raises:
            ConstraintError: the grammar is invalid, unsupported, matches no finite text, or is past a
                limit; the message names the rule and line at fault and why.
        """
        import llguidance

        from llama_cache.server.grammar_refusals import GbnfGrammar

        grammar = GbnfGrammar.convert(gbnf)
        matcher = self._matcher(llguidance.LLMatcher.grammar_from_lark(grammar.lark))
        if not matcher.is_error():
            reason = grammar.unending()
            if reason is not None:
                raise ConstraintError(reason)
            constraint = self._constraint(matcher)
            if constraint.prepare():
                return constraint
        raw = matcher.get_error()
        if is_limit(raw):
            raise ConstraintError(f"the grammar is too complex to enforce: {clean(raw)}", "schema_too_complex")
        raise ConstraintError(grammar.describe(raw))

    def _matcher(self, grammar: str) -> llguidance.LLMatcher:
        import llguidance

        return llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits.parser_limits())

    def _constraint(self, matcher: llguidance.LLMatcher) -> SequenceConstraint:
        return SequenceConstraint(matcher, self.tokenizer.vocab_size, self.n_vocab, self.end_tokens)


Located = tuple[Pointer | None, str]


def _located(schema: Mapping[str, Any], parts: Sequence[SchemaPart], index: SchemaIndex,
             locate: Callable[[SchemaIndex], Located | None]) -> ConstraintError | None:
    """The refusal ``locate`` finds in ``schema`` (``index``), told relative to the part it lies in (``locate``
    runs again on that part alone, for a reason whose pointers are the part's own); None if it finds none."""
    found = locate(index)
    if found is None:
        return None
    pointer, reason = found
    part = max((part for part in parts if pointer is not None and pointer[: len(part.pointer)] == part.pointer),
               key=lambda part: len(part.pointer), default=None)
    if part is not None and pointer is not None:
        pointer = pointer[len(part.pointer):]
        if part.pointer:
            inner = _at(schema, part.pointer)
            retold = locate(SchemaIndex.of(inner)) if isinstance(inner, dict) else None
            if retold is not None and retold[0] is not None:
                pointer, reason = retold
    subject = "the schema" if pointer is None else f"the schema at '{pointer_text(pointer)}'"
    return ConstraintError(f"{subject} {reason}", field=part.field if part is not None else None)


def _at(schema: Any, pointer: Pointer) -> Any:
    for token in pointer:
        if isinstance(schema, dict):
            schema = schema.get(token)
        elif isinstance(schema, list) and token.isdigit() and int(token) < len(schema):
            schema = schema[int(token)]
        else:
            return None
    return schema


def _json_kind(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    return "a number" if isinstance(value, (int, float)) else f"a {type(value).__name__}"


def _unreadable(error: TypeError | ValueError) -> str:
    """Why the schema could not be read as JSON (json.dumps, or llguidance's reader)."""
    text = str(error)
    if "recursion limit exceeded" in text:
        return "the schema nests too deeply to be read (llguidance reads at most 128 levels of objects and arrays)"
    if "Out of range float values" in text:
        return "the schema holds a number that is not finite (NaN or infinity), which JSON cannot carry"
    if found := re.search(r"Object of type (\w+) is not JSON serializable", text):
        return f"the schema holds a value that is not JSON (a {found.group(1)})"
    return f"the schema could not be read: {clean(text)}"


# Keywords whose values are data, not schemas: left as they are.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Keywords whose values map names to schemas.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _closed_objects(schema: Any) -> Any:
    """A copy of ``schema`` where objects with ``properties`` and no word on others allow none (see above)."""
    if isinstance(schema, list):
        return [_closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _DATA_KEYWORDS:
            closed[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            closed[key] = {name: _closed_objects(item) for name, item in value.items()}
        else:
            closed[key] = _closed_objects(value)
    if (isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema
            and "patternProperties" not in schema):
        closed["additionalProperties"] = False
    return closed


class SequenceConstraint:
    """One sequence's grammar state: which tokens may come next, given those sampled so far.

    Made by :meth:`ConstraintCompiler.compile`. Use it for one generation: as llama-cpp-python's
    ``logits_processor`` (``__call__``), or through :meth:`advance` and :meth:`mask`.

    A grammar that fails while generating (a limit reached on a later token, such as the lexer's
    states; a token it cannot take) does not raise: the failure is logged, :attr:`error` says what it
    was, and from then on only the end-of-generation tokens are allowed, so the generation ends at the
    next token, its text cut short.

    Cost per token: consuming the sampled token and llguidance's mask computation (bounded by the step
    limits) plus O(n_vocab) numpy work to apply the mask; 250-350 us of CPU in all with a 49,152-token
    vocabulary (``benchmarks/constraints.py``). Not thread-safe: one thread at a time.
    """

    def __init__(self, matcher: llguidance.LLMatcher, tokenizer_vocab: int, n_vocab: int,
                 end_tokens: Sequence[int]) -> None:
        self._matcher = matcher
        self._n_vocab = n_vocab
        self._n_masked = min(tokenizer_vocab, n_vocab)  # tokens the mask speaks for; the rest are refused
        self._bits = np.zeros((tokenizer_vocab + 31) // 32, dtype=np.int32)
        self._end_tokens = np.asarray(end_tokens, dtype=np.intp)
        self._blocked = np.empty(self._n_masked, dtype=np.bool_)
        self._mask_ready = False
        self._seen: int | None = None
        self.error: str | None = None
        """Why the grammar stopped constraining mid-generation (see above), or None."""

    @property
    def complete(self) -> bool:
        """True once the grammar accepts no more tokens (only an end-of-generation token is allowed)."""
        return self._matcher.is_stopped()

    def prepare(self) -> bool:
        """Compute the next token's mask now, if not done yet (the first one is, at compile time).

        Returns:
            False if the grammar is in an error state (the matcher's error says why).
        """
        if self._mask_ready:
            return True
        matcher = self._matcher
        if not matcher.is_error():
            matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._mask_ready = not matcher.is_error()
        return self._mask_ready

    def advance(self, tokens: Sequence[int]) -> None:
        """Feed the tokens sampled since the last call, in order. A refused token ends the sequence (:attr:`error`)."""
        if self.error is not None or not tokens:
            return
        self._mask_ready = False
        if not self._matcher.consume_tokens([int(t) for t in tokens]):
            self._fail(self._matcher.get_error() or "a sampled token does not follow the grammar")

    def mask(self, scores: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """Set the logits of every token not allowed next to -inf, in place; allowed ones keep their values.

        Args:
            scores: one logits row of the model's ``n_vocab`` (a strided view is fine).

        Returns:
            ``scores``.
        """
        if self.error is None and not self.prepare():
            self._fail(self._matcher.get_error())
        if self.error is not None:
            kept = scores[self._end_tokens].copy()
            scores[:] = _NEG_INF
            scores[self._end_tokens] = np.where(np.isfinite(kept), kept, np.float32(0.0))
        else:
            allowed = np.unpackbits(self._bits.view(np.uint8), count=self._n_masked, bitorder="little")
            np.equal(allowed, 0, out=self._blocked)
            np.copyto(scores[: self._n_masked], _NEG_INF, where=self._blocked)
            if self._n_vocab > self._n_masked:
                scores[self._n_masked :] = _NEG_INF
        return scores

    def __call__(self, input_ids: npt.NDArray[np.intc], scores: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """llama-cpp-python's ``logits_processor``: ``input_ids`` are all the tokens so far, ``scores`` the next row.

        The first call takes every token as the prompt; each later one feeds the tokens added since.
        """
        n = len(input_ids)
        if self._seen is None:
            self._seen = n
        elif n < self._seen:
            self._fail(f"the sequence went back from {self._seen} to {n} tokens")
        elif n > self._seen:
            self.advance(input_ids[self._seen : n].tolist())
            self._seen = n
        return self.mask(scores)

    def _fail(self, message: str) -> None:
        if self.error is None:
            self.error = message
            logger.warning("structured output stopped: %s; ending the generation", message)
