"""Moving chunk values to and from Redis: pipelined ``SET``s framed in one reused buffer.

Stateless; thread-safe as redis-py's connection pools are (each call takes its own connections).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import redis
import redis.cluster

from llama_cache.caches import redis_keys
from llama_cache.state.chunks import Piece, chunk_size, encode_chunk
from llama_cache.state.kv_layout import KVLayout, KVSegment

__all__ = ["set_chunks"]

FRAME_SLACK = 64 << 10  # room for a chunk's prefix and header in the reused store buffer
RESP_ROOM = 128  # room for a SET command's RESP header before a chunk in that buffer
CRLF = np.frombuffer(b"\r\n", dtype=np.uint8)


def set_chunks(client: Any, fingerprint: str, layout: KVLayout, segments: Sequence[KVSegment],
                new: Sequence[Piece]) -> dict[bytes, int]:
    """``SET`` the chunks ``new`` (their encoded size by id), in one round trip per node.

    Each chunk is encoded into one buffer reused for the next, framed there as a RESP ``SET`` command
    and written to its node's socket at once, in one write (redis-py's own packing copies every value
    into a new bytes object first, and the chunks of a whole state would all be held at once); the
    replies are read after the last. Memory: one chunk, whatever the state's size.

    Raises:
        redis.RedisError, redis.exceptions.RedisClusterException, OSError: a node failed (its
            connection is dropped: replies may be left unread).
    """
    frame = np.empty(RESP_ROOM + chunk_size(layout, max(piece.n_tokens for piece in new)) + FRAME_SLACK, dtype=np.uint8)
    sizes: dict[bytes, int] = {}
    sent: dict[int, tuple[Any, Any, list[int]]] = {}  # pool id -> (pool, connection, [commands sent])
    try:
        for piece in new:
            key = redis_keys.chunk_key(piece.id)
            pool = (client.get_redis_connection(client.get_node_from_key(key)) if isinstance(client, redis.cluster.RedisCluster)
                    else client).connection_pool
            if id(pool) not in sent:
                sent[id(pool)] = (pool, pool.get_connection(), [0])
            _, connection, count = sent[id(pool)]
            # The value is encoded after room for the command's RESP header, which is then written
            # right before it, and the closing CRLF after it: one buffer, one write per chunk.
            size = encode_chunk(fingerprint, piece, layout, segments, into=frame[RESP_ROOM:-2])[0].nbytes
            command = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, size)
            start, end = RESP_ROOM - len(command), RESP_ROOM + size
            frame[start:RESP_ROOM] = np.frombuffer(command, dtype=np.uint8)
            frame[end : end + 2] = CRLF
            connection.send_packed_command([memoryview(frame)[start : end + 2]], check_health=False)
            count[0] += 1
            sizes[piece.id] = size
        for _, connection, count in sent.values():
            for _ in range(count[0]):
                connection.read_response()
    except BaseException:
        for _, connection, _ in sent.values():
            connection.disconnect()
        raise
    finally:
        for pool, connection, _ in sent.values():
            pool.release(connection)
    return sizes
