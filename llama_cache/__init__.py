r"""llama-cache: reuse computed llama.cpp model state across prompts that share a prefix.

The public API, exported once here:

- Caches with llama-cpp-python's contract (``cache[tokens]`` returns the best stored state or raises
  ``KeyError``): :class:`LlamaRAMCache` (longest common prefix), :class:`LlamaTrieCache` and its
  alias :class:`LlamaCache` (longest stored key that prefixes the query), on the base
  :class:`BaseLlamaCache`; :class:`TrieNode` is the radix tree's node. :class:`LlamaDiskCache` keeps
  states on disk: persistent, crash-safe, shared by processes, namespaced by model;
  :class:`CacheDirectoryError` when a directory cannot hold one. :class:`LlamaRedisCache` shares
  states between processes and machines through Redis, as content-addressed KV chunks; it is imported on
  first access, so ``import llama_cache`` does not load redis-py.
  :class:`TieredCache` stacks caches fastest first: lookups read through and promote, stores reach
  the slower tiers in the background.
- :class:`Llama`, a ``llama_cpp.Llama`` whose prompt cache stores compact :class:`LlamaState`\ s,
  reuses partial prefixes and serves exact repeats without a decode; :class:`IncompatibleStateError`
  when a state belongs to another model.
- :class:`Engine`, one model serving many requests at once: one llama.cpp context, its sequences
  batched step by step, prompts' shared heads held once; :meth:`Engine.submit` returns an
  :class:`EngineRequest` to stream or wait for.
- :class:`HybridCheckpoint` and :class:`HybridCheckpointCache`: sequence-state checkpoints for recurrent
  and hybrid models, whose memory cannot be cut back.
- :class:`CacheStats`, the counters every cache's ``stats()`` returns.
- :func:`default_model_path`, the embedded default model.
"""

import logging
from typing import TYPE_CHECKING, Any

from llama_cache._model import default_model_path
from llama_cache.caches.base import BaseLlamaCache, CacheStats
from llama_cache.caches.disk import CacheDirectoryError, LlamaDiskCache
from llama_cache.caches.ram import LlamaRAMCache
from llama_cache.caches.tiered import TieredCache
from llama_cache.caches.trie import LlamaTrieCache
from llama_cache.checkpoints import HybridCheckpoint, HybridCheckpointCache
from llama_cache.engine.engine import Engine
from llama_cache.engine.requests import EngineRequest
from llama_cache.index import TrieNode
from llama_cache.llama import Llama
from llama_cache.state.llama_state import IncompatibleStateError, LlamaState

if TYPE_CHECKING:
    from llama_cache.caches.redis_tier import LlamaRedisCache

LlamaCache = LlamaTrieCache

# The library never prints: without this, an application that configured no logging would get our
# warnings on stderr through logging's last-resort handler.
logging.getLogger(__name__).addHandler(logging.NullHandler())


def __getattr__(name: str) -> Any:
    # The Redis tier loads redis-py and hiredis (a C extension): only programs that use it pay for them.
    if name == "LlamaRedisCache":
        from llama_cache.caches.redis_tier import LlamaRedisCache

        return LlamaRedisCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

__all__ = [
    "BaseLlamaCache",
    "CacheDirectoryError",
    "CacheStats",
    "Engine",
    "EngineRequest",
    "HybridCheckpoint",
    "HybridCheckpointCache",
    "IncompatibleStateError",
    "Llama",
    "LlamaCache",
    "LlamaDiskCache",
    "LlamaRAMCache",
    "LlamaRedisCache",
    "LlamaState",
    "LlamaTrieCache",
    "TieredCache",
    "TrieNode",
    "default_model_path",
]
