"""llama-cache: reuse computed llama.cpp model state across prompts that share a prefix.

The public API, exported once here:

- Caches with llama-cpp-python's contract (``cache[tokens]`` returns the best stored state or raises
  ``KeyError``): :class:`LlamaRAMCache` (longest common prefix), :class:`LlamaTrieCache` and its
  alias :class:`LlamaCache` (longest stored key that prefixes the query), on the base
  :class:`BaseLlamaCache`; :class:`TrieNode` is the radix tree's node.
- :class:`CacheStats`, the counters every cache's ``stats()`` returns.
- :func:`default_model_path`, the embedded default model.
"""

from llama_cache._model import default_model_path
from llama_cache.caches.base import BaseLlamaCache, CacheStats
from llama_cache.caches.ram import LlamaRAMCache
from llama_cache.caches.trie import LlamaTrieCache
from llama_cache.index import TrieNode

LlamaCache = LlamaTrieCache

__all__ = [
    "BaseLlamaCache",
    "CacheStats",
    "LlamaCache",
    "LlamaRAMCache",
    "LlamaTrieCache",
    "TrieNode",
    "default_model_path",
]
