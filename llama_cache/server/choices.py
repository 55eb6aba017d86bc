"""A request's choices, generated one after another on the engine from one evaluation of the prompt.

:class:`ChoiceRun` drives ``create_completion`` / ``create_chat_completion`` once per choice (``n``) on
the request's :class:`~llama_cache.engine.completions.Completions`. The first choice evaluates the
prompt (or reuses it from another sequence or the cache); each later one starts from the first one's
cells (``llama_memory_seq_cp``: the prompt is shared, only its last token is evaluated again, for its
row). Each choice samples with its own :class:`~.sequences.SequenceSampling` (seed ``seed + i``, its
constraint, its log probabilities).

What OpenAI's API adds to llama-cpp-python's answers is added here, on both endpoints, whole and
streamed:

- ``usage.prompt_tokens_details.cached_tokens``: the prompt tokens not evaluated for this request
  (restored from a cache tier, already live in the context, or lent by another context); the prompt
  counts once however many choices there are;
- ``stream_options.include_usage``: a last chunk with ``"choices": []`` and the usage;
- ``logprobs``: OpenAI's chat shape (``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``)
  or the legacy completions shape (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``). A
  token is listed once the text it starts has been returned: the tokens of a stop sequence cut from the
  text, and the end-of-generation token, are not;
- ``system_fingerprint`` on every response and chunk; ``"content": ""`` in a chat stream's first delta;
- ``echo`` (text completions): each choice's text starts with the prompt's, whole and streamed (its
  first chunk carries it).

A stream yields :data:`ANSWERED` right after its last chunk for the client: what runs after it (the
prompt cache's save) is bookkeeping (see :func:`.jobs.run_job`).

Thread-safety: a run is driven by the worker thread of its request only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from llama_cache.engine.sequences import SequenceSampling, TokenLogprob

__all__ = ["ANSWERED", "ChoiceRun", "Usage"]

ANSWERED = object()
"""Yielded by :meth:`ChoiceRun.stream` after the client's last chunk."""

Start = Callable[[Any, SequenceSampling], Any]
"""Starts one choice on a context: ``(llama, sampling) -> completion or chunk iterator``."""


@dataclass
class Usage:
    """Token counts of one request: its prompt once, its choices' completions together."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prompt_known: bool = False

    def body(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass
class ChoiceRun:
    """The choices of one request on one context.

    Args:
        llama: the request's :class:`~llama_cache.engine.completions.Completions`.
        samplings: one per choice, in order.
        start: starts a choice (see :data:`Start`).
        chat: chat completions (else text completions): which ``logprobs`` shape to give.
        fingerprint: the ``system_fingerprint``.
        cancelled: asked before each choice: a cancelled request starts no more.
        shape: turns a choice's completion into the answer's shape (structured outputs); None: as is.
        shape_chunks: the same for a choice's chunk stream.
        saved_before_last_chunk: a stream's last chunk waits until the completion's state is saved
            into the prompt cache (llama-cpp-python saves it after the chunk): with a write-through
            cache, the state is then in the shared tier before the client can send its next turn.
        echo: the prompt's text, which starts every choice's text (text completions' ``echo``); None:
            no echo.
    """

    llama: Any
    samplings: list[SequenceSampling]
    start: Start
    chat: bool
    fingerprint: str
    cancelled: Callable[[], bool] = lambda: False
    shape: Callable[[dict[str, Any], SequenceSampling], dict[str, Any]] | None = None
    shape_chunks: Callable[[Iterator[dict[str, Any]], SequenceSampling], Iterator[dict[str, Any]]] | None = None
    saved_before_last_chunk: bool = False
    echo: str | None = None
    usage: Usage = field(default_factory=Usage)

    # -- whole answers ---------------------------------------------------------------------------

    def complete(self) -> dict[str, Any]:
        """All the choices as one response."""
        first: dict[str, Any] | None = None
        choices = []
        for index, sampling in enumerate(self.samplings):
            if index and self.cancelled():
                break
            raw = self._run(index, sampling)
            result = self.shape(raw, sampling) if self.shape is not None else raw
            first = first or result
            choice = dict(result["choices"][0])
            choice["index"] = index
            if self.echo is not None:
                choice["text"] = self.echo + (choice.get("text") or "")
            if sampling.logprobs is not None:
                generated = raw["choices"][0]
                text = (generated.get("message") or {}).get("content") if self.chat else generated.get("text")
                tokens = sampling.logprobs.tokens
                upto, _ = self._starting_within(tokens, len((text or "").encode("utf-8")))
                choice["logprobs"] = self._logprobs(tokens[:upto])
            choices.append(choice)
            self._count(sampling)
        assert first is not None
        answer = {key: value for key, value in first.items() if key not in ("choices", "usage")}
        return {**answer, "system_fingerprint": self.fingerprint, "choices": choices, "usage": self.usage.body()}

    # -- streams ---------------------------------------------------------------------------------

    def stream(self, include_usage: bool) -> Iterator[Any]:
        """All the choices' chunks, choice after choice, each with its ``index``; then :data:`ANSWERED`."""
        last: dict[str, Any] | None = None
        ending: dict[str, Any] | None = None  # the client's last chunk
        count = len(self.samplings)
        for index, sampling in enumerate(self.samplings):
            if index and self.cancelled():
                break
            generated = _TextCounter(self._run(index, sampling), self.chat)
            chunks = self.shape_chunks(generated, sampling) if self.shape_chunks is not None else generated
            # Tokens whose log probabilities were sent, and their text's bytes and characters.
            listed = listed_bytes = listed_chars = 0
            finished = False
            echo = self.echo
            for chunk in chunks:
                if finished:
                    continue  # run the generator to its end: it saves the prompt's state there
                choice = dict(chunk["choices"][0])
                choice["index"] = index
                delta = choice.get("delta")
                if self.chat and isinstance(delta, dict) and "role" in delta and "content" not in delta:
                    choice["delta"] = {**delta, "content": ""}
                if sampling.logprobs is not None:
                    tokens = sampling.logprobs.tokens
                    upto, listed_bytes = self._starting_within(tokens, generated.sent, listed, listed_bytes)
                    choice["logprobs"] = self._logprobs(tokens[listed:upto], listed_chars) if upto > listed else None
                    listed_chars += sum(_characters(self._piece(t.token)) for t in tokens[listed:upto])
                    listed = upto
                if echo is not None:  # the choice's first chunk starts with the prompt
                    choice["text"] = echo + (choice.get("text") or "")
                    echo = None
                last = {**chunk, "system_fingerprint": self.fingerprint, "choices": [choice]}
                if choice.get("finish_reason") is not None:
                    finished = True
                    self._count(sampling)
                    if index == count - 1 or self.cancelled():
                        ending = last
                        if not self.saved_before_last_chunk:
                            yield from self._ending(ending, include_usage)
                        continue
                yield last
            if ending is not None:
                if self.saved_before_last_chunk:  # the generator has saved the state by now
                    yield from self._ending(ending, include_usage)
                return

    def _ending(self, last: dict[str, Any], include_usage: bool) -> Iterator[Any]:
        yield last
        if include_usage:
            yield {**{k: v for k, v in last.items() if k != "choices"}, "choices": [], "usage": self.usage.body()}
        yield ANSWERED

    # -- one choice ------------------------------------------------------------------------------

    def _run(self, index: int, sampling: SequenceSampling) -> Any:
        llama = self.llama

        def took(token: int) -> None:
            if not self.usage.prompt_known:  # the prompt is evaluated (or restored) once a token is out
                self.usage.prompt_known = True
                self.usage.prompt_tokens = llama.last_prompt_length
                self.usage.cached_tokens = max(llama.last_prompt_length - llama.last_prompt_tokens_evaluated, 0)
            sampling.took(token)

        llama.token_watcher = took
        return self.start(llama, sampling)

    def _count(self, sampling: SequenceSampling) -> None:
        sampled = sampling.sampled
        ends = bool(sampled) and self._is_end(sampled[-1])
        self.usage.completion_tokens += len(sampled) - (1 if ends else 0)

    def _is_end(self, token: int) -> bool:
        return bool(self.llama.is_end(token))

    # -- log probabilities -----------------------------------------------------------------------

    def _piece(self, token: int) -> bytes:
        return b"" if self._is_end(token) else self.llama.detokenizer.piece(token)

    def _starting_within(self, tokens: list[TokenLogprob], sent: int, upto: int = 0, start: int = 0
                         ) -> tuple[int, int]:
        """How many leading tokens start inside the first ``sent`` bytes of the generated text, and their bytes.

        Goes on from ``upto`` tokens of ``start`` bytes known to do so: a stream pays O(1) per token.
        """
        while upto < len(tokens) and start < sent and not self._is_end(tokens[upto].token):
            start += len(self._piece(tokens[upto].token))
            upto += 1
        return upto, start

    def _logprobs(self, tokens: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
        """``tokens``' log probabilities in the endpoint's shape; the first starts at character ``offset``."""
        if self.chat:
            return {"content": [self._chat_entry(t) for t in tokens], "refusal": None}
        pieces = [self._piece(t.token) for t in tokens]
        offsets = []
        for piece in pieces:
            offsets.append(offset)
            offset += _characters(piece)
        return {
            "tokens": [_text(p) for p in pieces],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [self._legacy_top(t) for t in tokens],
            "text_offset": offsets,
        }

    def _chat_entry(self, token: TokenLogprob) -> dict[str, Any]:
        piece = self._piece(token.token)
        return {"token": _text(piece), "logprob": token.logprob, "bytes": list(piece),
                "top_logprobs": [{"token": _text(self._piece(t)), "logprob": value, "bytes": list(self._piece(t))}
                                 for t, value in token.top]}

    def _legacy_top(self, token: TokenLogprob) -> dict[str, float]:
        # The legacy shape always holds the sampled token too (so up to logprobs + 1 entries).
        entries = {_text(self._piece(t)): value for t, value in token.top}
        entries.setdefault(_text(self._piece(token.token)), token.logprob)
        return entries


def _characters(piece: bytes) -> int:
    """Characters a token's bytes add to a UTF-8 text (its bytes that start one)."""
    return sum(1 for byte in piece if byte & 0xC0 != 0x80)


def _text(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


class _TextCounter:
    """Passes llama-cpp-python's chunks on, counting the bytes of generated text they carried (``sent``)."""

    def __init__(self, chunks: Iterator[dict[str, Any]], chat: bool) -> None:
        self._chunks = chunks
        self._chat = chat
        self.sent = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for chunk in self._chunks:
            choice = chunk["choices"][0]
            text = (choice.get("delta") or {}).get("content") if self._chat else choice.get("text")
            self.sent += len((text or "").encode("utf-8"))
            yield chunk
