"""The cache contract shared by every tier, and the byte accounting behind it.

Every cache maps token sequences to saved model states. A lookup returns the state of the best stored
key for the query (what "best" means is the tier's policy), or raises :class:`KeyError`. Capacity is a
number of bytes: values are charged for the memory they really own (see :func:`memory_blocks`).
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp.llama_cache as _upstream

DEFAULT_CAPACITY_BYTES = 2 << 30

MemoryBlock = tuple[Hashable, int]
"""One block of memory a value owns: an identity (blocks shared by several values are charged once) and
its size in bytes."""


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
    """

    hits: int
    misses: int
    entries: int
    bytes: int
    capacity_bytes: int
    evictions: int
    rejected: int


def memory_blocks(value: Any) -> list[MemoryBlock]:
    """Return the memory blocks ``value`` owns, for byte accounting.

    - A value with a ``memory_blocks()`` method (llama-cache's own states) says which blocks it holds,
      so blocks shared between states are charged once.
    - llama-cpp-python's ``LlamaState`` is charged for everything it holds: its ``input_ids`` and
      ``scores`` arrays as well as the llama.cpp bytes. Its ``llama_state_size`` counts only the last,
      about a quarter of the real memory for the default model.
    - Any other value with ``nbytes`` is charged that; legacy objects fall back to ``llama_state_size``.

    Raises:
        TypeError: the value reports no size at all.
    """
    method = getattr(value, "memory_blocks", None)
    if callable(method):
        return list(method())
    if isinstance(value, _upstream.llama_cpp.llama.LlamaState):
        owned = int(value.input_ids.nbytes) + int(value.scores.nbytes) + len(value.llama_state)
        return [(id(value), owned)]
    for attribute in ("nbytes", "llama_state_size"):
        size = getattr(value, attribute, None)
        if isinstance(size, int) and not isinstance(size, bool):
            if size < 0:
                raise ValueError(f"{type(value).__name__}.{attribute} is negative: {size}")
            return [(id(value), size)]
    raise TypeError(
        f"cannot size a {type(value).__name__}: a cached state needs an `nbytes` or "
        "`llama_state_size` attribute"
    )


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

    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY_BYTES) -> None:
        super().__init__(check_capacity(capacity_bytes))
        self._lock = threading.RLock()

    @property
    @abstractmethod
    def cache_size(self) -> int:
        """Bytes currently charged to the cache."""

    @abstractmethod
    def __getitem__(self, key: Sequence[int]) -> Any: ...

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
