"""The engine: one model, one llama.cpp context, many sequences, continuous batching, the cache tiers.

:class:`Engine` assembles the parts (:mod:`.model`, :mod:`.context`, :mod:`.residency`,
:mod:`.scheduler`) and is what users of many requests at once talk to: the server, or a program's own
batch jobs through :meth:`Engine.completions` (llama-cpp-python's ``create_completion`` and
``create_chat_completion``, per request, on the shared engine).

A prompt starts from the longest of: cells a live or idle sequence of its cache namespace holds
(shared with ``llama_memory_seq_cp``), a state of the cache tiers (restored into its sequence), a
checkpoint of an idle sequence on its path (recurrent and hybrid models: :mod:`.rollback`), or
nothing. Finished sequences stay in the context, idle, as the fastest tier; they go to the cache tiers
when evicted, when a long prompt is admitted (``clear_idle_rows``: in one pool every row walks their
cells too), and at :meth:`Engine.close`. With ``store_finished`` (a disk or shared tier: other
processes should find the state now), every finished completion's state is stored as it ends.

Thread-safety: every public method may be called from any thread; the scheduler's thread alone
touches the context.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import numpy.typing as npt

from llama_cache._model import default_model_path
from llama_cache.caches.base import BaseLlamaCache
from llama_cache.engine.completions import Completions
from llama_cache.engine.context import BatchContext, ContextSettings, flash_attention_for
from llama_cache.engine.model import Model
from llama_cache.engine.requests import EngineRequest
from llama_cache.engine.residency import Residency
from llama_cache.engine.rollback import DEFAULT_CHECKPOINT_BYTES, DEFAULT_CHECKPOINT_INTERVAL, Rollback
from llama_cache.engine.scheduler import Generation, Scheduler
from llama_cache.state.fingerprint import context_fingerprint, describe_model, namespaced_fingerprint
from llama_cache.state.llama_state import LlamaState

__all__ = ["Engine"]

logger = logging.getLogger(__name__)


def _keywords(function: Any, *excluded: str) -> frozenset[str]:
    parameters = inspect.signature(function).parameters.values()
    return frozenset(p.name for p in parameters if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD
                     ) - {"self", *excluded}


# What Engine.submit takes: llama-cpp-python's own options (its chat method's for messages) but those
# the engine does not apply (a server adds log probabilities and echo itself).
_NOT_APPLIED = ("prompt", "messages", "stream", "logprobs", "top_logprobs", "echo", "suffix")
_COMPLETION_OPTIONS = _keywords(Completions.create_completion, *_NOT_APPLIED)
_CHAT_OPTIONS = _keywords(llama_cpp.Llama.create_chat_completion, *_NOT_APPLIED)


class Engine:
    """A model served to many sequences at once (see the module's docstring).

    Args:
        model_path: the GGUF file (None: the embedded default model).
        n_ctx: the pool of KV cells every sequence draws from; one sequence may use all of it.
        parallel: generations running at once.
        idle_sequences: finished sequences kept in the context for reuse beyond ``parallel``
            (None: as many as ``parallel``, at least 4); ``parallel + idle_sequences`` is the context's
            ``n_seq_max``, at most llama.cpp's limit.
        n_threads: llama.cpp's threads (None: one per CPU the process may use).
        n_batch: the most tokens one decode evaluates. The context's batch is no larger than a step
            can fill, ``n_seq_max + prompt_rows_per_step`` rows (a generated token per sequence and
            the prompt rows), since llama.cpp sizes its compute buffer for a full one (with the
            default model, a 512-row batch's logits alone take 96 MiB).
        flash_attn: llama.cpp's flash attention; None (auto): on, so that a sequence's rows skip
            the other sequences' cells in the pool (docs/engine.md, "Flash attention"). Off, every
            row multiplies through every cell in use, and a sequence's logits depend slightly on where
            its cells lie and what is decoded beside it; deterministic mode refuses it.
        cache: the cache tiers (None: none; idle sequences are the only reuse).
        clear_idle_rows: a request admitted with at least this many prompt tokens to evaluate, and
            no other request running, first moves the idle sequences to ``cache`` (stored, then
            emptied), so that its rows do not walk their cells (docs/engine.md, "What the unified
            pool costs"), but those a waiting request goes on from and those the cache refused;
            None: never. Applies with a ``cache``, to a transformer model's shared pool (not in
            deterministic mode).
        store_finished: store each finished completion's state in ``cache`` as it ends (else at
            eviction and at :meth:`close`).
        chat_template: a Jinja2 chat template instead of the model's.
        prompt_rows_per_step: the most prompt tokens one step evaluates; a prompt that cannot finish
            in the step reads fewer while other rows of it sample, so that their tokens wait at most
            about one decode step longer (see the serving docs).
        checkpoint_interval: recurrent and hybrid models: prompt tokens between two checkpoints of
            a sequence's recurrent state, besides the one before a prompt's last token (see
            :mod:`.rollback`).
        checkpoint_bytes: recurrent and hybrid models: the most bytes those checkpoints hold
            together, oldest out first.
        deterministic: a greedy answer is the same alone or under any load, bit for bit: each
            sequence has a KV stream of its own (``n_ctx / n_seq_max`` cells, rounded up to 256 by
            llama.cpp; one is kept spare), its rows are decoded apart from other sequences', and a
            head it reuses is copied rather than shared (see :mod:`.scheduler`). Transformer models
            only. ``idle_sequences`` then defaults to 0 (each sequence id takes its stream's cells).

    Raises:
        FileNotFoundError: the model file does not exist.
        ValueError: llama.cpp could not load it or make the context, an argument is out of range,
            or ``deterministic`` was asked of a model with recurrent memory.
    """

    def __init__(self, model_path: str | os.PathLike[str] | None = None, *, n_ctx: int = 4096, parallel: int = 4,
                 idle_sequences: int | None = None, n_threads: int | None = None, n_batch: int = 512,
                 flash_attn: bool | None = None, cache: BaseLlamaCache | None = None, store_finished: bool = False,
                 chat_template: str | None = None, prompt_rows_per_step: int = 64,
                 deterministic: bool = False, checkpoint_interval: int = DEFAULT_CHECKPOINT_INTERVAL,
                 checkpoint_bytes: int = DEFAULT_CHECKPOINT_BYTES, clear_idle_rows: int | None = 128) -> None:
        if parallel < 1:
            raise ValueError(f"parallel must be positive, got {parallel}")
        if idle_sequences is not None:
            idle = idle_sequences
        else:
            idle = 0 if deterministic else max(parallel, 4)
        for name, value in (("checkpoint_interval", checkpoint_interval), ("checkpoint_bytes", checkpoint_bytes),
                            ("clear_idle_rows", 1 if clear_idle_rows is None else clear_idle_rows)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if idle < 0:
            raise ValueError(f"idle_sequences must not be negative, got {idle}")
        n_seq = min(parallel + idle, int(llama_cpp.llama_max_parallel_sequences()))
        if n_seq < parallel:
            raise ValueError(f"parallel may be at most {n_seq}, got {parallel}")
        if n_batch < 1 or prompt_rows_per_step < 1:
            raise ValueError(f"n_batch and prompt_rows_per_step must be positive, got {n_batch}, {prompt_rows_per_step}")
        path = Path(model_path) if model_path is not None else default_model_path()
        self.model = Model(path, chat_template)
        try:
            if deterministic and self.model.recurrent:
                raise ValueError(f"deterministic mode needs a transformer model; {path.name} has recurrent memory")
            threads = n_threads or len(os.sched_getaffinity(0))
            flash = flash_attention_for(flash_attn, deterministic)
            self.context = BatchContext(self.model, ContextSettings(
                n_ctx=n_ctx, n_seq_max=n_seq, n_batch=min(n_batch, n_seq + prompt_rows_per_step),
                n_threads=threads, flash_attn=flash,
                kv_unified=not deterministic))
        except BaseException:
            self.model.close()
            raise
        self.parallel = parallel
        self.deterministic = deterministic
        self.flash_attn = flash
        """Whether llama.cpp's flash attention is on."""
        self.n_ctx = self.context.n_ctx_seq - 1 if deterministic else self.context.n_ctx
        """The most tokens one request may hold (its prompt and answer): the pool, or in
        deterministic mode its sequence's stream but the spare cell."""
        self.model_fingerprint = context_fingerprint(path, self.model.pointer, self.context.params, self.model.n_vocab)
        """The model's bytes and the context's KV-shaping settings: what its states carry."""
        self.cache = cache
        self.store_finished = store_finished and cache is not None
        if cache is not None:
            bind = getattr(cache, "bind", None)
            if callable(bind) and getattr(cache, "fingerprint", "") is None:
                bind(self.model_fingerprint, model_info=describe_model(path, self.model.pointer))
        self.residency = Residency(n_seq, whole_states_only=self.model.recurrent, shared_cells=not deterministic)
        self.rollback = (Rollback(self.context.pointer, n_seq, checkpoint_interval, checkpoint_bytes)
                         if self.model.recurrent else None)
        """A recurrent or hybrid model's checkpoints per sequence (None for transformers)."""
        self.scheduler = Scheduler(self.context, self.residency, store=self.store if cache is not None else None,
                                   lookup=self.lookup if cache is not None else None,
                                   max_running=n_seq, prompt_rows_per_step=prompt_rows_per_step,
                                   deterministic=deterministic, rollback=self.rollback,
                                   clear_idle_rows=(clear_idle_rows if cache is not None and not deterministic
                                                    and not self.model.recurrent else None))
        self._closed = False

    # -- namespaces and reuse ----------------------------------------------------------------------

    def fingerprint(self, namespace: str | None = None) -> str:
        """The fingerprint of the states of cache namespace ``namespace`` (None: the model's own)."""
        return namespaced_fingerprint(self.model_fingerprint, namespace)

    def reusable(self, tokens: npt.NDArray[np.int32], fingerprint: str) -> int:
        """How many leading tokens of ``tokens`` a sequence of the context holds for that namespace. O(K x sequences)."""
        return self.residency.reusable(tokens, fingerprint, len(tokens) - 1)[1]

    def lookup(self, tokens: Sequence[int], fingerprint: str) -> LlamaState | None:
        """The cache tiers' state for the longest head of ``tokens`` in that namespace, if it reaches
        further than the context's sequences; None otherwise. A failing cache is a logged miss.

        Runs in the caller's thread (a disk or Redis tier may take milliseconds), and on the
        scheduler's for a request whose head left the context between its submission and its
        admission (rare: see :attr:`~.scheduler.Generation.counted_on`).
        """
        cache = self.cache
        if cache is None or len(tokens) < 2:
            return None
        head = np.asarray(tokens, dtype=np.int32)[:-1]
        try:
            if cache.match_length(head, namespace=fingerprint) <= self.reusable(np.asarray(tokens, dtype=np.int32),
                                                                               fingerprint):
                return None
            state = cache.lookup_prefix(head, namespace=fingerprint)
        except KeyError:
            return None
        except Exception as error:  # noqa: BLE001 - a failing cache is an empty one
            logger.warning("prompt cache lookup failed: %s: %s", type(error).__name__, error)
            return None
        if not isinstance(state, LlamaState) or state.fingerprint != fingerprint:
            return None
        if state.logits is not None and len(state.logits) != self.model.n_vocab:
            return None
        if len(state.tokens) and int(np.max(state.tokens)) >= self.model.n_vocab:
            return None
        return state

    def store(self, state: LlamaState) -> bool:
        """Give ``state`` to the cache tiers; False if there are none or they failed (logged, never
        raised). True says the tiers raised nothing, not that a budget will keep it."""
        cache = self.cache
        if cache is None:
            return False
        try:
            cache[state.tokens] = state
        except Exception as error:  # noqa: BLE001 - storing is an optimisation
            logger.warning("prompt cache store failed: %s: %s", type(error).__name__, error)
            return False
        return True

    def figures(self) -> dict[str, float]:
        """The engine's counters and gauges now (for metrics): sequences waiting, tokens evaluated,
        decodes, tokens shared and restored, evictions, preemptions, the seconds in steps and in
        ``llama_decode`` alone, the KV pool and its cells in use,
        and the step budget's measurements (0 until measured) with the prompt rows it allows a step
        beside generating sequences."""
        stats = self.scheduler.stats
        budget = self.scheduler.step_budget
        return {"waiting": self.scheduler.waiting, "tokens": stats.tokens, "steps": stats.steps,
                "shared_tokens": stats.shared_tokens, "restored_tokens": stats.restored_tokens,
                "evicted_sequences": stats.evicted, "preempted": stats.preempted,
                "step_seconds": stats.step_seconds, "decode_seconds": stats.decode_seconds,
                "kv_cells": self.context.n_ctx, "kv_cells_in_use": self.residency.cells_in_use(),
                "decode_step_seconds": budget.decode_step or 0.0, "prompt_row_seconds": budget.prompt_row or 0.0,
                "prompt_rows_while_generating": budget.rows(1)}

    # -- generations ------------------------------------------------------------------------------

    def submit(self, prompt: str | Sequence[int] | npt.NDArray[np.integer] | list[dict[str, Any]], /, *, namespace: str | None = None,
               **options: Any) -> EngineRequest:
        """Start one completion and return at once: its generation is queued, batched with whatever
        else runs.

        Args:
            prompt: a text or token ids (``llama_cpp.Llama.create_completion``'s prompt, with its
                defaults: 16 tokens at temperature 0.8), or chat messages (``create_chat_completion``'s,
                rendered by the model's chat template, with its defaults).
            namespace: the cache namespace: only sequences and states of the same one are reused
                (None: the model's own).
            options: that method's sampling keywords (``max_tokens``, ``temperature``, ``top_p``,
                ``top_k``, ``min_p``, ``stop``, ``seed``, penalties, ``logits_processor``, ...); not
                ``logprobs``, ``echo`` or ``suffix``, which the engine does not apply.

        Returns:
            An :class:`~.requests.EngineRequest`: iterate it for the text as it comes, or call its
            ``result()`` for the whole response.

        Raises:
            ValueError: the prompt is empty or does not fit, holds a token outside the vocabulary, or
                an option is not one of the method's.
            RuntimeError: the engine is closed.
        """
        if self._closed:
            raise RuntimeError("the engine is closed")
        if "stream" in options:
            raise ValueError("submit() always streams: iterate the request, or call its result()")
        chat = isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) for m in prompt)
        unknown = sorted(set(options) - (_CHAT_OPTIONS if chat else _COMPLETION_OPTIONS))
        if unknown:
            raise ValueError(f"not an option of {'create_chat_completion' if chat else 'create_completion'}: "
                             f"{', '.join(unknown)}")
        cancelled = threading.Event()
        completions = self.completions(namespace, cancelled=cancelled.is_set)
        try:
            if chat:
                chunks = completions.create_chat_completion(prompt, stream=True, **options)  # type: ignore[arg-type]
            elif isinstance(prompt, np.ndarray):
                chunks = completions.create_completion(prompt.tolist(), stream=True, **options)
            elif isinstance(prompt, str) or (isinstance(prompt, Sequence) and not isinstance(prompt, bytes)):
                chunks = completions.create_completion(prompt, stream=True, **options)  # type: ignore[arg-type]
            else:
                raise ValueError(f"a prompt is a text, token ids or chat messages, not {type(prompt).__name__}")
        except TypeError as error:
            raise ValueError(str(error)) from None
        return EngineRequest(completions, iter(chunks), chat, cancelled)

    def enqueue(self, generation: Generation) -> None:
        """Queue one sequence's generation (see :class:`~.scheduler.Generation`): what
        :class:`~.completions.Completions` does for each completion.

        Raises:
            RuntimeError: the engine is closed.
            ValueError: its prompt does not fit.
        """
        self.scheduler.submit(generation)

    def completions(self, namespace: str | None = None, **options: Any) -> Completions:
        """llama-cpp-python's completion API for one request on this engine
        (:class:`~.completions.Completions`; ``options`` are its keyword arguments).

        Raises:
            RuntimeError: the engine is closed.
        """
        if self._closed:
            raise RuntimeError("the engine is closed")
        return Completions(self, self.fingerprint(namespace), **options)

    def close(self) -> None:
        """Stop the scheduler, give idle sequences' states to the cache tiers, flush them, free
        the context and the model; once."""
        if self._closed:
            return
        self._closed = True
        self.scheduler.close()
        if self.cache is not None:
            for resident in self.residency.idle():
                if resident.stored < resident.n:
                    try:
                        self.store(self.scheduler.snapshot(resident))
                    except Exception as error:  # noqa: BLE001 - closing goes on
                        logger.warning("could not store a sequence's state at close: %s", error)
            close = getattr(self.cache, "close", None)
            if callable(close):
                close()
        if self.rollback is not None:
            self.rollback.close()  # it borrows the context about to be freed
        self.context.close()
        self.model.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
