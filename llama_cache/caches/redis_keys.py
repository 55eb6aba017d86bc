"""The Redis tier's key names: where each part of a namespace lives.

``ns`` is a 16-hex digest of the model fingerprint, so namespaces never mix::

    llc:c:<chunk id hex>               a chunk: its framed bytes (:mod:`llama_cache.caches.redis_frames`)
    llc:{ns}:t:<prev id hex>           hash: chunk id hex -> tokens, of the chunks stored after ``prev``
    llc:{ns}:p:<prev id hex>           hash: every prefix of those tokens -> the chunk id holding it
    llc:{ns}:e:<key digest hex>        hash: head (tokens, logits, seed, layout), chain (ids), size
    llc:{ns}:lru                       sorted set of entry digests by last use
    llc:{ns}:refs / llc:{ns}:info      hashes: chunk id -> links; chunk id -> "size:prev"
    llc:{ns}:u:<chunk id hex>          set: the entries whose chain ends on this partial chunk
    llc:{ns}:w:<prev id hex>           an in-flight marker: the tokens of a chunk being stored after ``prev``
    llc:{ns}:bytes, llc:{ns}:clock     unique bytes held; the LRU clock
    llc:{ns}:meta                      hash: layout, chunk_tokens, seed of the namespace

Chunk keys carry no hash tag, so in a Redis Cluster they spread over every node by id; the keys of a
namespace's metadata share the tag ``{ns}`` and live on one node, where a Lua script updates them
atomically (:mod:`llama_cache.caches.redis_scripts`).

Pure functions of their arguments; O(1) but :func:`digest` (O(len(tokens))).
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import numpy.typing as npt

__all__ = ["CHUNK_KEY_PREFIX", "chunk_key", "children_key", "digest", "entry_key", "marker_key", "meta_key", "ns",
           "prefix", "prefixes_key"]

CHUNK_KEY_PREFIX = b"llc:c:"


@functools.lru_cache(maxsize=64)
def ns(fingerprint: str) -> str:
    """The namespace tag of a model fingerprint: 16 hex digits."""
    return hashlib.blake2b(fingerprint.encode(), digest_size=8).hexdigest()


def prefix(fingerprint: str) -> str:
    """What every metadata key of the namespace starts with (its hash tag included)."""
    return f"llc:{{{ns(fingerprint)}}}:"


def meta_key(fingerprint: str, name: str) -> str:
    """A namespace-wide key: ``lru``, ``refs``, ``info``, ``bytes``, ``clock`` or ``meta``."""
    return prefix(fingerprint) + name


def chunk_key(ident: bytes) -> bytes:
    """The key of a chunk's value (shared by every namespace: the id binds the namespace)."""
    return CHUNK_KEY_PREFIX + ident.hex().encode()


def prefixes_key(fingerprint: str, prev: bytes) -> str:
    """The hash naming, for each prefix of the tokens of ``prev``'s children, the child holding it."""
    return prefix(fingerprint) + "p:" + prev.hex()


def children_key(fingerprint: str, prev: bytes) -> str:
    """The hash of ``prev``'s children: chunk id hex -> tokens."""
    return prefix(fingerprint) + "t:" + prev.hex()


def marker_key(fingerprint: str, prev: bytes) -> str:
    """The in-flight marker of a chunk being stored after ``prev`` (its value: that chunk's tokens)."""
    return prefix(fingerprint) + "w:" + prev.hex()


def digest(tokens: npt.NDArray[np.int32]) -> bytes:
    """The 16-byte digest naming the entry stored under exactly ``tokens``."""
    return hashlib.blake2b(np.ascontiguousarray(tokens, dtype="<i4").tobytes(), digest_size=16).digest()


def entry_key(fingerprint: str, tokens: npt.NDArray[np.int32]) -> str:
    """The key of the entry stored under exactly ``tokens``."""
    return prefix(fingerprint) + "e:" + digest(tokens).hex()
