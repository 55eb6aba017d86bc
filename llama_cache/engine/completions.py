"""llama-cpp-python's completion API for one request, served by the engine's shared context.

:class:`Completions` is what llama-cpp-python's chat handlers call (``tokenize``, ``create_completion``)
and offers ``create_chat_completion`` on top of them, so a chat request renders its prompt exactly as
``llama_cpp.Llama`` would and answers in the same shapes, whole or streamed. Each completion is one
sequence's :class:`~.scheduler.Generation`: its tokens are sampled on the scheduler's thread, its text
is cut at stop sequences there (:class:`~.text.StopText`), and the caller's thread reads the text as
it comes.

Hooks a server sets (all optional): ``cancelled`` (asked every step), ``stop_check`` (llama-cpp-python's
stopping-criterion shape, called after each sampled token), ``token_watcher`` (told each sampled token,
on the scheduler's thread, end-of-generation tokens included), ``prompt_substitute`` (replaces a
completion's prompt tokens), ``after_generation`` (given the finished state before the stream's last
chunk, e.g. to store it in the cache tiers).

Thread-safety: one request's object, used by one thread at a time (besides the hooks' calls from the
scheduler's thread).
"""

from __future__ import annotations

import logging
import queue
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from llama_cache.engine.scheduler import Generation
from llama_cache.engine.sampling import Sampler, SamplerSettings
from llama_cache.engine.text import StopText
from llama_cache.state.llama_state import LlamaState
from llama_cache.tokens import as_token_array, check_vocabulary

__all__ = ["Completions"]

logger = logging.getLogger(__name__)

_END = object()

CHAT_DEFAULTS: dict[str, Any] = {
    "temperature": 0.2, "top_p": 0.95, "top_k": 40, "min_p": 0.05, "typical_p": 1.0, "stream": False, "stop": [],
    "seed": None, "max_tokens": None, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repeat_penalty": 1.0,
    "tfs_z": 1.0, "mirostat_mode": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1,
}
"""``llama_cpp.Llama.create_chat_completion``'s defaults, which it passes to the chat handler."""


class Completions:
    """One request's view of an :class:`~.engine.Engine` (see the module's docstring).

    Args:
        engine: the engine.
        fingerprint: the request's cache namespace's fingerprint.
        cancelled, stop_check, token_watcher, prompt_substitute, after_generation: the hooks.
        tokenize: tokenizes instead of the model (a server's memo of tokenizations), same signature.
        penalty_last_n: the sampled tokens the repetition penalties look back on.
    """

    verbose = False  # chat handlers read it

    def __init__(self, engine: Any, fingerprint: str, *, cancelled: Callable[[], bool] | None = None,
                 stop_check: Callable[[Any, Any], bool] | None = None,
                 token_watcher: Callable[[int], None] | None = None,
                 prompt_substitute: Callable[[list[int]], list[int]] | None = None,
                 after_generation: Callable[[LlamaState], None] | None = None,
                 tokenize: Callable[[bytes, bool, bool], list[int]] | None = None,
                 penalty_last_n: int = 64) -> None:
        self.engine = engine
        self.fingerprint = fingerprint
        self.cancelled = cancelled or (lambda: False)
        self.stop_check = stop_check
        self.token_watcher = token_watcher
        self.prompt_substitute = prompt_substitute
        self.after_generation = after_generation
        self._tokenize = tokenize
        self.penalty_last_n = penalty_last_n
        self.detokenizer = engine.model.detokenizer
        self.last_prompt_length = 0
        """Tokens in the last completion's prompt."""
        self._generation: Generation | None = None
        self._run: _Run | None = None

    @property
    def last_generation(self) -> Generation | None:
        """The last completion's generation (None before the first)."""
        return self._generation

    @property
    def last_completion_tokens(self) -> int:
        """Tokens the last completion answered so far (an end-of-generation token not counted)."""
        run = self._run
        return 0 if run is None else run.completion_tokens

    @property
    def last_prompt_tokens_evaluated(self) -> int:
        """Prompt tokens the last completion evaluated (not reused from a sequence or the cache)."""
        generation = self._generation
        return 0 if generation is None else max(len(generation.prompt) - generation.reused, 0)

    # -- what chat handlers call ---------------------------------------------------------------

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """As ``llama_cpp.Llama.tokenize``."""
        if self._tokenize is not None:
            return self._tokenize(text, add_bos, special)
        return self.engine.model.tokenize(text, add_bos, special)

    def token_bos(self) -> int:
        return self.engine.model.bos

    def token_eos(self) -> int:
        return self.engine.model.eos

    def n_ctx(self) -> int:
        return int(self.engine.n_ctx)

    def is_end(self, token: int) -> bool:
        """Whether ``token`` ends a generation."""
        return bool(self.engine.model.is_end(token))

    def detokenize(self, tokens: Sequence[int], prev_tokens: Sequence[int] | None = None,
                   special: bool = False) -> bytes:
        """As ``llama_cpp.Llama.detokenize``, every piece whole."""
        return self.detokenizer.detokenize(tokens, special=special)

    def live_tokens(self) -> npt.NDArray[np.int32]:
        """The tokens the last completion's sequence holds: its prompt and the tokens it evaluated
        after (all it sampled but the last)."""
        generation = self._generation
        if generation is None:
            return np.empty(0, dtype=np.int32)
        return np.concatenate([generation.prompt, np.asarray(generation.sampled[:-1], dtype=np.int32)])

    def create_chat_completion(self, messages: list[dict[str, Any]], **options: Any) -> Any:
        """As ``llama_cpp.Llama.create_chat_completion``: the model's chat handler renders ``messages``
        and calls :meth:`create_completion`, with that method's defaults (the handlers' own differ:
        a repeat penalty of 1.1, for one)."""
        return self.engine.model.chat_handler(llama=self, messages=messages, **{**CHAT_DEFAULTS, **options})

    def create_completion(self, prompt: str | list[int], suffix: str | None = None, max_tokens: int | None = 16,
                          temperature: float = 0.8, top_p: float = 0.95, min_p: float = 0.05,
                          typical_p: float = 1.0, logprobs: int | None = None, echo: bool = False,
                          stop: str | list[str] | None = None, frequency_penalty: float = 0.0,
                          presence_penalty: float = 0.0, repeat_penalty: float = 1.0, top_k: int = 40,
                          stream: bool = False, seed: int | None = None, tfs_z: float = 1.0,
                          mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                          model: str | None = None, stopping_criteria: Any = None,
                          logits_processor: Sequence[Any] | None = None, grammar: Any = None,
                          logit_bias: dict[int, float] | None = None, **_: Any) -> Any:
        """As ``llama_cpp.Llama.create_completion``, on one sequence of the engine.

        ``logprobs``, ``echo``, ``suffix`` and ``tfs_z`` are not applied (a server adds log
        probabilities and echo itself; llama.cpp has no tail-free sampling any more).

        Raises:
            ValueError: the prompt does not fit the context, holds a token outside the vocabulary, or
                a GBNF ``grammar`` or ``logit_bias`` was given (use logits processors).
        """
        if grammar is not None or logit_bias:
            raise ValueError("grammar and logit_bias are given to this engine as logits processors")
        engine = self.engine
        if isinstance(prompt, str):
            tokens = self.tokenize(prompt.encode("utf-8"), True, True) if prompt else [engine.model.bos]
        else:
            tokens = list(prompt)
        if self.prompt_substitute is not None:
            tokens = self.prompt_substitute(tokens)
        checked = check_vocabulary(as_token_array(tokens), engine.model.n_vocab)
        n_ctx = engine.n_ctx
        if not 0 < len(checked) < n_ctx:
            raise ValueError(f"Requested tokens ({len(checked)}) exceed context window of {n_ctx}")
        room = n_ctx - len(checked)
        limit = room if max_tokens is None or max_tokens <= 0 else min(max_tokens, room)
        settings = SamplerSettings(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                   typical_p=typical_p, repeat_penalty=repeat_penalty,
                                   frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                                   penalty_last_n=self.penalty_last_n, mirostat_mode=mirostat_mode,
                                   mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, seed=seed)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        criteria = list(stopping_criteria or [])
        if self.stop_check is not None:
            criteria.append(self.stop_check)
        run = _Run(engine.model, checked, stops, criteria, limit, self.token_watcher)
        prompt = np.array(checked, dtype=np.int32)
        held = engine.reusable(prompt, self.fingerprint)  # before the lookup: an eviction after it is seen
        restore = engine.lookup(checked, self.fingerprint)
        generation = Generation(
            prompt=prompt, fingerprint=self.fingerprint,
            sampler=Sampler(settings, engine.model.n_vocab, list(logits_processor or [])),
            on_token=run.on_token, cancelled=self.cancelled, restore=restore,
            counted_on=0 if restore is not None else held,
            keep_state=engine.store_finished or self.after_generation is not None)
        self._generation = generation
        self._run = run
        self.last_prompt_length = len(checked)
        engine.enqueue(generation)
        identity = f"cmpl-{uuid.uuid4()}"
        created = int(time.time())
        name = model or str(engine.model.path.stem)
        if stream:
            return self._stream(run, generation, identity, created, name)
        text = b"".join(run.pieces(generation))
        self._finished(generation)
        return {"id": identity, "object": "text_completion", "created": created, "model": name,
                "choices": [{"text": text.decode("utf-8", "ignore"), "index": 0, "logprobs": None,
                             "finish_reason": run.finish_reason(generation)}],
                "usage": {"prompt_tokens": len(checked), "completion_tokens": run.completion_tokens,
                          "total_tokens": len(checked) + run.completion_tokens}}

    def _stream(self, run: _Run, generation: Generation, identity: str, created: int, name: str
                ) -> Iterator[dict[str, Any]]:
        def chunk(text: str, finish_reason: str | None) -> dict[str, Any]:
            return {"id": identity, "object": "text_completion", "created": created, "model": name,
                    "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}]}

        for piece in run.pieces(generation):
            yield chunk(piece.decode("utf-8", "ignore"), None)
        reason = run.finish_reason(generation)
        if generation.finish_reason in ("stop", "length"):
            self._announce(generation)
            yield chunk("", reason)
        self._finished(generation)

    def _announce(self, generation: Generation) -> None:
        """Tell a cache that takes announcements (a Redis tier) of the state about to be stored, before
        the stream's last chunk: a lookup on another instance then waits for it (see
        :meth:`llama_cache.TieredCache.announce`). Never raises."""
        state = generation.state
        announce = getattr(self.engine.cache, "announce", None)
        if state is None or not callable(announce):
            return
        try:
            announce(state.tokens, namespace=self.fingerprint)
        except Exception as error:  # noqa: BLE001 - an announcement is an optimisation
            logger.warning("could not announce a coming store: %s: %s", type(error).__name__, error)

    def _finished(self, generation: Generation) -> None:
        """After the generation's last token: raise its failure, or hand its state on."""
        generation.done.wait()
        if generation.finish_reason == "error":
            raise RuntimeError(f"the generation failed: {generation.error}")
        state = generation.state
        if state is not None:
            generation.state = None
            if self.after_generation is not None:
                self.after_generation(state)
            elif self.engine.store_finished:
                self.engine.store(state)


class _Run:
    """One completion's text as its tokens are sampled (scheduler's thread) and read (caller's thread)."""

    def __init__(self, model: Any, prompt: npt.NDArray[np.int32], stops: list[str], criteria: list[Any],
                 max_tokens: int, watcher: Callable[[int], None] | None) -> None:
        self._model = model
        self._history = list(prompt.tolist())
        self._text = StopText(stops)
        self._criteria = criteria
        self._max_tokens = max_tokens
        self._watcher = watcher
        self._out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.completion_tokens = 0
        self.reason: str | None = None

    def on_token(self, token: int) -> str | None:
        """The scheduler's callback: record ``token``; the finish reason if the completion ends with it."""
        if self._watcher is not None:
            self._watcher(token)
        model = self._model
        reason: str | None = None
        if model.is_end(token):
            reason = "stop"
        else:
            self.completion_tokens += 1
            self._history.append(token)
            released = self._text.add(model.detokenizer.piece(token))
            if released:
                self._out.put(released)
            if self._text.stopped:
                reason = "stop"
            elif self._criteria:
                ids = np.asarray(self._history, dtype=np.intc)
                if any(criterion(ids, _NO_LOGITS) for criterion in self._criteria):
                    reason = "stop"
            if reason is None and self.completion_tokens >= self._max_tokens:
                reason = "length"
        if reason is not None:
            self.end(reason)
        return reason

    def end(self, reason: str) -> None:
        rest = self._text.finish() if not self._text.stopped else b""
        if rest:
            self._out.put(rest)
        self.reason = reason
        self._out.put(_END)

    def pieces(self, generation: Generation) -> Iterator[bytes]:
        """The text's released bytes, in order, until the completion ends (or is cancelled or fails)."""
        while True:
            try:
                item = self._out.get(timeout=0.05)
            except queue.Empty:
                if generation.done.is_set() and self._out.empty():
                    return  # ended without a last token: cancelled, failed or the engine closed
                continue
            if item is _END:
                return
            yield item

    def finish_reason(self, generation: Generation) -> str:
        generation.done.wait()
        return self.reason or ("stop" if generation.finish_reason == "cancelled" else generation.finish_reason or "stop")


_NO_LOGITS = np.empty(0, dtype=np.single)
