"""In-process caches: a radix index for lookups, an LRU list for eviction, refcounted byte accounting.

The RAM and trie caches differ only in which stored key answers a query; everything else (storage,
recency, the byte budget, statistics, locking) lives here.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from llama_cache.caches.base import (
    DEFAULT_CAPACITY_BYTES,
    BaseLlamaCache,
    CacheStats,
    MemoryBlock,
    memory_blocks,
)
from llama_cache.index import Match, RadixIndex
from llama_cache.state.llama_state import RestoreCopy
from llama_cache.state.values import filing_key, holds_same_state
from llama_cache.tokens import as_token_array

logger = logging.getLogger(__name__)


class _Entry:
    """One stored state: its key, the value, and the memory blocks charged for it."""

    __slots__ = ("key", "value", "blocks")

    def __init__(self, key: npt.NDArray[np.int32], value: Any, blocks: list[MemoryBlock]) -> None:
        self.key = key
        self.value = value
        self.blocks = blocks


class IndexedMemoryCache(BaseLlamaCache):
    """An in-memory state cache with O(K) lookups and LRU eviction by bytes.

    Lookup cost is linear in the query length and independent of the number of entries (a
    :class:`~llama_cache.index.RadixIndex`). Eviction drops least recently used entries until the
    charged bytes fit ``capacity_bytes``. Memory blocks shared by several stored states (llama-cache's
    own states share the KV of their common prefix) are charged once, when the first holder is stored,
    and released when the last one leaves. Restore copies (:class:`~llama_cache.state.llama_state.RestoreCopy`,
    bytes kept beside a state only to restore it faster) are charged too, and released, oldest charged
    first, before any entry is evicted: they never cost an entry its place.

    Values are stored by reference, never copied: the caller must not mutate a state after storing it.
    All methods are thread-safe (one re-entrant lock per cache).

    Args:
        capacity_bytes: the byte budget (default 2 GiB); a positive int.
        verbose: accepted for compatibility with llama-cpp-python; diagnostics go to the
            ``llama_cache`` logger, never to stdout or stderr.
    """

    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY_BYTES, verbose: bool = False) -> None:
        super().__init__(capacity_bytes)
        self.verbose = verbose
        self._index: RadixIndex[_Entry] = RadixIndex()
        self._lru: OrderedDict[_Entry, None] = OrderedDict()
        self._blocks: dict[Hashable, list[int]] = {}  # identity -> [holders, nbytes]
        self._copies: dict[RestoreCopy, None] = {}  # charged restore copies, oldest charged first
        self._size = 0
        self._hits = self._misses = self._evictions = self._rejected = self._writes = self._store_errors = 0

    @abstractmethod
    def _match(self, query: npt.NDArray[np.int32]) -> Match[_Entry] | None:
        """Return the stored key answering ``query`` under this cache's policy, or None."""

    @property
    def cache_size(self) -> int:
        """Bytes charged now: each distinct memory block of the stored states counted once."""
        return self._size

    def __len__(self) -> int:
        return len(self._lru)

    def __getitem__(self, key: Sequence[int]) -> Any:
        """Return the state stored for the best key for ``key`` and mark it most recently used.

        Raises:
            KeyError: no stored key answers ``key``.
            TypeError, ValueError: ``key`` is not a sequence of token ids.
        """
        query = as_token_array(key)
        with self._lock:
            match = self._match(query)
            if match is None:
                self._misses += 1
                raise KeyError("no cached prefix for this key")
            self._hits += 1
            entry = match.value
            self._lru.move_to_end(entry)
            self._index.touch_match(match)
            return entry.value

    def __contains__(self, key: Sequence[int]) -> bool:  # type: ignore[override]
        """Whether ``cache[key]`` would return a state; changes neither recency nor counters."""
        query = as_token_array(key)
        with self._lock:
            return self._match(query) is not None

    def match_length(self, key: Sequence[int]) -> int:
        """Leading tokens of ``key`` shared with the key of the entry ``cache[key]`` would return; 0 on
        a miss (or when only a stored empty key answers). O(K) in the key's length, one radix lookup;
        changes neither recency nor counters.

        Raises:
            TypeError, ValueError: ``key`` is not a sequence of token ids.
        """
        query = as_token_array(key)
        with self._lock:
            match = self._match(query)
            return 0 if match is None else match.common

    def __setitem__(self, key: Sequence[int], value: Any) -> None:
        """Store ``value``, replacing any state stored under the same key.

        The value is filed under :func:`~llama_cache.state.values.filing_key`: the tokens it really
        holds when those are a proper prefix of ``key`` (llama-cpp-python stores a one-token
        completion's state, which holds only the prompt, under prompt + completion). When the cache
        already holds an equal state under that key (same tokens, logits if the new one has them), the
        store only marks it most recently used: nothing is rewritten (``stats().writes`` counts real
        writes).

        A value larger than the whole budget is not stored (and any state it would replace is
        dropped), so that after ``cache[key] = value`` the key maps to ``value`` or to nothing.
        Least recently used entries are evicted until the budget holds. A value that reports no size is
        not stored either: logged and counted in ``stats().store_errors``, never raised, so a completion
        storing its state never fails because of the cache.

        Raises:
            TypeError, ValueError: ``key`` is not a sequence of token ids.
        """
        tokens = filing_key(as_token_array(key), value).copy()
        tokens.setflags(write=False)
        try:
            blocks = memory_blocks(value)
        except (TypeError, ValueError) as error:
            with self._lock:
                self._store_errors += 1
            logger.warning("not caching a %s: %s", type(value).__name__, error)
            return
        with self._lock:
            previous = self._index.get(tokens)
            if previous is not None and holds_same_state(previous.value, value):
                self._lru.move_to_end(previous)
                self._index.touch(tokens)
                return
            if previous is not None:
                self._drop(previous)
            total = sum(size for _, size in blocks)
            if total > self.capacity_bytes:
                # Its restore copy would be the first thing released: store the state without it.
                for identity, _ in blocks:
                    if isinstance(identity, RestoreCopy):
                        self._release(identity)
                blocks = [(identity, size) for identity, size in blocks if not isinstance(identity, RestoreCopy)]
                total = sum(size for _, size in blocks)
            if total > self.capacity_bytes:
                self._rejected += 1
                logger.info(
                    "not caching a %d-byte state: larger than the whole capacity (%d bytes)",
                    total,
                    self.capacity_bytes,
                )
                return
            entry = _Entry(tokens, value, blocks)
            self._charge(blocks)
            self._index.insert(tokens, entry)
            self._lru[entry] = None
            self._writes += 1
            while self._size > self.capacity_bytes:
                if self._copies:
                    self._release(next(iter(self._copies)))
                    continue
                victim = next(iter(self._lru))
                self._drop(victim)
                self._evictions += 1

    def peek(self, key: Sequence[int]) -> Any | None:
        """The state stored under exactly ``key``, or None; changes neither recency nor counters."""
        tokens = as_token_array(key)
        with self._lock:
            entry = self._index.get(tokens)
            return None if entry is None else entry.value

    def __delitem__(self, key: Sequence[int]) -> None:
        """Remove the state stored under exactly ``key``.

        Raises:
            KeyError: nothing is stored under exactly ``key``.
        """
        tokens = as_token_array(key)
        with self._lock:
            entry = self._index.get(tokens)
            if entry is None:
                raise KeyError("no state stored under exactly this key")
            self._drop(entry)

    def keys(self) -> Iterator[tuple[int, ...]]:
        """Stored keys, least recently used first (a snapshot)."""
        with self._lock:
            snapshot = [tuple(entry.key.tolist()) for entry in self._lru]
        return iter(snapshot)

    def clear(self) -> None:
        """Remove every entry. Counters other than the entry and byte counts are kept."""
        with self._lock:
            self._index.clear()
            self._lru.clear()
            self._blocks.clear()
            self._copies.clear()
            self._size = 0

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                hits=self._hits,
                misses=self._misses,
                entries=len(self._lru),
                bytes=self._size,
                capacity_bytes=self.capacity_bytes,
                evictions=self._evictions,
                rejected=self._rejected,
                writes=self._writes,
                store_errors=self._store_errors,
            )

    def index_nbytes(self) -> int:
        """Memory held by the lookup structures (radix index and stored keys), not by the states."""
        with self._lock:
            return self._index.nbytes() + sum(entry.key.nbytes for entry in self._lru)

    def _charge(self, blocks: list[MemoryBlock]) -> None:
        for identity, size in blocks:
            holders = self._blocks.get(identity)
            if holders is None:
                self._blocks[identity] = [1, size]
                self._size += size
                if isinstance(identity, RestoreCopy):
                    self._copies[identity] = None
            else:
                holders[0] += 1

    def _drop(self, entry: _Entry) -> None:
        self._index.remove(entry.key)
        del self._lru[entry]
        for identity, _ in entry.blocks:
            holders = self._blocks[identity]
            holders[0] -= 1
            if holders[0] == 0:
                del self._blocks[identity]
                self._size -= holders[1]
                if isinstance(identity, RestoreCopy):
                    self._copies.pop(identity, None)

    def _release(self, copy: RestoreCopy) -> None:
        """Release a restore copy and stop charging it (its holders keep their place, at 0 bytes).

        A copy some other cache released already is uncharged here too.
        """
        copy.release()
        self._copies.pop(copy, None)
        holders = self._blocks.get(copy)
        if holders is not None:
            self._size -= holders[1]
            holders[1] = 0
