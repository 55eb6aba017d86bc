"""LlamaRAMCache: the best entry is the one sharing the longest common prefix with the query."""

from __future__ import annotations

from llama_cache.caches.memory import IndexedMemoryCache, _Entry
from llama_cache.index import Match, RadixIndex
from llama_cache.state.values import can_be_cut
from llama_cache.tokens import CheckedTokens


class LlamaRAMCache(IndexedMemoryCache):
    """In-memory LRU cache answering with the longest non-empty common prefix.

    ``cache[query]`` returns the state of the stored key sharing the most leading tokens with
    ``query``, even when that key diverges from the query afterwards or runs past its end (a caller
    able to cut state back, as :class:`llama_cache.Llama` does for transformer KV, reuses the common
    part). Ties go to the most recently used key. The state comes back untruncated. States that cannot
    be cut back (recurrent and hybrid memory) answer only queries their whole key prefixes: when the
    longest-common-prefix entry is such a state, the longest stored key prefixing the query answers.

    Lookups cost O(K) in the query length whatever the number of entries (llama-cpp-python's cache
    scans every key: O(N * K)). See :class:`~llama_cache.caches.memory.IndexedMemoryCache` for the
    byte budget, eviction and thread-safety.
    """

    def _match(self, index: RadixIndex[_Entry], query: CheckedTokens) -> Match[_Entry] | None:
        match = index.longest_common_prefix(query)
        if match is None or match.common == len(match.value.key) or can_be_cut(match.value.value):
            return match
        # The best entry diverges from the query (or runs past it) and its state cannot be cut back
        # (recurrent memory): only a stored key that prefixes the query is usable then.
        prefix = index.longest_prefix(query)
        return prefix if prefix is not None and prefix.common > 0 else None
