"""LlamaTrieCache (alias LlamaCache): the best entry is the longest stored key that prefixes the query."""

from __future__ import annotations

from llama_cache.caches.memory import IndexedMemoryCache, _Entry
from llama_cache.index import Match, RadixIndex
from llama_cache.tokens import CheckedTokens


class LlamaTrieCache(IndexedMemoryCache):
    """In-memory LRU cache answering with the longest stored key that is a prefix of the query.

    The whole cached key must be a prefix of ``query``; an empty key, if stored, matches every query.
    The trie is a compressed radix tree (:class:`TrieNode`): edges hold token runs, so its memory is a
    few bytes per stored token rather than a Python object per token. Lookups cost O(K) in the query
    length. See :class:`~llama_cache.caches.memory.IndexedMemoryCache` for the byte budget, eviction
    and thread-safety.
    """

    @property
    def finds_keys_extending_the_query(self) -> bool:
        """False: only a key that prefixes the query answers it."""
        return False

    def _match(self, index: RadixIndex[_Entry], query: CheckedTokens) -> Match[_Entry] | None:
        return index.longest_prefix(query)
