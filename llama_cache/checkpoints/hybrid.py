"""Checkpoints of the recurrent state of hybrid and recurrent models, for rolling a sequence back.

A Transformer's KV cache can be truncated to any earlier position; the state of a recurrent layer (Mamba,
Mamba-2, LFM2 short convolutions...) cannot, because it holds only the summary of *all* tokens seen so far.
To roll such a sequence back, the recurrent state must have been saved at the target position.
:class:`HybridCheckpointCache` saves and restores it with llama.cpp's ``PARTIAL_ONLY`` sequence-state API:
a checkpoint holds only the recurrent part (a few KiB, independent of the length), while the attention part
of a hybrid model stays in the live context. Restoring therefore also needs the attention memory to still
hold the checkpoint's prefix, and cuts it back to the checkpoint's end.

A checkpoint is thus valid only while the context's memory still holds its history: the caches of one
context register with :mod:`llama_cache.checkpoints.registry`, whose ``notify_*`` functions report the
changes made elsewhere, and share its per-context lock.

Thread-safety: every public method takes the re-entrant lock shared by all caches of the same context.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import hashlib
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn

import llama_cpp
import numpy as np
import numpy.typing as npt

from llama_cache.caches.base import BaseLlamaCache, CacheStats
from llama_cache.checkpoints import registry
from llama_cache.checkpoints.registry import ContextPointer
from llama_cache.index import RadixIndex
from llama_cache.tokens import Tokens, as_token_array

__all__ = ["HybridCheckpoint", "HybridCheckpointCache"]

logger = logging.getLogger("llama_cache.checkpoints")  # one logger for the checkpoints package

PARTIAL_ONLY: int = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
ON_DEVICE: int = llama_cpp.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE

_DISABLED_MESSAGE = "HybridCheckpointCache: pls use save_checkpoint or restore_checkpoint method"

_TokenArray = npt.NDArray[np.int32]


@dataclass
class HybridCheckpoint:
    """One saved recurrent-state snapshot of a sequence.

    Normally created by :meth:`HybridCheckpointCache.save_checkpoint`; a checkpoint can be restored only
    through the cache that created it, and only while that cache still holds this very object.

    Attributes:
        pos: Number of tokens of the prefix the checkpoint was taken after.
        data: The host-visible serialized state: the whole ``PARTIAL_ONLY`` state in host mode, only the
            metadata part in device mode (the tensors then stay in llama.cpp's per-sequence device slot).
        hash_val: First 32 hex digits of the SHA-256 of the prefix tokens (``"empty"`` for no tokens).
        size: Number of bytes llama.cpp wrote, ``len(data)``.
        seq_id: The llama.cpp sequence the state was taken from.
        pos_min: Smallest native memory position of the sequence when saved (-1 if it was empty).
        pos_max: Largest native memory position of the sequence when saved (-1 if it was empty); None only
            for checkpoints built by hand, which no cache accepts.
    """

    pos: int
    data: bytes
    hash_val: str
    size: int
    seq_id: int
    pos_min: int = -1
    pos_max: int | None = None


@dataclass(eq=False)
class _Entry:
    """A registered checkpoint and its exact token key (a read-only int32 copy of ``tokens[:pos]``)."""

    checkpoint: HybridCheckpoint
    key: _TokenArray


class HybridCheckpointCache(BaseLlamaCache):
    """Saves and restores the recurrent state of sequences of a hybrid or recurrent model.

    Checkpoints are taken with ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``: only the recurrent part of the state is
    serialized, and the attention memory of a hybrid model stays in the context. Restoring puts the recurrent
    state back and removes the attention memory after the checkpoint (``llama_memory_seq_rm`` from
    ``pos_max + 1``), leaving the sequence exactly as it was when the checkpoint was taken -- provided its
    prefix is still in memory, which the invalidation rules below guarantee for every change they are told of.

    Two modes:

    * host (``on_device=False``): each checkpoint owns its serialized state as Python bytes; a sequence may
      have many checkpoints.
    * device (``on_device=True``): ``LLAMA_STATE_SEQ_FLAGS_ON_DEVICE`` is passed on, so llama.cpp keeps the
      tensors in one context-owned slot per sequence and Python gets only the metadata. Saving overwrites the
      slot, so a sequence has at most one device checkpoint across all caches of the context: saving drops
      the older ones.

    Lookup: each sequence's checkpoints are indexed by their exact token prefix in a
    :class:`~llama_cache.index.RadixIndex`, so :meth:`find_best_checkpoint` costs O(K) in the query length
    whatever the number of checkpoints. Eviction is FIFO (oldest saved first) by count and, with
    ``max_bytes``, by host-visible bytes. Saving under a key that already has a checkpoint replaces it.

    Invalidation: an evicted, cleared, replaced or invalidated checkpoint object is never restored again,
    even if the caller kept a reference (restore checks the object's identity against the cache's own
    entries); a restored one stays registered and can be restored again.
    A successful restore drops the checkpoints of that sequence, in every cache of the context, whose
    prefix is not a prefix of the restored one (those beyond it, and any on another branch); a failed one
    drops all of that sequence's. See also :meth:`drop_checkpoints` and the ``notify_*`` functions of
    :mod:`llama_cache.checkpoints.registry`.

    Not a token-to-state mapping: ``cache[key]``, ``cache[key] = state`` and ``key in cache`` raise
    NotImplementedError.

    Thread-safety: every method takes the re-entrant lock shared by all caches of the same context.

    Args:
        ctx: The raw ``llama_context *`` (e.g. ``Llama._ctx.ctx``), borrowed: never freed by the cache. It
            must outlive the cache or the cache must be closed first.
        max_checkpoints: Most checkpoints kept; 0 or less disables the cache (saving then returns False
            without touching llama.cpp, which spares the state extraction in single-turn use).
        on_device: Use device mode (see above).
        verbose: Log diagnostics to the ``llama_cache.checkpoints`` logger at DEBUG level (never printed).
        max_bytes: Host-visible byte budget (``cache_size``), or None for none. A checkpoint larger than the
            whole budget is not saved.

    Raises:
        ValueError: ``ctx`` is None or null, or ``max_bytes`` is not positive.
        TypeError: ``ctx`` is not a pointer, or ``max_checkpoints``/``max_bytes`` is not an int.
    """

    usable_as_tier: ClassVar[bool] = False  # not a token-to-state mapping (see above)

    def __init__(
        self,
        ctx: ContextPointer | None,
        max_checkpoints: int = 16,
        on_device: bool = False,
        verbose: bool = False,
        max_bytes: int | None = None,
    ) -> None:
        address = registry.context_address(ctx)
        if not isinstance(max_checkpoints, int) or isinstance(max_checkpoints, bool):
            raise TypeError(f"max_checkpoints must be an int, got {type(max_checkpoints).__name__}")
        if max_bytes is not None:
            if not isinstance(max_bytes, int) or isinstance(max_bytes, bool):
                raise TypeError(f"max_bytes must be an int or None, got {type(max_bytes).__name__}")
            if max_bytes <= 0:
                raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        # capacity_bytes is reported by stats(); without a byte budget it is "unbounded".
        super().__init__(max_bytes if max_bytes is not None else sys.maxsize)
        self._ctx: ContextPointer | None = ctx
        self._address = address
        self.on_device = bool(on_device)
        self.verbose = verbose
        self.max_checkpoints = max_checkpoints
        self.max_bytes = max_bytes
        self._flags = PARTIAL_ONLY | (ON_DEVICE if self.on_device else 0)
        self._get_size_ext: Callable[..., int] | None = llama_cpp.llama_state_seq_get_size_ext
        self._get_data_ext: Callable[..., int] | None = llama_cpp.llama_state_seq_get_data_ext
        self._set_data_ext: Callable[..., int] | None = llama_cpp.llama_state_seq_set_data_ext
        self._get_memory: Callable[..., Any] | None = llama_cpp.llama_get_memory
        self._seq_pos_min: Callable[..., int] | None = llama_cpp.llama_memory_seq_pos_min
        self._seq_pos_max: Callable[..., int] | None = llama_cpp.llama_memory_seq_pos_max
        self._seq_rm: Callable[..., bool] | None = llama_cpp.llama_memory_seq_rm
        # FIFO order = insertion order; keyed by id() of the checkpoint, which the entry keeps alive.
        self._entries: dict[int, _Entry] = {}
        self._indexes: dict[int, RadixIndex[_Entry]] = {}
        self._current_size = 0
        self._hits = self._misses = self._evictions = self._rejected = 0
        self._lock = registry.register(address, self)
        if max_checkpoints <= 0:
            self._debug("HybridCheckpointCache: max_checkpoints=%d, rollback disabled", max_checkpoints)

    # ------------------------------------------------------------------------------------ introspection

    @property
    def cache_size(self) -> int:
        """Host-visible bytes of the registered checkpoints (device-resident tensors not included). O(1)."""
        return self._current_size

    @property
    def checkpoints(self) -> list[HybridCheckpoint]:
        """The registered checkpoints, oldest first (a new list). O(N)."""
        with self._lock:
            return [entry.checkpoint for entry in self._entries.values()]

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._ctx is None

    def __len__(self) -> int:
        """Number of registered checkpoints. O(1)."""
        return len(self._entries)

    def stats(self) -> CacheStats:
        """A snapshot of the counters.

        ``hits``/``misses`` count :meth:`find_best_checkpoint` results; ``evictions`` the checkpoints dropped
        by the count or byte budget (not invalidations); ``rejected`` the saves refused because one checkpoint
        alone exceeds ``max_bytes``; ``capacity_bytes`` is ``max_bytes``, or ``sys.maxsize`` without one.
        """
        with self._lock:
            return CacheStats(
                hits=self._hits,
                misses=self._misses,
                entries=len(self._entries),
                bytes=self._current_size,
                capacity_bytes=self.capacity_bytes,
                evictions=self._evictions,
                rejected=self._rejected,
            )

    # ------------------------------------------------------------------------------------ core methods

    @staticmethod
    def _hash_prefix(tokens: Tokens, length: int) -> str:
        """First 32 hex digits of the SHA-256 of ``tokens[:length]`` as C ints (``array('i')`` bytes).

        Returns ``"empty"`` when ``length <= 0``; ``length`` is clamped to ``len(tokens)``. O(length).
        """
        if length <= 0:
            return "empty"
        prefix = as_token_array(tokens)[:length]
        return hashlib.sha256(array.array("i", prefix.tolist()).tobytes()).hexdigest()[:32]

    def save_checkpoint(self, current_pos: int, tokens: Tokens, seq_id: int = 0) -> bool:
        """Save the current recurrent state of sequence ``seq_id`` as the checkpoint of ``tokens[:current_pos]``.

        The caller vouches that the sequence currently holds exactly ``tokens[:current_pos]``. A checkpoint
        under the same prefix and sequence is replaced. In device mode the older device checkpoints of
        ``seq_id`` in every cache of the context are dropped first, as llama.cpp overwrites their slot. Then
        the oldest checkpoints are evicted while over ``max_checkpoints`` or ``max_bytes``.

        Complexity: O(S + K) for a state of S bytes and K tokens, plus O(N) in device mode; the native
        extraction dominates. Thread-safe.

        Args:
            current_pos: Number of leading tokens of ``tokens`` the sequence holds.
            tokens: The token history (a sequence of ints or a 1-D integer array); only
                ``tokens[:current_pos]`` is used.
            seq_id: The llama.cpp sequence.

        Returns:
            True if saved. False when the cache is disabled (no llama.cpp call at all) or closed, when llama.cpp
            reports an empty state or writes an unexpected number of bytes, or when the state alone exceeds
            ``max_bytes`` (counted in ``stats().rejected``).

        Raises:
            ValueError: ``current_pos`` is outside ``[0, len(tokens)]``, ``seq_id`` is negative, or a token is
                out of range.
            TypeError: ``tokens`` is not a sequence of ints.
        """
        with self._lock:
            if self.max_checkpoints <= 0:
                return False
            ctx = self._ctx
            if ctx is None:
                return False
            assert self._get_size_ext is not None and self._get_data_ext is not None
            assert self._get_memory is not None and self._seq_pos_min is not None and self._seq_pos_max is not None
            all_tokens = as_token_array(tokens)
            if not 0 <= current_pos <= len(all_tokens):
                raise ValueError(f"current_pos must be in [0, {len(all_tokens)}], got {current_pos}")
            if seq_id < 0:
                raise ValueError(f"seq_id must be non-negative, got {seq_id}")

            memory = self._get_memory(ctx)
            if memory is None:
                self._debug("HybridCheckpointCache(save): the context has no memory")
                return False
            size = int(self._get_size_ext(ctx, seq_id, self._flags))
            if size == 0:
                self._debug("HybridCheckpointCache(save): llama.cpp reports an empty state for seq %d", seq_id)
                return False
            if self.max_bytes is not None and size > self.max_bytes:
                self._rejected += 1
                self._debug("HybridCheckpointCache(save): %d bytes exceed max_bytes=%d", size, self.max_bytes)
                return False
            if self.on_device:
                # Before extracting: the extraction itself overwrites the slot their tensors live in.
                registry.for_each_cache(self._address, lambda cache: cache.drop_device_checkpoints(seq_id))
            buffer = (ctypes.c_uint8 * size)()
            written = int(self._get_data_ext(ctx, buffer, size, seq_id, self._flags))
            if written != size:
                self._debug("HybridCheckpointCache(save): wrote %d bytes, expected %d", written, size)
                return False
            checkpoint = HybridCheckpoint(
                pos=current_pos,
                data=bytes(buffer),
                hash_val=self._hash_prefix(all_tokens, current_pos),
                size=size,
                seq_id=seq_id,
                pos_min=int(self._seq_pos_min(memory, seq_id)),
                pos_max=int(self._seq_pos_max(memory, seq_id)),
            )
            key = all_tokens[:current_pos].copy()
            key.setflags(write=False)
            index = self._indexes.setdefault(seq_id, RadixIndex())
            previous = index.get(key)
            if previous is not None:
                self._discard(previous)
                index = self._indexes.setdefault(seq_id, RadixIndex())
            entry = _Entry(checkpoint, key)
            index.insert(key, entry)
            self._entries[id(checkpoint)] = entry
            self._current_size += size
            self._debug(
                "HybridCheckpointCache(save): seq %d pos %d native [%d, %d], %d bytes",
                seq_id,
                current_pos,
                checkpoint.pos_min,
                checkpoint.pos_max,
                size,
            )
            self._evict_checkpoints_if_needed()
            return True

    def find_best_checkpoint(self, tokens: Tokens, seq_id: int = 0) -> HybridCheckpoint | None:
        """The registered checkpoint of ``seq_id`` with the longest prefix of ``tokens``, or None.

        A checkpoint at ``pos`` qualifies when its prefix equals ``tokens[:pos]`` (``pos == len(tokens)``
        included). Each checkpoint is stored in its sequence's radix index under its exact prefix tokens,
        so ``longest_prefix`` returns it only after comparing every one of those tokens with the query: an
        exact match, stronger than the spec's hash comparison, which is therefore not recomputed (the
        checkpoint's ``hash_val`` still equals ``_hash_prefix(tokens, pos)``). A different prompt of the same
        length does not match.

        Complexity: O(K) for K query tokens, independent of the number of checkpoints. No llama.cpp call.
        Thread-safe.

        Raises:
            TypeError, ValueError: ``tokens`` is not a valid token sequence.
        """
        query = as_token_array(tokens)
        with self._lock:
            index = self._indexes.get(seq_id) if self.max_checkpoints > 0 and self._ctx is not None else None
            match = index.longest_prefix(query) if index is not None else None
            if match is None:
                self._misses += 1
                return None
            self._hits += 1
            return match.value.checkpoint

    def restore_checkpoint(self, cp: HybridCheckpoint, seq_id: int = 0) -> bool:
        """Restore ``cp`` into sequence ``seq_id``, leaving it as it was when ``cp`` was saved.

        Steps: reject a ``cp`` of another sequence, a closed cache or a ``cp`` object this cache no longer
        holds (identity check: evicted, cleared, replaced or invalidated checkpoints, equal copies), and a
        ``cp`` whose size differs from the state size llama.cpp reports now -- these rejections change
        nothing. Then load the state (``llama_state_seq_set_data_ext``) and remove the sequence's memory from
        ``cp.pos_max + 1`` on: the recurrent part is now at ``cp``, and without the removal the attention
        memory of a hybrid model would still hold the abandoned suffix (decoding would not fail, but the
        logits would be wrong). On success, the checkpoints of ``seq_id`` in every cache of the context whose
        prefix is not a prefix of ``cp``'s are dropped: the memory no longer holds their history. (Under
        complete notification these are exactly the ones with ``pos > cp.pos``; checking the prefix also
        covers checkpoints on another branch.) If the load or the removal fails, every checkpoint of
        ``seq_id`` is dropped, since the native state may have changed.

        Complexity: O(S) for a state of S bytes plus O(N * K) to check the N checkpoints of the sequence
        against ``cp``'s K tokens (vectorised). Thread-safe.

        Returns:
            True if the state was restored and the suffix removed.

        Raises:
            Exception: whatever the native calls raise propagates, after the sequence's checkpoints are
                dropped.
        """
        with self._lock:
            if cp.seq_id != seq_id:
                self._debug(
                    "HybridCheckpointCache(restore): seq %d requested for a seq %d checkpoint", seq_id, cp.seq_id
                )
                return False
            ctx = self._ctx
            entry = self._entries.get(id(cp))
            if ctx is None or entry is None or entry.checkpoint is not cp or cp.pos_max is None:
                self._debug("HybridCheckpointCache(restore): checkpoint not registered (stale or closed)")
                return False
            assert self._get_size_ext is not None and self._set_data_ext is not None
            assert self._get_memory is not None and self._seq_rm is not None
            memory = self._get_memory(ctx)
            if memory is None:
                return False
            size = int(self._get_size_ext(ctx, seq_id, self._flags))
            if size != cp.size or len(cp.data) != cp.size:
                self._debug("HybridCheckpointCache(restore): state size %d, checkpoint %d", size, cp.size)
                return False
            buffer = (ctypes.c_uint8 * size).from_buffer_copy(cp.data)
            try:
                read = int(self._set_data_ext(ctx, buffer, size, seq_id, self._flags))
                removed = read == size and bool(self._seq_rm(memory, seq_id, cp.pos_max + 1, -1))
            except BaseException:
                self._drop_everywhere(seq_id)
                raise
            if not removed:
                self._debug("HybridCheckpointCache(restore): native restore failed, seq %d invalidated", seq_id)
                self._drop_everywhere(seq_id)
                return False
            key = entry.key
            registry.for_each_cache(self._address, lambda cache: cache.drop_diverging(seq_id, key))
            self._debug("HybridCheckpointCache(restore): seq %d back at pos %d (native %d)", seq_id, cp.pos, cp.pos_max)
            return True

    def drop_checkpoints(self, seq_id: int, predicate: Callable[[HybridCheckpoint], bool]) -> None:
        """Drop the checkpoints of sequence ``seq_id`` (every sequence if negative) for which ``predicate``
        is true: what the registry's ``notify_*`` functions do to every cache of the context.

        A dropped checkpoint is never restored again, as an evicted one, but is not counted as an
        eviction. ``predicate`` must not change this cache.

        Complexity: O(N) calls of ``predicate`` for N registered checkpoints. Thread-safe.
        """
        self._invalidate(seq_id, lambda entry: predicate(entry.checkpoint))

    def drop_diverging(self, seq_id: int, tokens: Tokens) -> None:
        """Drop the checkpoints of sequence ``seq_id`` (every sequence if negative) whose prefix is not a
        prefix of ``tokens``: what a restore to ``tokens`` makes of every cache of the context.

        Complexity: O(N x K) for N registered checkpoints of K tokens at most. Thread-safe.
        """
        key = as_token_array(tokens)
        self._invalidate(seq_id, lambda entry: len(entry.key) > len(key)
                         or not np.array_equal(entry.key, key[: len(entry.key)]))

    def drop_device_checkpoints(self, seq_id: int) -> None:
        """In device mode, drop the checkpoints of sequence ``seq_id``: their device slot is about to be
        overwritten (no-op in host mode). O(N). Thread-safe."""
        if self.on_device:
            self._invalidate(seq_id, lambda entry: True)

    def clear(self) -> None:
        """Drop every checkpoint (counters other than entries and bytes are kept). O(1) amortised.

        Device slots stay allocated in the context; llama.cpp owns them.
        """
        with self._lock:
            if not self._entries:
                return
            self._entries.clear()
            self._indexes.clear()
            self._current_size = 0
            self._debug("HybridCheckpointCache(clear): cleared")

    def close(self) -> None:
        """Clear, unregister from the context and drop the context pointer; never frees the context.

        Afterwards saving and restoring return False and lookups return None. Idempotent.
        """
        with self._lock:
            self.clear()
            if self._ctx is not None:
                registry.unregister(self._address, self)
            self._ctx = None
            self._get_size_ext = self._get_data_ext = self._set_data_ext = None
            self._get_memory = self._seq_pos_min = self._seq_pos_max = self._seq_rm = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # a finalizer must not raise (e.g. at interpreter shutdown)
            self.close()

    # ----------------------------------------------------------------------- disabled mapping interface

    def __getitem__(self, key: Sequence[int]) -> NoReturn:
        """Not supported: raises NotImplementedError (use the checkpoint methods)."""
        raise NotImplementedError(_DISABLED_MESSAGE)

    def __setitem__(self, key: Sequence[int], value: Any) -> NoReturn:
        """Not supported: raises NotImplementedError (use the checkpoint methods)."""
        raise NotImplementedError(_DISABLED_MESSAGE)

    def __contains__(self, key: Sequence[int]) -> NoReturn:
        """Not supported: raises NotImplementedError (use the checkpoint methods)."""
        raise NotImplementedError(_DISABLED_MESSAGE)

    # ------------------------------------------------------------------------------------- internals

    def _debug(self, message: str, *args: object) -> None:
        if self.verbose:
            logger.debug(message, *args)

    def _discard(self, entry: _Entry) -> None:
        """Unregister ``entry``. O(K). Caller holds the lock."""
        checkpoint = entry.checkpoint
        del self._entries[id(checkpoint)]
        index = self._indexes[checkpoint.seq_id]
        index.remove(entry.key)
        if not index:
            del self._indexes[checkpoint.seq_id]
        self._current_size = max(self._current_size - checkpoint.size, 0)

    def _evict_checkpoints_if_needed(self) -> None:
        """Drop the oldest checkpoints while over ``max_checkpoints`` or ``max_bytes``. Caller holds the lock."""
        while self._entries and (
            len(self._entries) > self.max_checkpoints
            or (self.max_bytes is not None and self._current_size > self.max_bytes)
        ):
            oldest = next(iter(self._entries.values()))
            self._discard(oldest)
            self._evictions += 1
            self._debug(
                "HybridCheckpointCache(evict): seq %d pos %d, %d bytes",
                oldest.checkpoint.seq_id,
                oldest.checkpoint.pos,
                oldest.checkpoint.size,
            )

    def _invalidate(self, seq_id: int, predicate: Callable[[_Entry], bool]) -> None:
        """Drop the checkpoints of ``seq_id`` (all sequences if negative) matching ``predicate``. O(N)."""
        with self._lock:
            doomed = [
                entry
                for entry in self._entries.values()
                if (seq_id < 0 or entry.checkpoint.seq_id == seq_id) and predicate(entry)
            ]
            for entry in doomed:
                self._discard(entry)
            if doomed:
                self._debug("HybridCheckpointCache(invalidate): dropped %d checkpoint(s)", len(doomed))

    def _drop_everywhere(self, seq_id: int) -> None:
        """Drop every checkpoint of ``seq_id`` in every registered cache of this context, this one included."""
        registry.for_each_cache(self._address, lambda cache: cache.drop_checkpoints(seq_id, lambda checkpoint: True))
