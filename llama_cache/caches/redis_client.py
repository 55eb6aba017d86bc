"""The Redis client side of the shared tier: URLs (several nodes, credentials, TLS), the client made
from one, and pipelines that keep going when one cluster node is lost.

:func:`connect` makes a redis-py client from a URL; a URL naming several ``host:port`` nodes gives a
cluster client whose every node gets the URL's credentials, scheme and options. :func:`pipelined` runs
single-key commands in one round trip per node: on a cluster each node is sent its own commands, so a
lost node fails only its own (within one socket timeout) instead of the whole call.
(:mod:`llama_cache.caches.redis_urls` keeps passwords out of log lines and ``repr``.) The
connections :func:`connect` makes (:class:`ChunkConnection`, :class:`ChunkSSLConnection`) can also hand
their socket's bytes to a reader that parses replies in place (:mod:`llama_cache.caches.redis_transfer`).

Thread-safety: the functions keep no state; redis-py's clients are thread-safe.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.retry import Retry

__all__ = ["ChunkConnection", "ChunkSSLConnection", "InPlaceReads", "connect", "pipelined"]


class InPlaceReads:
    """Raw reads from a redis-py connection's socket, for replies no parser has seen.

    Only call :meth:`recv_into` after sending commands on a connection with no reply pending: the
    bytes go to the caller, not to the connection's parser.
    """

    def recv_into(self, buffer: memoryview) -> int:
        """Read at least one byte into ``buffer``; the count.

        Raises:
            redis.TimeoutError: nothing within the socket timeout.
            redis.ConnectionError: the connection is closed or broken.
        """
        sock = self._sock  # type: ignore[attr-defined]  # this connection's own socket (redis-py's attribute)
        if sock is None:
            raise redis.ConnectionError("not connected")
        try:
            count = int(sock.recv_into(buffer))
        except socket.timeout as error:
            raise redis.TimeoutError("timeout reading from the socket") from error
        except OSError as error:
            raise redis.ConnectionError(f"error reading from the socket: {error}") from error
        if count == 0:
            raise redis.ConnectionError("connection closed by the server")
        return count


class ChunkConnection(InPlaceReads, redis.Connection):
    """A redis-py TCP connection whose replies can also be read in place (:func:`llama_cache.caches.redis_transfer.fetch`)."""


class ChunkSSLConnection(InPlaceReads, redis.SSLConnection):
    """A redis-py TLS connection whose replies can also be read in place (:func:`llama_cache.caches.redis_transfer.fetch`)."""


def pipelined(client: Any, commands: Sequence[tuple[Any, tuple[Any, ...]]], *, strict: bool = True) -> list[Any]:
    """The replies to ``commands`` (each ``(its key, its arguments)``), in one round trip per node.

    On a cluster each node is sent its own commands in one pipeline of its own (not redis-py's cluster
    pipeline, which retries a failing node's commands one by one and rebuilds its slot table: seconds
    for a node that stopped answering). A node that fails (lost, timing out, refusing) gives its
    commands' replies as the exception, at the cost of one ``timeout`` at most; a reply that says a slot
    moved refreshes the slot table for the next call. ``strict``: raise the first failure instead.

    Raises:
        redis.RedisError, redis.exceptions.RedisClusterException, OSError: a failure (one server; or
            with ``strict``).
    """
    if not isinstance(client, redis.cluster.RedisCluster):
        pipe = client.pipeline(transaction=False)
        for _, args in commands:
            pipe.execute_command(*args)
        return list(pipe.execute())
    replies: list[Any] = [None] * len(commands)
    by_node: dict[str, tuple[Any, list[int]]] = {}
    for at, (key, _) in enumerate(commands):
        try:
            node = client.get_node_from_key(key)
        except redis.exceptions.RedisClusterException as error:  # its slot is covered by no node
            replies[at] = error
            continue
        by_node.setdefault(node.name, (node, []))[1].append(at)
    for node, positions in by_node.values():
        pipe = client.get_redis_connection(node).pipeline(transaction=False)
        for at in positions:
            pipe.execute_command(*commands[at][1])
        try:
            answers = pipe.execute(raise_on_error=False)
        except (redis.RedisError, OSError) as error:
            answers = [error] * len(positions)
        for at, answer in zip(positions, answers):
            replies[at] = answer
    if any(isinstance(reply, (redis.exceptions.MovedError, redis.exceptions.AskError)) for reply in replies):
        client.nodes_manager.initialize()
    failure = next((reply for reply in replies if isinstance(reply, Exception)), None)
    if strict and failure is not None:
        raise failure
    return replies


def connect(url: str, timeout: float, cluster: bool) -> Any:
    """A redis-py client for ``url`` with every call bounded by ``timeout``.

    A URL naming several nodes (``redis[s]://[[user]:password@]host:port,host:port,.../0?options``) or
    ``cluster=True`` gives a cluster client: the credentials, the scheme (TLS for ``rediss``) and the
    query's options apply to every node. A call whose connection turns out broken (the server
    restarted) is retried once on a new connection; a call that times out is not retried.

    Raises:
        redis.RedisError, redis.exceptions.RedisClusterException: the URL is refused, or (cluster) no
            startup node could be reached.
    """
    retry = Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,))
    options: dict[str, Any] = dict(socket_timeout=timeout, socket_connect_timeout=timeout, retry=retry)
    scheme = url.partition("://")[0].lower()
    if scheme in ("redis", "rediss"):  # (a unix:// URL keeps redis-py's socket connection)
        options["connection_class"] = ChunkSSLConnection if scheme == "rediss" else ChunkConnection
    first, others = _split_nodes(url)
    if cluster or others:
        startup = [redis.cluster.ClusterNode(*_host_port(node)) for node in others]
        return redis.cluster.RedisCluster(url=first, startup_nodes=startup, **options)
    return redis.Redis.from_url(url, **options)


def _split_nodes(url: str) -> tuple[str, list[str]]:
    """``url`` naming its first node only, and the other ``host:port`` nodes it names.

    ``rediss://u:p@h1:1,h2:2/0?x=y`` gives ``rediss://u:p@h1:1/0?x=y`` and ``["h2:2"]``. Everything up
    to the last ``@`` is user information (as :func:`~llama_cache.caches.redis_urls.redact_url` reads it).
    """
    scheme, separator, rest = url.partition("://")
    if not separator:
        return url, []
    userinfo, at, location = rest.rpartition("@")
    end = min((at_ for at_ in (location.find("/"), location.find("?")) if at_ >= 0), default=len(location))
    nodes, tail = location[:end].split(","), location[end:]
    return f"{scheme}://{userinfo}{at}{nodes[0]}{tail}", [node for node in nodes[1:] if node]


def _host_port(node: str) -> tuple[str, int]:
    host, _, port = node.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port or 6379)
