"""In-process caches: a radix index for lookups, an LRU list for eviction, refcounted byte accounting.

The RAM and trie caches differ only in which stored key answers a query; everything else (storage,
namespaces, recency, the byte budget, statistics, locking) lives here.

**Namespaces**, as the disk tier has them: a state is filed under its model fingerprint (a
llama-cpp-python state, which has none, under the bound one, or :data:`UNBOUND_NAMESPACE`), one radix
index per namespace, so two models' states under equal keys are two entries, never one replacing the
other. A bound cache (:meth:`IndexedMemoryCache.bind`; ``llama_cache.Llama.set_cache`` binds an unbound
cache to its model) answers from its namespace only; an unbound one from every namespace (the best
match over them, ties to the most recently used). One budget and one LRU list cover all namespaces.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Mapping
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import llama_cpp
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
from llama_cache.state.fingerprint import model_fingerprint
from llama_cache.state.llama_state import RestoreCopy
from llama_cache.state.values import filing_key, holds_same_state
from llama_cache.tokens import CheckedTokens, as_token_array, checked_tokens

logger = logging.getLogger(__name__)

UNBOUND_NAMESPACE = "llama-cpp-python"
"""The namespace of states without a fingerprint stored into an unbound cache (the disk tier's too)."""


class _Entry:
    """One stored state: its namespace and key, the value, the memory blocks charged for it, and when it
    was last used (a tick of the cache's clock, to break ties between namespaces)."""

    __slots__ = ("namespace", "key", "value", "blocks", "used")

    def __init__(self, namespace: str, key: npt.NDArray[np.int32], value: Any, blocks: list[MemoryBlock],
                 used: int) -> None:
        self.namespace = namespace
        self.key = key
        self.value = value
        self.blocks = blocks
        self.used = used


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

    States are filed by model fingerprint (see the module docstring): lookups search the bound
    namespace, or every namespace when unbound (O(K) per namespace).

    Args:
        capacity_bytes: the byte budget (default 2 GiB); a positive int.
        verbose: accepted for compatibility with llama-cpp-python; diagnostics go to the
            ``llama_cache`` logger, never to stdout or stderr.
        fingerprint: answer lookups only from states of this model fingerprint (see :meth:`bind`).

    Raises:
        TypeError, ValueError: a bad capacity or fingerprint.
    """

    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY_BYTES, verbose: bool = False, *,
                 fingerprint: str | None = None) -> None:
        super().__init__(capacity_bytes)
        self.verbose = verbose
        self._namespace = _checked(fingerprint)
        self._indexes: dict[str, RadixIndex[_Entry]] = {}  # namespace -> its keys
        self._clock = 0
        self._lru: OrderedDict[_Entry, None] = OrderedDict()
        self._blocks: dict[Hashable, list[int]] = {}  # identity -> [holders, nbytes]
        self._copies: dict[RestoreCopy, None] = {}  # charged restore copies, oldest charged first
        self._size = 0
        self._hits = self._misses = self._evictions = self._rejected = self._writes = self._store_errors = 0

    @abstractmethod
    def _match(self, index: RadixIndex[_Entry], query: CheckedTokens) -> Match[_Entry] | None:
        """Return the key of ``index`` answering ``query`` (checked once, by the caller) under this cache's
        policy, or None."""

    # ------------------------------------------------------------------------------ namespaces

    @property
    def fingerprint(self) -> str | None:
        """The namespace lookups are answered from, or None for every namespace."""
        return self._namespace

    def bind(self, fingerprint: str | llama_cpp.Llama | None, *, model_info: Mapping[str, str] | None = None) -> None:
        """Answer lookups only from states made by the model with this fingerprint (None: any).

        Stores of llama-cache states are unaffected (a state is filed under its own fingerprint);
        states without one are filed under the bound fingerprint. ``model_info`` is accepted for the
        disk tier's signature and not kept.

        Args:
            fingerprint: a model fingerprint, or a loaded ``llama_cpp.Llama`` (its
                :func:`~llama_cache.state.fingerprint.model_fingerprint`), or None.

        Raises:
            TypeError, ValueError: a bad fingerprint.
        """
        if isinstance(fingerprint, llama_cpp.Llama):
            own = getattr(fingerprint, "fingerprint", None)
            fingerprint = own if isinstance(own, str) and own else model_fingerprint(fingerprint)
        namespace = _checked(fingerprint)
        with self._lock:
            self._namespace = namespace

    def _filed_under(self, value: Any) -> str:
        own = getattr(value, "fingerprint", None)
        if isinstance(own, str) and own:
            return own
        return self._namespace if self._namespace is not None else UNBOUND_NAMESPACE

    def _best(self, query: CheckedTokens, namespace: str | None = None) -> Match[_Entry] | None:
        """The answer to ``query`` from ``namespace`` (None: the bound one), or the best over all when
        neither is set (ties: most recently used). Lock held."""
        namespace = namespace if namespace is not None else self._namespace
        if namespace is not None:
            index = self._indexes.get(namespace)
            return None if index is None else self._match(index, query)
        matches = [match for index in self._indexes.values() if (match := self._match(index, query)) is not None]
        return max(matches, key=lambda match: (match.common, match.value.used), default=None)

    def _exact(self, tokens: npt.NDArray[np.int32]) -> list[_Entry]:
        """The entries stored under exactly ``tokens`` in the bound namespace (in all when unbound)."""
        namespaces = list(self._indexes) if self._namespace is None else [self._namespace]
        return [entry for name in namespaces if name in self._indexes
                and (entry := self._indexes[name].get(tokens)) is not None]

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

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
        return self.lookup_prefix(key)

    def lookup_prefix(self, key: Sequence[int], *, namespace: str | None = None) -> Any:
        """As ``cache[key]`` (whole states: they are in memory), from ``namespace`` when given (see
        :meth:`BaseLlamaCache.lookup_prefix`)."""
        query = checked_tokens(key)
        with self._lock:
            match = self._best(query, namespace)
            if match is None:
                self._misses += 1
                raise KeyError("no cached prefix for this key")
            self._hits += 1
            entry = match.value
            entry.used = self._tick()
            self._lru.move_to_end(entry)
            self._indexes[entry.namespace].touch_match(match)
            return entry.value

    def __contains__(self, key: Sequence[int]) -> bool:  # type: ignore[override]
        """Whether ``cache[key]`` would return a state; changes neither recency nor counters."""
        query = checked_tokens(key)
        with self._lock:
            return self._best(query) is not None

    def match_length(self, key: Sequence[int], *, namespace: str | None = None) -> int:
        """Leading tokens of ``key`` shared with the key of the entry ``lookup_prefix(key, namespace=...)``
        would return; 0 on a miss (or when only a stored empty key answers). O(K) in the key's length,
        one radix lookup; changes neither recency nor counters.

        Raises:
            TypeError, ValueError: ``key`` is not a sequence of token ids.
        """
        query = checked_tokens(key)
        with self._lock:
            match = self._best(query, namespace)
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
        Least recently used entries are evicted until the budget holds. A restore copy the value is only
        offered (:meth:`~llama_cache.state.llama_state.LlamaState.adopt_restore_copy`: what
        ``Llama.save_state`` hands over) is adopted first, and charged like one it holds. A value that reports no size is
        not stored either: logged and counted in ``stats().store_errors``, never raised, so a completion
        storing its state never fails because of the cache.

        Raises:
            TypeError, ValueError: ``key`` is not a sequence of token ids.
        """
        tokens = filing_key(as_token_array(key), value).copy()
        tokens.setflags(write=False)
        adopt = getattr(value, "adopt_restore_copy", None)
        if callable(adopt):
            adopt()  # a restore copy the state is only offered: kept, and charged, from now on
        try:
            blocks = memory_blocks(value)
        except (TypeError, ValueError) as error:
            with self._lock:
                self._store_errors += 1
            logger.warning("not caching a %s: %s", type(value).__name__, error)
            return
        with self._lock:
            namespace = self._filed_under(value)
            index = self._indexes.get(namespace)
            previous = None if index is None else index.get(tokens)
            if previous is not None and holds_same_state(previous.value, value):
                previous.used = self._tick()
                self._lru.move_to_end(previous)
                self._indexes[namespace].touch(tokens)
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
            entry = _Entry(namespace, tokens, value, blocks, self._tick())
            self._charge(blocks)
            self._indexes.setdefault(namespace, RadixIndex()).insert(tokens, entry)
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
        """The state stored under exactly ``key`` (in the bound namespace; when unbound, the most
        recently used of the namespaces'), or None; changes neither recency nor counters."""
        tokens = as_token_array(key)
        with self._lock:
            found = self._exact(tokens)
            return max(found, key=lambda entry: entry.used).value if found else None

    def __delitem__(self, key: Sequence[int]) -> None:
        """Remove the states stored under exactly ``key`` (in the bound namespace, or in all).

        Raises:
            KeyError: nothing is stored under exactly ``key``.
        """
        tokens = as_token_array(key)
        with self._lock:
            found = self._exact(tokens)
            if not found:
                raise KeyError("no state stored under exactly this key")
            for entry in found:
                self._drop(entry)

    def keys(self) -> Iterator[tuple[int, ...]]:
        """Stored keys of the bound namespace (all when unbound), least recently used first (a snapshot)."""
        with self._lock:
            snapshot = [tuple(entry.key.tolist()) for entry in self._lru
                        if self._namespace in (None, entry.namespace)]
        return iter(snapshot)

    def clear(self) -> None:
        """Remove every entry (all namespaces). Counters other than the entry and byte counts are kept."""
        with self._lock:
            self._indexes.clear()
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
            return sum(index.nbytes() for index in self._indexes.values()) + sum(entry.key.nbytes for entry in self._lru)

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
        index = self._indexes[entry.namespace]
        index.remove(entry.key)
        if not len(index):
            del self._indexes[entry.namespace]
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


def _checked(fingerprint: object) -> str | None:
    """``fingerprint`` if it is None or a non-empty str.

    Raises:
        TypeError: another type.
        ValueError: an empty str.
    """
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise TypeError(f"fingerprint must be a str or None, got {type(fingerprint).__name__}")
    if fingerprint == "":
        raise ValueError("fingerprint must not be empty")
    return fingerprint
