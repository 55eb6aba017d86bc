"""The cache contract shared by every tier, and the byte accounting behind it.

Every cache maps token sequences to saved model states. A lookup returns the state of the best stored
key for the query (what "best" means is the tier's policy), or raises :class:`KeyError`. Capacity is a
number of bytes: values are charged for the memory they really own (see
:func:`llama_cache.state.memory.memory_blocks`).
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import llama_cpp.llama_cache as _upstream

from llama_cache.state.memory import MemoryBlock, memory_blocks
from llama_cache.tokens import as_token_array

__all__ = [
    "DEFAULT_CAPACITY_BYTES",
    "BaseLlamaCache",
    "CacheStats",
    "MemoryBlock",
    "check_capacity",
    "memory_blocks",
]

DEFAULT_CAPACITY_BYTES = 2 << 30


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot of a cache's counters.

    Attributes:
        hits: lookups through ``cache[key]`` that returned a state.
        misses: lookups through ``cache[key]`` that raised :class:`KeyError`.
        entries: keys stored now.
        bytes: bytes charged now (``cache_size``).
        capacity_bytes: the byte budget.
        evictions: entries dropped to stay within the budget.
        rejected: values never stored because they alone exceed the budget.
        writes: states actually written (a store of a key already held with the same tokens is not
            written again).
        store_errors: states that could not be stored (wrong kind, I/O error); logged, never raised.
        round_trips: network round trips made (shared tiers; 0 for local ones).
        lookup_errors: lookups a tier failed with an error, answered as misses (a tiered cache's).
        dropped: states a tiered cache's background writer dropped from its full queue, never
            reaching the slower tiers.
        index_resets: damaged indexes a persistent tier moved aside and started again empty (the disk
            tier's; logged at WARNING).
        tiers: a tiered cache's tiers' own statistics, fastest first (empty for a single cache).
    """

    hits: int
    misses: int
    entries: int
    bytes: int
    capacity_bytes: int
    evictions: int
    rejected: int
    writes: int = 0
    store_errors: int = 0
    round_trips: int = 0
    lookup_errors: int = 0
    dropped: int = 0
    index_resets: int = 0
    tiers: tuple[CacheStats, ...] = ()


def check_capacity(capacity_bytes: object) -> int:
    """Validate a byte budget: a positive int.

    Raises:
        TypeError: not an int (bools are refused).
        ValueError: zero or negative.
    """
    if not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool):
        raise TypeError(f"capacity_bytes must be an int, got {type(capacity_bytes).__name__}")
    if capacity_bytes <= 0:
        raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
    return capacity_bytes


class BaseLlamaCache(_upstream.BaseLlamaCache):
    """Abstract base of llama-cache's caches: a mapping from token sequences to model states.

    It subclasses llama-cpp-python's ``BaseLlamaCache``, so ``llama_cpp.Llama(cache=...)`` and
    ``Llama.set_cache`` accept every cache of this package.

    Contract for subclasses: ``cache[key]`` returns the best state for ``key`` or raises ``KeyError``;
    ``key in cache`` answers the same question without changing recency; ``cache[key] = state``
    stores, replacing any state under the same key, and never lets ``cache_size`` exceed
    ``capacity_bytes``. All methods are thread-safe.

    Args:
        capacity_bytes: the byte budget (default 2 GiB).
    """

    usable_as_tier: ClassVar[bool] = True
    """Whether a :class:`~llama_cache.caches.tiered.TieredCache` may stack this cache as one of its tiers:
    True for prompt caches, which keep the contract above. A subclass that does not (its mapping
    interface raises, as :class:`~llama_cache.checkpoints.HybridCheckpointCache`'s) sets it False."""

    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY_BYTES) -> None:
        super().__init__(check_capacity(capacity_bytes))
        self._lock = threading.RLock()

    @property
    def finds_keys_extending_the_query(self) -> bool:
        """Whether a lookup may answer with an entry whose key runs past the query (the longest common
        prefix), so that the state of a prompt and its answer also serves that prompt asked again.

        True for this package's longest-common-prefix caches; :class:`~llama_cache.caches.trie.LlamaTrieCache`
        answers only with keys that prefix the query. ``llama_cache.Llama`` caches a prompt's own state
        beside prompt + answer only where this is False, or once the prompt is asked again.
        """
        return True

    @property
    @abstractmethod
    def cache_size(self) -> int:
        """Bytes currently charged to the cache."""

    @abstractmethod
    def __getitem__(self, key: Sequence[int]) -> Any: ...

    def lookup_prefix(self, key: Sequence[int], *, namespace: str | None = None) -> Any:
        """Like ``cache[key]``, but the state may hold only the prefix ``key`` shares with the entry.

        For callers that restore only the shared prefix anyway (``llama_cache.Llama`` does): a tier
        that can read less than a whole entry (the disk tier reads only the chunks up to the
        divergence) overrides this. By default, ``cache[key]``.

        ``namespace``: answer from the states filed under this fingerprint only (see
        :func:`~llama_cache.state.fingerprint.namespaced_fingerprint`: a tenant's), whatever the cache is
        bound to; None: as ``cache[key]`` (the bound namespace). A cache that cannot tell namespaces
        apart (this default) answers only for its own bound one, and misses for any other.

        Raises:
            KeyError: as ``cache[key]``.
        """
        if namespace is not None and namespace != getattr(self, "fingerprint", None):
            as_token_array(key)
            raise KeyError("this cache holds no states of that namespace")
        return self[key]

    def match_length(self, key: Sequence[int], *, namespace: str | None = None) -> int:
        """How many leading tokens of ``key`` the state ``lookup_prefix(key, namespace=namespace)`` would
        restore; 0 on a miss.

        Asked without loading anything and without changing recency or counters, so that a tiered cache
        can pick the tier holding the longest prefix before reading from any. This default answers 0,
        meaning "unknown", for caches that cannot tell without a lookup: it never claims more than a
        lookup would restore, and a caller must still try ``lookup_prefix`` on a cache answering 0 (a
        stored empty key, or an unknown answer). Caches with an index override it.

        Complexity: the default is O(K) for checking ``key``; overrides should stay O(K) in its length.

        Raises:
            TypeError, ValueError: ``key`` is not a sequence of token ids.
        """
        as_token_array(key)
        return 0

    @abstractmethod
    def __contains__(self, key: Sequence[int]) -> bool:  # type: ignore[override]
        ...

    @abstractmethod
    def __setitem__(self, key: Sequence[int], value: Any) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def stats(self) -> CacheStats:
        """Return a snapshot of the cache's counters."""

    def __bool__(self) -> bool:
        # llama-cpp-python tests `if self.cache:` before using a cache. With __len__ defined an empty
        # cache would be falsy and never receive its first state.
        return True
