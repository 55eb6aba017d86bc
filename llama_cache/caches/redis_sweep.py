"""The Redis tier's repair pass: what clients dying mid-store and Redis's own evictions leave behind.

:func:`sweep` is the work of :meth:`llama_cache.caches.redis_tier.LlamaRedisCache.sweep`. It scans
keys (``SCAN``): O(keys of the namespace), to run now and then, not per request. Stateless; raises
redis-py's errors (the cache counts and logs them).
"""

from __future__ import annotations

from typing import Any

from llama_cache.caches import redis_keys
from llama_cache.caches.redis_frames import HEADER_SIZE, frame_namespace, namespace_tag

__all__ = ["sweep"]


def sweep(client: Any, fingerprint: str, grace_seconds: float) -> int:
    """The work of :meth:`LlamaRedisCache.sweep`; raises redis-py's errors."""
    prefix = redis_keys.prefix(fingerprint)
    removed = 0
    members = client.zrange(prefix + "lru", 0, -1)
    linked: dict[bytes, int] = {}
    total = 0
    for member in members:
        key = prefix + "e:" + member.decode()
        chain, size = client.hmget(key, ["chain", "size"])
        ids = [chain[at : at + 32] for at in range(0, len(chain), 32)] if isinstance(chain, bytes) else []
        pipe = client.pipeline(transaction=False)
        for ident in ids:
            pipe.exists(redis_keys.CHUNK_KEY_PREFIX + ident)
        present = pipe.execute() if ids else []
        if not ids or not all(present) or not isinstance(size, bytes) or not size.isdigit():
            client.delete(key)
            client.zrem(prefix + "lru", member)
            removed += 1
            continue
        for ident in ids:
            linked[ident] = linked.get(ident, 0) + 1
        total += int(size)
    info = client.hgetall(prefix + "info")
    sizes: dict[bytes, int] = {}
    for ident, meta in info.items():
        size, _, prev = meta.partition(b":")
        if ident not in linked:
            parent = prev.decode(errors="replace")
            tokens = client.hget(prefix + "t:" + parent, ident) or b""
            for at in range(4, len(tokens) + 1, 4):
                if client.hget(prefix + "p:" + parent, tokens[:at]) == ident:
                    client.hdel(prefix + "p:" + parent, tokens[:at])
            client.hdel(prefix + "info", ident)
            client.hdel(prefix + "t:" + parent, ident)
            client.delete(prefix + "u:" + ident.decode(errors="replace"))
            removed += client.delete(redis_keys.CHUNK_KEY_PREFIX + ident)
        elif size.isdigit():
            sizes[ident] = int(size)
    client.delete(prefix + "refs")
    if linked:
        client.hset(prefix + "refs", mapping={ident: count for ident, count in linked.items()})
    client.set(prefix + "bytes", total + sum(sizes.values()))
    # Chunk keys of this namespace that no registration names (a client died before its script ran).
    for key in client.scan_iter(match=b"llc:c:*", count=1000):
        ident = key[len(redis_keys.CHUNK_KEY_PREFIX) :]
        if ident in linked:
            continue
        if frame_namespace(client.getrange(key, 0, HEADER_SIZE - 1)) != namespace_tag(fingerprint):
            continue
        idle = client.object("idletime", key)
        if isinstance(idle, int) and idle >= grace_seconds:
            removed += client.delete(key)
    return removed
