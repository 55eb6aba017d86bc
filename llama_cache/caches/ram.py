"""LlamaRAMCache: the best entry is the one sharing the longest common prefix with the query."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from llama_cache.caches.memory import IndexedMemoryCache, _Entry
from llama_cache.index import Match


class LlamaRAMCache(IndexedMemoryCache):
    """In-memory LRU cache answering with the longest non-empty common prefix.

    ``cache[query]`` returns the state of the stored key sharing the most leading tokens with
    ``query``, even when that key diverges from the query afterwards or runs past its end (a caller
    able to cut state back, as :class:`llama_cache.Llama` does for transformer KV, reuses the common
    part). Ties go to the most recently used key. The state comes back untruncated.

    Lookups cost O(K) in the query length whatever the number of entries (llama-cpp-python's cache
    scans every key: O(N * K)). See :class:`~llama_cache.caches.memory.IndexedMemoryCache` for the
    byte budget, eviction and thread-safety.
    """

    def _match(self, query: npt.NDArray[np.int32]) -> Match[_Entry] | None:
        return self._index.longest_common_prefix(query)
