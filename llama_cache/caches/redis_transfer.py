"""Moving chunk values to and from Redis at the socket's speed: framed in place, read in place.

**Stores** (:func:`set_chunks`): each chunk is framed (:func:`~llama_cache.caches.redis_frames.encode_frame`)
into one buffer reused for the next, right after room for its ``SET`` command's RESP header, which is
written just before it: one ``sendall`` per chunk, no copy by redis-py's command packer, no value held
but the one being sent. Replies are read after the last chunk: one round trip per node. (Framing in a
helper thread, a few chunks ahead, was no faster on two cores: the server takes the other.)

**Lookups** (:func:`fetch`): a node's commands are sent in windows of about a megabyte of replies, each
before the replies of the last are read (the server answers one while the client reads another), and the
replies are read straight from the socket into one preallocated buffer per node; bulk replies come back as memoryviews
of it (redis-py's reply parser would copy each value twice: into its buffer, then into a new ``bytes``).
The buffers are recycled (:data:`REPLY_BUFFERS`): once nothing refers to a state read into one, the
next lookup reads into it without faulting its pages in again.
This needs connections that can read in place
(:class:`~llama_cache.caches.redis_client.InPlaceReads`, which
:func:`~llama_cache.caches.redis_client.connect` makes); any other client (a caller's own) takes
redis-py's pipelines instead, with the same results. A bulk reply longer than the caller's bound,
or anything but a bulk, integer, simple-string or error reply, is a protocol error: the connection is
dropped and the remaining replies of that node are that error (the caller sees misses, never a wrong
value).

**Clusters**: commands are grouped by the node holding their key, every node is sent its commands before
any reply is read, and a node that fails (lost, timing out, refusing) gives its commands' replies as the
exception while the others answer (as :func:`~llama_cache.caches.redis_client.pipelined`). A reply
saying a slot moved refreshes the slot table for the next call.

Stateless; thread-safe as redis-py's connection pools are (each call takes its own connections).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import redis
import redis.cluster

from llama_cache.caches import redis_keys
from llama_cache.caches.redis_client import InPlaceReads, pipelined
from llama_cache.caches.redis_frames import encode_frame, frame_size, layer_stacks
from llama_cache.state.chunks import Piece
from llama_cache.state.kv_layout import KVLayout, KVSegment
from llama_cache.state.recycling import RecyclingPool

__all__ = ["REPLY_BUFFERS", "fetch", "pack", "set_chunks"]

RESP_ROOM = 128  # room for a SET command's RESP header before a chunk in the store buffer
CRLF = np.frombuffer(b"\r\n", dtype=np.uint8)
_LINE = 1024  # the longest reply line (a bulk's length, an error message) read
_READ = 1 << 20  # bytes asked of the socket per read
REPLY_BUFFERS = RecyclingPool(max_buffers=2)
"""The buffers lookups read replies into: a state found keeps views of its buffer while it lives, and
the next lookup reads into it once it is gone, its pages already mapped (into fresh memory, page faults
took most of a 35 MB lookup's time on the project's VM)."""


def pack(*args: bytes | str | int) -> bytes:
    """One command in RESP, ready to send."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


class _Protocol(redis.ResponseError):
    """A reply this reader does not take (too long, or of another type): the connection is dropped."""


def fetch(client: Any, commands: Sequence[tuple[Any, tuple[Any, ...]]], max_bulk: int | Sequence[int],
          on_reply: Callable[[int, Any], None] | None = None) -> list[Any]:
    """The replies to ``commands`` (each ``(its key, its arguments)``), pipelined per node.

    ``max_bulk``: the longest bulk reply taken, for every command or one per command (a command whose
    reply is an integer or nil: 0). Bulk replies are memoryviews into one buffer per node (kept alive
    by them), at most their ``max_bulk`` bytes each; nil replies None, integers int, simple strings bytes, errors (a failing node's
    commands too) the exception. Memory: one buffer per node of about its commands' ``max_bulk``.

    Each node's commands go out in windows of about :data:`WINDOW` bytes of replies, the next window
    sent before the replies of the one before are read: the server answers one window while the
    client reads the last (sent all at once, the first byte came only once the server had copied every
    value into its reply buffers: half the rate on the project's VM, ``benchmarks/redis_tier.py``).
    The nodes of a cluster take turns, so every node is working while one is read.

    ``on_reply(position, reply)``, if given, is called with each reply as soon as its window is read,
    while the server answers the next (a caller's checksums then overlap the transfer). The list
    returned is the truth: a node that fails later makes every reply of it the exception, including
    those already passed to ``on_reply``. An exception from ``on_reply`` propagates (the connections
    with replies unread are dropped).

    Never raises for a failing node (its replies are the exception).

    Raises:
        ValueError: ``max_bulk`` is a sequence of another length than ``commands``.
    """
    replies: list[Any] = [None] * len(commands)
    bounds = [max_bulk] * len(commands) if isinstance(max_bulk, int) else list(max_bulk)
    if len(bounds) != len(commands):
        raise ValueError(f"{len(bounds)} reply bounds for {len(commands)} commands")
    groups: list[tuple[Any, list[int]]] = []  # (connection pool, positions)
    if isinstance(client, redis.cluster.RedisCluster):
        by_node: dict[str, tuple[Any, list[int]]] = {}
        for at, (key, _) in enumerate(commands):
            try:
                node = client.get_node_from_key(key)
            except redis.exceptions.RedisClusterException as error:  # its slot is covered by no node
                replies[at] = error
                continue
            by_node.setdefault(node.name, (client.get_redis_connection(node).connection_pool, []))[1].append(at)
        groups = list(by_node.values())
    elif commands:
        groups = [(client.connection_pool, list(range(len(commands))))]
    if not all(issubclass(pool.connection_class, InPlaceReads) for pool, _ in groups):
        replies = pipelined(client, commands, strict=False)  # a caller's own client
        if on_reply is not None:
            for at, reply in enumerate(replies):
                on_reply(at, reply)
        return replies
    nodes: list[_Node] = []
    try:
        for pool, positions in groups:
            try:
                connection = pool.get_connection()  # (connects, when the pool has no idle connection)
            except (redis.RedisError, OSError) as error:
                for at in positions:
                    replies[at] = error
                continue
            nodes.append(_Node(pool, connection, [(at, commands[at][1], bounds[at]) for at in positions], on_reply))
        for node in nodes:
            node.send_next()
        while any(node.reading for node in nodes):
            for node in nodes:
                if node.reading:
                    node.send_next()
                    node.read_window()
        for node in nodes:
            for at, answer in zip(node.positions, node.answers()):
                replies[at] = answer
    finally:
        for node in nodes:
            if node.reading:  # left by an exception: replies are unread
                node.connection.disconnect()
            node.pool.release(node.connection)
    if isinstance(client, redis.cluster.RedisCluster) and any(
            isinstance(reply, redis.ResponseError) and str(reply).startswith(("MOVED", "ASK")) for reply in replies):
        client.nodes_manager.initialize()
    return replies


WINDOW = 1 << 20
"""Bytes of replies (at their bounds) a node is asked for before the replies of the previous window are
read: measured best from 0.7 to 3 MB for 368 KB values on the project's VM (2x the rate of one window)."""


class _Node:
    """One node's share of a :func:`fetch`: its commands in windows, sent ahead of the reads.

    A failure (sending, reading, a reply refused) fails every command of the node, and its connection
    is dropped. A connection found broken before the first reply's first byte (the server restarted)
    is made again and what was sent so far is sent again, once.
    """

    def __init__(self, pool: Any, connection: Any, commands: list[tuple[int, tuple[Any, ...], int]],
                 on_reply: Callable[[int, Any], None] | None) -> None:
        self.pool, self.connection, self.on_reply = pool, connection, on_reply
        self.positions = [at for at, _, _ in commands]
        self.windows: list[tuple[bytes, list[int]]] = []  # (packed commands, their bounds)
        packed: list[bytes] = []
        window: list[int] = []
        asked = 0
        for _, args, bound in commands:
            packed.append(pack(*args))
            window.append(bound)
            asked += bound
            if asked >= WINDOW:
                self.windows.append((b"".join(packed), window))
                packed, window, asked = [], [], 0
        if window:
            self.windows.append((b"".join(packed), window))
        self.sent = self.read = 0  # windows sent, windows read
        self.failure: Exception | None = None
        self.retried = False
        all_bounds = [bound for _, _, bound in commands]
        self.reader = _Replies(connection, REPLY_BUFFERS.take(sum(all_bounds) + 32 * len(all_bounds) + _LINE),
                               max(all_bounds, default=0))
        self.replies: list[Any] = []

    @property
    def reading(self) -> bool:
        """Whether windows remain to be read (and the node has not failed)."""
        return self.failure is None and self.read < len(self.windows)

    def send_next(self) -> None:
        """Send the next window, if any is left and the node has not failed."""
        if self.failure is None and self.sent < len(self.windows):
            self._send(self.windows[self.sent][0])
            self.sent += 1

    def read_window(self) -> None:
        """Read the replies of the oldest window sent and not read."""
        bounds = self.windows[self.read][1]
        try:
            replies = self.reader.read(bounds)
            self.read += 1
        except _Fresh as broken:
            self.connection.disconnect()
            if self.retried:
                self.failure = broken.error
                return
            self.retried = False
            self._send(b"".join(packed for packed, _ in self.windows[: self.sent]))
        except (redis.RedisError, OSError) as error:
            self.connection.disconnect()
            self.failure = error
        else:
            if self.on_reply is not None:
                for at, reply in zip(self.positions[len(self.replies) :], replies):
                    self.on_reply(at, reply)
            self.replies.extend(replies)

    def answers(self) -> list[Any]:
        """One reply per command, or the failure for each."""
        return [self.failure] * len(self.positions) if self.failure is not None else self.replies

    def _send(self, packed: bytes) -> None:
        try:
            self.connection.send_packed_command([packed], check_health=False)
        except (redis.RedisError, OSError) as error:
            self.connection.disconnect()
            self.failure = error


class _Fresh(Exception):
    """The connection broke before any reply: the commands may be sent again."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class _Replies:
    """Replies parsed in order from a connection's socket, read into one buffer that holds them all.

    Reads run ahead of the replies asked for (into the room of the next ones), so the buffer must hold
    every reply of the connection at its bound, plus 32 bytes a reply for its header and a line.
    """

    def __init__(self, connection: InPlaceReads, buffer: Any, widest: int) -> None:
        self.connection = connection
        self.buffer = buffer
        self.view = memoryview(buffer)
        self.widest = widest
        self.filled = self.position = 0

    def _more(self) -> None:
        if self.filled >= len(self.buffer):
            raise _Protocol("reply longer than expected")
        try:
            self.filled += self.connection.recv_into(
                self.view[self.filled : min(len(self.buffer), self.filled + max(_READ, 2 * self.widest))])
        except redis.ConnectionError as error:
            if self.filled == 0 and not isinstance(error, redis.TimeoutError):
                raise _Fresh(error) from error
            raise

    def read(self, bounds: list[int]) -> list[Any]:
        """One reply per bound (bulk replies at most their bound).

        Raises:
            _Fresh: the connection broke before the first reply's first byte.
            redis.RedisError: it broke later, or a reply was refused (the connection must be dropped).
        """
        view = self.view
        replies: list[Any] = []
        try:
            while len(replies) < len(bounds):
                while True:
                    end = bytes(view[self.position : min(self.filled, self.position + _LINE)]).find(b"\r\n")
                    if end >= 0:
                        break
                    if self.filled - self.position >= _LINE:
                        raise _Protocol("reply line too long")
                    self._more()
                kind, line = view[self.position], bytes(view[self.position + 1 : self.position + end])
                self.position += end + 2
                if kind == ord("$"):
                    length = int(line)
                    if length == -1:
                        replies.append(None)
                        continue
                    if not 0 <= length <= bounds[len(replies)]:
                        raise _Protocol("bulk reply longer than expected")
                    while self.filled < self.position + length + 2:
                        self._more()
                    replies.append(view[self.position : self.position + length])
                    self.position += length + 2
                elif kind == ord(":"):
                    replies.append(int(line))
                elif kind == ord("+"):
                    replies.append(line)
                elif kind == ord("-"):
                    replies.append(redis.ResponseError(line.decode("utf-8", "replace")))
                else:
                    raise _Protocol("unexpected reply type")
        except ValueError as error:  # a length or integer that is not one
            raise _Protocol(f"bad reply: {error}") from None
        return replies


def set_chunks(client: Any, fingerprint: str, layout: KVLayout, segments: Sequence[KVSegment],
               new: Sequence[Piece]) -> dict[bytes, int]:
    """``SET`` the chunks ``new`` (their value size by id), in one round trip per node.

    Memory: one chunk's value, whatever the state's size.

    Raises:
        redis.RedisError, redis.exceptions.RedisClusterException, OSError: a node failed (its
            connection is dropped: replies may be left unread).
    """
    frame = np.empty(RESP_ROOM + frame_size(layout, max(piece.n_tokens for piece in new)) + 2, dtype=np.uint8)
    stacks = [layer_stacks(segment) for segment in segments]
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
            size = len(encode_frame(fingerprint, piece, layout, segments, frame[RESP_ROOM:-2], stacks))
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
