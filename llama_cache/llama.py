"""``llama_cache.Llama``: ``llama_cpp.Llama`` with compact, shareable cache states and exact hits.

Change one import (``from llama_cache import Llama``) and ``cache=`` works as llama-cpp-python's does,
with these differences:

- States are :class:`~llama_cache.state.llama_state.LlamaState`: the sequence's KV plus one logits row,
  not a context-sized scores matrix. A state extended from a restored one shares its KV and owns only
  the new tokens', so a chat's memory grows with its new tokens.
- After a completion prompt+completion's state is cached; a repeat of the prompt restores its part of
  that state and evaluates the prompt's last token again, for its logits. From then on the prompt's
  own state is cached beside it (a view of the same KV plus one logits row), and later repeats sample
  their first token from the stored row: no decode at all. A cache that cannot answer a prompt from a
  longer key (``LlamaTrieCache``) gets the prompt's own state at once.
- When the best entry diverges from the prompt (``LlamaRAMCache``'s policy) it is restored and its KV
  cut back to the common prefix; only the rest is evaluated.
- A state from another model or KV configuration is a cache miss (logged), never a wrong answer.
- Every token's text is whole (:class:`~llama_cache.detokenizer.Detokenizer`): llama-cpp-python drops
  pieces longer than 32 bytes (runs of dashes, deep indentation) from ``detokenize`` and so from every
  completion's text.
- On recurrent and hybrid models, whose memory cannot be cut back, prefill saves checkpoints
  (:class:`~llama_cache.checkpoints.HybridCheckpointCache`) every ``checkpoint_interval`` tokens and just
  before a prompt's last token; a new prompt that leaves the live context's path resumes from the
  latest checkpoint on its own path instead of evaluating everything again.
"""

from __future__ import annotations

import ctypes
import inspect
import logging
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

import llama_cpp
import llama_cpp.llama_tokenizer
import numpy as np
import numpy.typing as npt

from llama_cache.caches.base import BaseLlamaCache
from llama_cache.checkpoints import HybridCheckpointCache, notify_memory_cleared, notify_seq_changed
from llama_cache.context_lock import MAKING_CONTEXTS
from llama_cache.detokenizer import Detokenizer
from llama_cache.native_log import route_llama_cpp_logs
from llama_cache.state.fingerprint import model_description, model_fingerprint, namespaced_fingerprint
from llama_cache.state.kv_layout import prefaulted
from llama_cache.state.llama_state import IncompatibleStateError, LlamaState, RestoreCopy
from llama_cache.tokens import as_token_array, check_vocabulary

logger = logging.getLogger(__name__)

_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")], align=True)
_SEQ = 0  # llama-cpp-python evaluates everything in sequence 0


class Llama(llama_cpp.Llama):
    """A ``llama_cpp.Llama`` whose prompt cache stores compact states and reuses partial prefixes.

    Args:
        *args, **kwargs: as ``llama_cpp.Llama``.
        cache: a prompt cache (any :class:`~llama_cache.BaseLlamaCache`), as if passed to
            ``set_cache``.
        ctx_checkpoints: maximum recurrent/hybrid checkpoints kept; 0 disables them: evaluations are
            never split and no state is extracted (the single-turn fast path). Ignored for
            transformer models, whose KV is cut back instead.
        checkpoint_interval: tokens between checkpoints during a long prefill (positive).
        checkpoint_on_device: keep checkpoint tensors in llama.cpp's device buffers
            (``LLAMA_STATE_SEQ_FLAGS_ON_DEVICE``; one checkpoint per sequence is then usable).
        cache_namespace: keep this instance's cached states apart from every other namespace's (see
            :meth:`set_cache_namespace`); None: the model's own namespace.

    Not thread-safe: like ``llama_cpp.Llama``, one instance serves one request at a time.
    """

    def __init__(
        self,
        *args: Any,
        cache: BaseLlamaCache | None = None,
        ctx_checkpoints: int = 16,
        checkpoint_interval: int = 4096,
        checkpoint_on_device: bool = False,
        cache_namespace: str | None = None,
        **kwargs: Any,
    ) -> None:
        for name, value in (("ctx_checkpoints", ctx_checkpoints), ("checkpoint_interval", checkpoint_interval)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if checkpoint_interval <= 0:
            raise ValueError(f"checkpoint_interval must be positive, got {checkpoint_interval}")
        if cache is not None and not isinstance(cache, llama_cpp.llama_cache.BaseLlamaCache):
            raise TypeError(f"cache must be a BaseLlamaCache, got {type(cache).__name__}")
        route_llama_cpp_logs()  # llama.cpp's warnings on stderr only when verbose
        with MAKING_CONTEXTS:  # see llama_cache.context_lock
            super().__init__(*args, **kwargs)
        self.ctx_checkpoints = max(ctx_checkpoints, 0)
        self.checkpoint_interval = checkpoint_interval
        self.checkpoint_on_device = bool(checkpoint_on_device)
        self.model_fingerprint = model_fingerprint(self)
        """The model's bytes and KV-shaping settings (:func:`~llama_cache.state.fingerprint.model_fingerprint`)."""
        self.fingerprint = namespaced_fingerprint(self.model_fingerprint, cache_namespace)
        """What this instance's states carry and the only states it restores: the model's fingerprint
        in the current cache namespace."""
        model = self._model.model
        self._state_is_opaque = bool(
            llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model)
        )
        self._n_vocab_cached = int(self.n_vocab())
        self.detokenizer = Detokenizer.for_llama(self)
        """The exact text of this model's tokens (what :meth:`detokenize` renders with)."""
        # The state whose KV the context holds for its first `_base_valid` tokens: a later save
        # shares that part instead of copying it.
        self._base: LlamaState | None = None
        self._base_valid = 0
        # llama.cpp's bytes of the last save, when that state was built on another: the state is only
        # offered them (it holds one copy of the KV), a cache storing it adopts them (LlamaState.lend_restore_copy).
        self._offered_copy: RestoreCopy | None = None
        # Logits restored with a state: samples at its last position use them until a decode.
        self._restored_logits: npt.NDArray[np.float32] | None = None
        self._last_logits = np.empty(self._n_vocab_cached, dtype=np.float32)
        self._last_logits_pos = -1
        self._prompt_len = 0
        self._prompt_logits: npt.NDArray[np.float32] | None = None
        self._evaluated_in_generate = 0
        self._awaiting_first_sample = False
        self._pending_prompt_state: tuple[npt.NDArray[np.int32], LlamaState] | None = None
        # Whether this completion's prompt was held whole before it ran (a repeat): only then is its
        # own state, with its logits row, cached beside prompt + completion's (see save_state).
        self._prompt_was_held = False
        self.last_prompt_tokens_evaluated = 0
        """Prompt tokens the last ``generate`` evaluated before its first token (0 on an exact hit)."""
        self.checkpoints: HybridCheckpointCache | None = None
        """Recurrent/hybrid models only: the checkpoints saved during prefill."""
        if self._state_is_opaque:
            self.checkpoints = HybridCheckpointCache(
                self._ctx.ctx, max_checkpoints=self.ctx_checkpoints, on_device=self.checkpoint_on_device
            )
        if cache is not None:
            self.set_cache(cache)

    @property
    def last_prompt_length(self) -> int:
        """Tokens in the prompt of the last ``generate`` (the completion's prompt)."""
        return self._prompt_len

    def set_cache(self, cache: BaseLlamaCache | None) -> None:  # type: ignore[override]
        """Use ``cache`` for prompt states (None: no cache).

        A cache shared by several models that can restrict its lookups to one model
        (``LlamaDiskCache.bind``) is bound to this model's fingerprint if it is not bound yet.
        """
        if cache is not None and not isinstance(cache, llama_cpp.llama_cache.BaseLlamaCache):
            raise TypeError(f"cache must be a BaseLlamaCache, got {type(cache).__name__}")
        bind = getattr(cache, "bind", None)
        if callable(bind) and getattr(cache, "fingerprint", "") is None:
            bind(self.model_fingerprint, model_info=model_description(self))
        super().set_cache(cache)

    def set_cache_namespace(self, namespace: str | None) -> None:
        """Keep the states this instance caches and finds apart from every other namespace's.

        For a server shared by tenants: in a namespace (an API key, a per-request salt), a prompt is a
        hit only for states cached in the same namespace, in every tier, and reuses no KV that another
        namespace left in the context, so neither the tokens served from the cache nor the time to
        the first token tell one tenant what another has asked. States are filed under
        :func:`~llama_cache.state.fingerprint.namespaced_fingerprint` (the model's fingerprint when
        ``namespace`` is None or empty), which becomes :attr:`fingerprint`. Changing the namespace
        empties the context (its KV belongs to the previous one); setting the current one again
        changes nothing.

        Raises:
            TypeError, ValueError: ``namespace`` is not a str or is too long.
        """
        fingerprint = namespaced_fingerprint(self.model_fingerprint, namespace)
        if fingerprint == self.fingerprint:
            return
        self._clear_context()
        self._prompt_logits = None
        self._pending_prompt_state = None
        self.fingerprint = fingerprint

    def detokenize(self, tokens: Sequence[int], prev_tokens: Sequence[int] | None = None,
                   special: bool = False) -> bytes:
        """As ``llama_cpp.Llama.detokenize``, with every piece whole (see :class:`Detokenizer`).

        Completions render their text through this method, so their text is whole too. A tokenizer
        given to the constructor (``tokenizer=``, e.g. a Hugging Face one) renders as before.

        Raises:
            ValueError: a token is not in the vocabulary.
        """
        if type(self.tokenizer_) is not llama_cpp.llama_tokenizer.LlamaTokenizer:
            return super().detokenize(list(tokens), prev_tokens=None if prev_tokens is None else list(prev_tokens),
                                      special=special)
        return self.detokenizer.detokenize(tokens, special=special)

    # -- evaluation and sampling -------------------------------------------------------------------

    def eval(self, tokens: Sequence[int]) -> None:
        """Evaluate ``tokens`` after the current ``n_tokens`` (as ``llama_cpp.Llama.eval``).

        Raises:
            ValueError: a token is negative or not in the vocabulary.
            TypeError: a token is not an int.
        """
        tokens = self._checked_tokens(tokens)
        if not tokens:
            return  # llama-cpp-python evaluates nothing before sampling an already-evaluated prompt
        self._restored_logits = None
        self._base_valid = min(self._base_valid, self.n_tokens)
        self._evaluated_in_generate += len(tokens)
        self._last_logits_pos = -1  # the row about to be computed belongs to another token
        if self.checkpoints is None or self.ctx_checkpoints == 0:
            super().eval(tokens)
        else:
            start = done = self.n_tokens
            for boundary in self._checkpoint_positions(start, start + len(tokens)):
                super().eval(tokens[done - start : boundary - start])
                done = boundary
                self.checkpoints.save_checkpoint(boundary, self._input_ids[:boundary])
            if done < start + len(tokens):
                super().eval(tokens[done - start :])
        # The last decode computed the last token's logits (llama-cpp-python asks for them): keep them,
        # so that a state saved now can serve an exact repeat without a decode.
        pointer = llama_cpp.llama_get_logits_ith(self._ctx.ctx, -1)
        if pointer:
            np.copyto(self._last_logits, np.ctypeslib.as_array(pointer, shape=(self._n_vocab_cached,)))
            self._last_logits_pos = self.n_tokens - 1

    def _checkpoint_positions(self, start: int, end: int) -> list[int]:
        """Where an evaluation of positions start..end stops to save a checkpoint.

        Every multiple of ``checkpoint_interval``, and, during a prompt's evaluation, the position just
        before its last token: the next prompt of a chat shares everything up to there, and a checkpoint
        at the very end could not be resumed from without logits.
        """
        interval = self.checkpoint_interval
        positions = set(range((start // interval + 1) * interval, end + 1, interval))
        if self._awaiting_first_sample and end == self._prompt_len and start < end - 1:
            positions.add(end - 1)
        return sorted(positions)

    def generate(self, tokens: Sequence[int], *args: Any, **kwargs: Any) -> Generator[int, Sequence[int] | None, None]:
        """As ``llama_cpp.Llama.generate``; also records the prompt's logits and evaluated tokens."""
        tokens = self._checked_tokens(tokens)
        self._prompt_len = len(tokens)
        self._prompt_logits = None
        if self.n_tokens >= len(tokens) > 0 and np.array_equal(self._input_ids[: len(tokens)], tokens):
            self._prompt_was_held = True
        self._evaluated_in_generate = 0
        self._awaiting_first_sample = True
        if self.checkpoints is not None and kwargs.get("reset", True):
            self._resume_recurrent_for(tokens)
        return (yield from super().generate(tokens, *args, **kwargs))

    def _resume_recurrent_for(self, prompt: list[int]) -> None:
        """Put a recurrent/hybrid context where llama-cpp-python's prefix reuse can continue ``prompt``.

        Recurrent memory refuses to be cut back, so llama-cpp-python re-evaluates the whole prompt
        whenever the live context is not a prefix of it. Here: keep a context that is one; else resume
        from the furthest point on the prompt's path among the checkpoints (leaving at least one token to
        evaluate, for logits) and the prompt cache's states (an earlier prompt asked again while the
        live context has moved past it); else start from an empty context.
        """
        n = self.n_tokens
        live = self.input_ids[:n]
        head = np.asarray(prompt[:n], dtype=live.dtype)
        if len(head) == n and np.array_equal(live, head) and (len(prompt) > n or not self._requires_eval):
            return
        assert self.checkpoints is not None
        best = self.checkpoints.find_best_checkpoint(prompt[: len(prompt) - 1]) if prompt else None
        cached = self._cached_state_on_path(prompt)
        if cached is not None and (best is None or cached.n_tokens > best.pos):
            try:
                self.load_state(cached)
                return
            except IncompatibleStateError:
                best = self.checkpoints.find_best_checkpoint(prompt[: len(prompt) - 1])
        if best is not None and self.checkpoints.restore_checkpoint(best):
            self.input_ids[: best.pos] = prompt[: best.pos]
            self.n_tokens = best.pos
            self._requires_eval = True
            self._forget_base()
            self._last_logits_pos = -1
            return
        if n > 0:
            self.reset()

    def _cached_state_on_path(self, prompt: list[int]) -> LlamaState | None:
        """The prompt cache's state for the longest stored prefix of ``prompt``, if it can resume it.

        Usable: one of this library's states whose tokens prefix the prompt, with logits when it covers
        the whole prompt. A failing cache is a miss (logged).
        """
        if self.cache is None or not prompt:
            return None
        try:
            state = self._lookup_in_namespace(self.cache, prompt)
        except KeyError:
            return None
        except Exception as error:  # noqa: BLE001 - a broken cache must never fail a completion
            logger.warning("prompt cache lookup failed (%s: %s); evaluating instead", type(error).__name__, error)
            return None
        if not isinstance(state, LlamaState) or state.n_tokens == 0 or state.n_tokens > len(prompt):
            return None
        if state.n_tokens == len(prompt) and state.logits is None:
            return None
        if not np.array_equal(state.tokens, np.asarray(prompt[: state.n_tokens], dtype=state.tokens.dtype)):
            return None
        return state

    def sample(self, *args: Any, idx: int | None = None, **kwargs: Any) -> int:
        """As ``llama_cpp.Llama.sample``; after an exact cache hit, samples from the stored logits.

        They serve every sample at the restored state's last position until a decode moves on.

        The stored row goes through the same sampler chain, the way ``llama_sampler_sample`` feeds
        it a freshly decoded row, so the token is the one sampled when that row was computed. (The
        first repeat of a prompt computes it again, alone in its decode: llama.cpp's logits for a row
        may differ in their last bits with the rows decoded beside it, so on a near tie a greedy
        answer can differ from the first run's, as at any change of ``n_batch``.)
        """
        position = self.n_tokens - 1 if idx is None else idx
        if self._restored_logits is not None and position == self.n_tokens - 1:
            # Kept until a decode: a completion that stops before evaluating its sampled token (one
            # token asked for) leaves the restored state as the live context, and an exact repeat of
            # the prompt then samples here again; llama.cpp holds no logits for that position (none at
            # all in a context that never decoded, another sequence's in one that did).
            row = self._restored_logits
            token = self._sample_row(row, *args, **kwargs)
        else:
            token = super().sample(*args, idx=idx, **kwargs)
            pointer = llama_cpp.llama_get_logits_ith(self._ctx.ctx, position - self.n_tokens)
            row = np.ctypeslib.as_array(pointer, shape=(self._n_vocab_cached,))
        np.copyto(self._last_logits, row)
        self._last_logits_pos = position
        if self._awaiting_first_sample:
            self._awaiting_first_sample = False
            self.last_prompt_tokens_evaluated = self._evaluated_in_generate
            if position == self._prompt_len - 1:
                self._prompt_logits = self._last_logits.copy()
                if self._state_is_opaque and self.cache is not None and not self._logits_all:
                    # Recurrent state cannot be cut back later, so the prompt's complete state is
                    # taken now, before generation moves it on.
                    self._pending_prompt_state = (self._input_ids[: self.n_tokens].copy(), self._snapshot())
        return token

    def _sample_row(self, row: npt.NDArray[np.float32], *args: Any, **kwargs: Any) -> int:
        sampler: Any = self._sampler
        temporary = sampler is None
        if temporary:
            names = (
                "top_k top_p min_p typical_p temp repeat_penalty frequency_penalty presence_penalty "
                "tfs_z mirostat_mode mirostat_eta mirostat_tau penalize_nl logits_processor grammar"
            ).split()
            options = dict(zip(names, args))
            options.update({k: v for k, v in kwargs.items() if k in names})
            sampler = self._init_sampler(**options)
        candidates = np.empty(len(row), dtype=_TOKEN_DATA)
        candidates["id"] = np.arange(len(row), dtype=np.int32)
        candidates["logit"] = row
        candidates["p"] = 0.0
        array = llama_cpp.llama_token_data_array(
            data=candidates.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)),
            size=len(row),
            selected=-1,
            sorted=False,
        )
        llama_cpp.llama_sampler_apply(sampler.sampler, ctypes.byref(array))
        token = int(array.data[array.selected].id)
        llama_cpp.llama_sampler_accept(sampler.sampler, token)
        if temporary:
            self._sampler = None
        return token

    def _checked_tokens(self, tokens: Sequence[int]) -> list[int]:
        return check_vocabulary(as_token_array(tokens), self._n_vocab_cached).tolist()

    # -- states ------------------------------------------------------------------------------------

    def save_state(self) -> LlamaState:  # type: ignore[override]
        """Snapshot the evaluated sequence as a compact :class:`LlamaState`.

        Costs one copy of llama.cpp's sequence state; when the context still holds the KV of the
        last restored or saved state, the new state shares it and keeps a copy of the new tokens'
        KV only: it holds one copy of the KV. llama.cpp's bytes for the whole sequence, which restore
        it without assembling its segments, are then only offered to it
        (:meth:`~llama_cache.state.llama_state.LlamaState.lend_restore_copy`): this context keeps them
        until its next save, and a cache storing the state adopts them as its restore copy, charged to
        the cache's budget and released before any entry is evicted. With ``logits_all=True``
        llama-cpp-python's own state (with all scores) is returned.
        """
        if self._logits_all:
            upstream = super().save_state()
            # Its own attribute, kept by every tier: load_state refuses it in another model.
            upstream.fingerprint = self.fingerprint  # type: ignore[attr-defined]
            return upstream  # type: ignore[return-value]
        state = self._snapshot()
        prompt_len = self._prompt_len
        if self._prompt_logits is not None and 0 < prompt_len < state.n_tokens and state.layout is not None:
            if self._caches_the_prompt_alone():
                self._pending_prompt_state = (state.tokens[:prompt_len], state.prefix(prompt_len, self._prompt_logits))
            if isinstance(self.cache, _FailSafeCache):
                # Inside a completion this is prompt + completion's state, which the cache keeps for
                # the next turn: a query extending it evaluates its own tokens, so its logits row
                # (one per entry, 8.5 tokens' KV for the default model) would never be read.
                return state.without_logits()
        return state

    def _caches_the_prompt_alone(self) -> bool:
        """Whether this completion's prompt gets a state of its own beside prompt + completion's.

        That state adds one logits row (8.5 tokens' KV for the default model) to serve an exact repeat
        without a decode. A cache that finds the prompt inside the longer key serves a first repeat with
        one decode, so the row is kept only for a prompt that has been asked again.
        """
        cache = self.cache
        inner = cache.wrapped if isinstance(cache, _FailSafeCache) else cache
        return self._prompt_was_held or not getattr(inner, "finds_keys_extending_the_query", False)

    def _snapshot(self) -> LlamaState:
        """The evaluated sequence as a state, sharing the KV of the state the context was built on."""
        n = self.n_tokens
        tokens = np.array(self._input_ids[:n], dtype=np.int32)
        tokens.setflags(write=False)
        seq_bytes = self._read_seq_bytes()
        logits = self._last_logits.copy() if self._last_logits_pos == n - 1 and n > 0 else None
        base, shared = self._base, self._base_valid
        if (
            base is not None
            and not self._state_is_opaque
            and 0 < shared <= min(base.n_tokens, n)
            and np.array_equal(base.tokens[:shared], tokens[:shared])
        ):
            state = base.extended(shared, tokens, logits, self._seed, seq_bytes)
        else:
            state = LlamaState.from_seq_bytes(
                tokens, logits, self._seed, self.fingerprint, seq_bytes, parse=not self._state_is_opaque
            )
        self._base, self._base_valid = state, n
        self._offered_copy = state.lend_restore_copy()
        return state

    def load_state(self, state: Any) -> None:
        """Restore a state into the context (sequence 0).

        Accepts llama-cache's :class:`LlamaState` and llama-cpp-python's own ``LlamaState``.

        Raises:
            TypeError: ``state`` is neither.
            IncompatibleStateError: the state was made by another model or KV configuration, does
                not fit the context, or llama.cpp refused it (the context is then cleared). It is a
                ``KeyError``, so a completion treats it as a cache miss.
        """
        if isinstance(state, llama_cpp.llama.LlamaState):
            self._load_upstream_state(state)
            return
        if not isinstance(state, LlamaState):
            raise TypeError(
                f"load_state takes a llama_cache.LlamaState or a llama_cpp.LlamaState, not {type(state).__name__}"
            )
        if state.fingerprint != self.fingerprint:
            logger.warning("cache miss: state made by another model or configuration (%s, here %s)",
                           state.fingerprint, self.fingerprint)
            raise IncompatibleStateError("state was made by another model or KV configuration")
        if state.n_tokens > self._n_ctx:
            raise IncompatibleStateError(f"state of {state.n_tokens} tokens does not fit n_ctx={self._n_ctx}")
        state = self._part_the_prompt_reuses(state)
        if state.logits is not None and len(state.logits) != self._n_vocab_cached:
            raise IncompatibleStateError(f"state has {len(state.logits)} logits, the model {self._n_vocab_cached}")
        try:
            check_vocabulary(state.tokens, self._n_vocab_cached)
        except ValueError as error:
            raise IncompatibleStateError(f"unusable state: {error}") from None
        memory = llama_cpp.llama_get_memory(self._ctx.ctx)
        try:
            # The bytes are lent for the block only (a reused staging buffer for assembled states); they
            # may hold a few more tokens than the state (its parent's bytes), cut right after.
            with state.restore_source(_SEQ) as (data, held):
                llama_cpp.llama_memory_seq_rm(memory, _SEQ, -1, -1)
                read = llama_cpp.llama_state_seq_set_data(
                    self._ctx.ctx, data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), len(data), _SEQ
                )
                size = len(data)
        except (ValueError, TypeError) as error:  # segments that do not assemble
            self._after_refused_state()
            raise IncompatibleStateError(f"unusable state: {error}") from None
        if read == size and held > state.n_tokens:
            if not llama_cpp.llama_memory_seq_rm(memory, _SEQ, state.n_tokens, -1):
                read = 0  # cannot happen with transformer KV; handled as a refused state
        if read != size:
            self._after_refused_state()
            logger.warning("cache miss: llama.cpp refused a %d-byte state (read %d)", size, read)
            raise IncompatibleStateError("llama.cpp refused the state")
        if self.checkpoints is not None:
            notify_seq_changed(self._ctx.ctx, _SEQ)
        n = state.n_tokens
        self.input_ids[:n] = state.tokens
        self.n_tokens = n
        self._seed = state.seed
        self._base, self._base_valid = state, n
        self._restored_logits = state.logits
        self._requires_eval = state.logits is None
        if state.logits is not None:
            np.copyto(self._last_logits, state.logits)
            self._last_logits_pos = n - 1
        else:
            self._last_logits_pos = -1

    def _part_the_prompt_reuses(self, state: LlamaState) -> LlamaState:
        """Inside a completion: the head of ``state`` its prompt shares, when the state diverges from it.

        llama-cpp-python restores the state a lookup returned and then cuts its KV back to the common
        prefix; restoring only that prefix moves fewer bytes and, for the head of a state made from
        llama.cpp's bytes, restores them without assembling anything.
        """
        cache = self.cache
        query = cache.take_query() if isinstance(cache, _FailSafeCache) else None
        if query is None or state.layout is None or not len(query):
            return state
        head = np.asarray(query[: state.n_tokens], dtype=np.int32)
        differs = np.flatnonzero(state.tokens[: len(head)] != head)
        common = int(differs[0]) if len(differs) else len(head)
        if common == len(query):
            self._prompt_was_held = True
        if common == state.n_tokens and (state.logits is not None or common < len(query)):
            return state  # the whole state is on the prompt's path: restore it as it is
        keep = min(common, len(query) - 1)  # at least one prompt token left to evaluate, for logits
        return state.prefix(keep, None) if keep > 0 else state

    def _load_upstream_state(self, state: llama_cpp.llama.LlamaState) -> None:
        """Restore llama-cpp-python's own state (whole-context bytes), checking what can be checked."""
        fingerprint = getattr(state, "fingerprint", None)
        if fingerprint is not None and fingerprint != self.fingerprint:
            logger.warning("cache miss: state made by another model or configuration (%s, here %s)",
                           fingerprint, self.fingerprint)
            raise IncompatibleStateError("state was made by another model or KV configuration")
        scores = np.asarray(state.scores)
        if not 0 <= int(state.n_tokens) <= self._n_ctx or len(state.input_ids) != self._n_ctx:
            raise IncompatibleStateError("llama-cpp-python state made for another context size")
        if scores.ndim != 2 or scores.shape[0] > len(self.scores) or scores.shape[1] != self._n_vocab_cached:
            raise IncompatibleStateError(f"llama-cpp-python state with scores of shape {scores.shape}")
        self._forget_base()
        self._last_logits_pos = -1
        try:
            super().load_state(state)
        except RuntimeError as error:  # llama.cpp refused the bytes: another model, a damaged state
            self._after_refused_state()
            logger.warning("cache miss: llama.cpp refused a llama-cpp-python state: %s", error)
            raise IncompatibleStateError(f"llama.cpp refused the state: {error}") from None
        if self.checkpoints is not None:
            notify_memory_cleared(self._ctx.ctx)

    def _after_refused_state(self) -> None:
        """After llama.cpp refused a state: an empty context, nothing derived from the old one."""
        self._clear_context()

    def _clear_context(self) -> None:
        """An empty context (its KV cells removed), nothing derived from what it held."""
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self._ctx.ctx), True)
        if self.checkpoints is not None:
            notify_memory_cleared(self._ctx.ctx)
        self.n_tokens = 0
        self._requires_eval = True
        self._forget_base()
        self._last_logits_pos = -1

    def _read_seq_bytes(self) -> npt.NDArray[np.uint8]:
        size = llama_cpp.llama_state_seq_get_size(self._ctx.ctx, _SEQ)
        buffer = prefaulted(size)  # a state's pages faulted in one call, not one at a time by llama.cpp
        written = llama_cpp.llama_state_seq_get_data(
            self._ctx.ctx, buffer.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, _SEQ
        )
        if written == 0 or written > size:
            raise RuntimeError(f"llama.cpp wrote {written} bytes of a {size}-byte sequence state")
        return buffer[:written]

    def _forget_base(self) -> None:
        self._base, self._base_valid = None, 0
        self._restored_logits = None

    def close(self) -> None:
        """Free the model and context (as ``llama_cpp.Llama.close``); the checkpoints go first."""
        checkpoints = getattr(self, "checkpoints", None)
        if checkpoints is not None:
            checkpoints.close()  # it borrows the context about to be freed
        if hasattr(self, "_stack"):  # a constructor that raised early never built one
            super().close()

    def reset(self) -> None:
        """Forget the evaluated sequence (as ``llama_cpp.Llama.reset``); the prompt cache is kept.

        On recurrent and hybrid models the memory is cleared, and the checkpoints with it.
        """
        super().reset()
        self._forget_base()
        self._last_logits_pos = -1
        self._prompt_logits = None
        self._pending_prompt_state = None
        if self.checkpoints is not None:
            notify_memory_cleared(self._ctx.ctx)

    # -- completions -------------------------------------------------------------------------------

    def _create_completion(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        # llama-cpp-python saves prompt+completion's state just before its last chunk; the prompt's
        # own state (prepared by save_state) is stored then too, before the chunk reaches the caller.
        # A cache failure (a full disk, an unreachable server, a bad value) must never fail a completion:
        # for its duration the cache is seen through a guard that turns failures into logged misses.
        self._pending_prompt_state = None
        self._prompt_was_held = False
        cache = self.cache
        if cache is not None:
            self.cache = _FailSafeCache(cache, self._lookup_in_namespace)  # type: ignore[assignment]
        # A stream's finishing chunk goes out before the state is saved: a cache that takes
        # announcements (the Redis tier) is told first, so that a next turn on another process,
        # which may come as soon as the chunk arrives, waits for the state instead of missing it.
        announce = getattr(cache, "announce", None) if _streams(args, kwargs) else None
        try:
            for chunk in super()._create_completion(*args, **kwargs):
                self._store_prompt_state()
                if callable(announce) and _finishes(chunk):
                    self._announce(announce)
                    announce = None
                yield chunk
            self._store_prompt_state()
        finally:
            if isinstance(self.cache, _FailSafeCache):
                self.cache = cache

    def _announce(self, announce: Callable[..., None]) -> None:
        """Announce the state about to be saved (the evaluated tokens) to the cache; never raises."""
        try:
            announce(np.array(self._input_ids[: self.n_tokens], dtype=np.int32), namespace=self.fingerprint)
        except Exception as error:  # noqa: BLE001 - a cache failure never fails a completion
            logger.warning("could not announce a state to the cache (%s: %s)", type(error).__name__, error)

    def _lookup_in_namespace(self, cache: Any, key: Sequence[int]) -> Any:
        """The state ``cache`` answers ``key`` with in this instance's namespace (KeyError: none).

        llama-cache's caches are asked for this namespace's states (the shared prefix only: that is
        what is restored); any other cache only in the model's own namespace, since it cannot tell
        namespaces apart.
        """
        if isinstance(cache, _FailSafeCache):
            return cache[key]
        namespaced = self.fingerprint != self.model_fingerprint
        if isinstance(cache, BaseLlamaCache):
            # In the model's own namespace, the cache's binding decides (an unbound cache answers from
            # every model's states, and a state of another model is a logged miss at restore).
            return cache.lookup_prefix(key, namespace=self.fingerprint if namespaced else None)
        if namespaced:
            raise KeyError("this cache cannot keep namespaces apart")
        return cache[key]

    def _store_prompt_state(self) -> None:
        pending, self._pending_prompt_state = self._pending_prompt_state, None
        if pending is not None and self.cache is not None:
            key, state = pending
            self.cache[key] = state  # through _FailSafeCache: never raises


def _streams(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether llama-cpp-python's ``_create_completion`` called with these arguments streams."""
    try:
        return bool(inspect.signature(llama_cpp.Llama._create_completion).bind(None, *args, **kwargs).arguments.get(
            "stream", False))
    except TypeError:
        return False


def _finishes(chunk: Any) -> bool:
    """Whether a completion chunk is the one with the finish reason."""
    try:
        return chunk["choices"][0].get("finish_reason") is not None
    except (TypeError, KeyError, IndexError, AttributeError):
        return False


class _FailSafeCache:
    """A completion's view of its prompt cache: failures become logged misses and skipped stores.

    Lookups that raise anything but ``KeyError``, or return something that is not a state, are misses;
    stores that raise are logged and dropped. Everything else is the wrapped cache's.
    """

    __slots__ = ("_cache", "_lookup", "_query")

    def __init__(self, cache: Any, lookup: Callable[[Any, Sequence[int]], Any]) -> None:
        self._cache = cache
        self._lookup = lookup  # (cache, key) -> state, in the completion's namespace
        self._query: Sequence[int] | None = None

    @property
    def wrapped(self) -> Any:
        """The cache this view guards."""
        return self._cache

    def take_query(self) -> Sequence[int] | None:
        """The key of the last lookup, once: llama-cpp-python restores what that lookup returned."""
        query, self._query = self._query, None
        return query

    def __bool__(self) -> bool:
        return True

    def __getitem__(self, key: Sequence[int]) -> Any:
        self._query = key
        try:
            # Our tiers read only what the prompt shares with the answering entry (the disk tier's
            # chunks up to the divergence); any other cache answers as its own __getitem__ does.
            value = self._lookup(self._cache, key)
        except KeyError:
            raise
        except Exception as error:  # noqa: BLE001 - any cache failure is a miss
            logger.warning("prompt cache lookup failed (%s: %s); a miss", type(error).__name__, error)
            raise KeyError("prompt cache lookup failed") from None
        if not isinstance(value, (LlamaState, llama_cpp.llama.LlamaState)):
            logger.warning("prompt cache returned a %s, not a state; a miss", type(value).__name__)
            raise KeyError("prompt cache returned no state")
        return value

    def __setitem__(self, key: Sequence[int], value: Any) -> None:
        try:
            self._cache[key] = value
        except Exception as error:  # noqa: BLE001 - any cache failure is a skipped store
            logger.warning("could not cache a state (%s: %s)", type(error).__name__, error)

    def __contains__(self, key: Sequence[int]) -> bool:
        try:
            return key in self._cache
        except Exception:  # noqa: BLE001
            return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)
