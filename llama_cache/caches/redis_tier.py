"""LlamaRedisCache: a prompt cache shared by processes and machines through a Redis server or cluster.

It stores transformer states as the content-addressed chunks of :mod:`llama_cache.state.chunks`: equal
prefixes of any two states are the same chunks, so a system prompt used by a thousand conversations on
ten machines is stored once.

**Keys**: one per chunk, spread over a cluster's nodes by id, and the namespace's metadata on one node
(:mod:`llama_cache.caches.redis_keys`), updated atomically by Lua scripts
(:mod:`llama_cache.caches.redis_scripts`); chunk values travel through
:mod:`llama_cache.caches.redis_transfer`, and :mod:`llama_cache.caches.redis_sweep` repairs what dying
clients leave.

**A lookup is two pipelined round trips**, whatever the number of entries: the first asks the metadata
node for the children of every chunk on the query's path (the query's full-chunk ids are computed
locally from its tokens) and for an entry stored under exactly the query; the longest chain of known
chunks plus the child sharing most of the query's next tokens is the best prefix. The second fetches
those chunks (from every node that holds some: one round trip per node in a cluster), read in place
from the socket (:mod:`llama_cache.caches.redis_transfer`). The first also reads the in-flight markers
of the query's chunks: a store announced by another process (:meth:`LlamaRedisCache.announce`) that
would make the hit longer is waited for, for at most ``in_flight_seconds``. Each chunk is
checked (checksum, id recomputed from its tokens, position, layout) before use: a chunk missing
(evicted by Redis itself, or freed meanwhile) or damaged makes a shorter hit or a miss, never a
wrong state. ``stats().round_trips`` counts round trips.

**Stores** write the chunks the metadata does not know yet (pipelined ``SET``, each chunk framed as its
command in one reused buffer), then run one script that links the entry to its chain, counts
references, absorbs partial tails (a chunk extending a partial chunk after the same predecessor takes
over the entries ending on it, as the disk tier does: a growing conversation keeps one tail per branch)
and evicts least recently used entries until the unique bytes fit ``capacity_bytes``, freeing chunks
with their last reference; the client then deletes the freed chunks' keys. A client dying between those steps leaves orphan chunks (or, rarely, a chunk
freed by one client just as another relinked it: a shorter hit); :meth:`LlamaRedisCache.sweep` collects
both. Redis may also evict keys on its own (``maxmemory`` with an LRU policy): lookups then see shorter
chains or misses, and ``sweep`` repairs the accounting.

**Failures** (Redis down, slow, restarting, out of memory, refusing authentication): every call is
bounded by ``timeout`` seconds; a failing lookup is a miss and a failing store is skipped, each logged
once per outage (at WARNING) and counted in ``stats().store_errors`` and :attr:`errors`; redis-py
reconnects by itself on the next call. Nothing raises out of a lookup or a store. ``rediss://`` URLs,
passwords and usernames pass through to redis-py, for every node of a multi-node URL too; the password
never reaches a log line or ``repr`` (:func:`~llama_cache.caches.redis_urls.redact_url`, and redis-py's error messages are scrubbed of
it before they are logged). A cluster client is made on first use, not in the constructor. URLs, the
client and per-node pipelines live in :mod:`llama_cache.caches.redis_client`.

**A lost cluster node** (killed, or not answering): each node is asked for its own keys, so the chunks it
held are misses (a shorter hit) while the other nodes answer, each lookup waiting at most ``timeout``
for it; when it held the namespace's metadata, lookups are misses. Stores that need it are skipped.
The servers must run with ``cluster-require-full-coverage no``, or they refuse every command once the
cluster marks a node failed.

What it stores: llama-cache states of transformer models (with a KV layout). Other values (recurrent
states, llama-cpp-python's own states) are not stored here (counted in ``store_errors``, logged once);
put a disk tier beside it in a :class:`~llama_cache.caches.tiered.TieredCache` for those.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import llama_cpp
import numpy as np
import numpy.typing as npt
import redis
import redis.cluster

from llama_cache.caches import redis_keys
from llama_cache.caches import redis_sweep, redis_transfer
from llama_cache.caches.base import DEFAULT_CAPACITY_BYTES, BaseLlamaCache, CacheStats
from llama_cache.caches.redis_client import connect, pipelined
from llama_cache.caches.redis_urls import redact_url, url_secrets
from llama_cache.caches.redis_frames import decode_frame, frame_size
from llama_cache.caches.redis_scripts import STORE_SCRIPT, TOUCH_SCRIPT
from llama_cache.state.chunks import (
    ID_BYTES,
    Head,
    assemble,
    chain_ids,
    decode_head,
    default_chunk_tokens,
    encode_head,
    layout_from_json,
    layout_to_json,
    pieces,
)
from llama_cache.state.fingerprint import model_fingerprint
from llama_cache.state.format import CorruptStateError
from llama_cache.state.kv_layout import KVLayout, KVSegment
from llama_cache.state.llama_state import LlamaState
from llama_cache.tokens import as_token_array

__all__ = ["LlamaRedisCache"]

logger = logging.getLogger("llama_cache.caches.redis")

_MAX_TOKENS = 1 << 24
_LONGEST_CHUNK = 4096  # tokens: the bound on chunk_tokens
_MAX_ANNOUNCED = 4096  # this process's pending announcements kept before the expired are dropped
_POLL_SECONDS = 0.005  # how often a lookup waiting for an announced store asks again

class LlamaRedisCache(BaseLlamaCache):
    """A prompt cache in Redis, shared by every process and machine that reaches the server.

    ``cache[query]`` returns the state of the longest prefix of ``query`` whose KV the tier holds, as
    chunks of any stored entries (it may end inside an entry: chunk-granular), with the logits row
    when an entry is stored under exactly ``query``; it raises ``KeyError`` when no chunk of the
    query's first positions is held. ``lookup_prefix`` is the same. Two pipelined round trips per
    lookup (see the module docstring). Such a hit makes the entry stored under exactly the query the
    most recently used; chunks shared with other entries live as long as any of them. Thread-safe.

    Capacity is the unique bytes held (chunk and head values, each once): least recently used entries
    are evicted until a store fits, chunks freed with their last entry. Redis's own ``maxmemory``
    may evict more; see :meth:`sweep`.

    Args:
        url: ``redis://[[user]:password@]host:port/db`` or ``rediss://...``; several comma-separated
            ``host:port`` pairs or ``cluster=True`` for a Redis Cluster.
        capacity_bytes: the byte budget of this cache's namespace.
        fingerprint: the model namespace lookups answer from (None: bound by
            ``llama_cache.Llama.set_cache``, or by the first state stored).
        chunk_tokens: tokens per chunk (None: :func:`~llama_cache.state.chunks.default_chunk_tokens`).
            Every process sharing a namespace should use the same value.
        timeout: seconds (finite, > 0) any Redis call may take, connecting included.
        cluster: use redis-py's cluster client (also chosen by a URL naming several nodes).
        verify: check each chunk's checksum when read (default).
        client: an existing ``redis.Redis`` or ``redis.cluster.RedisCluster`` to use instead of ``url``.
        in_flight_seconds: how long an announced store's markers live, and so the longest a lookup
            waits for one (:meth:`announce`; 0: lookups never wait).

    Raises:
        TypeError, ValueError: a bad argument (nothing is contacted before the first call).
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
        *,
        fingerprint: str | None = None,
        chunk_tokens: int | None = None,
        timeout: float = 1.0,
        cluster: bool = False,
        verify: bool = True,
        client: Any = None,
        in_flight_seconds: float = 2.0,
    ) -> None:
        super().__init__(capacity_bytes)
        if (isinstance(in_flight_seconds, bool) or not isinstance(in_flight_seconds, (int, float))
                or not math.isfinite(in_flight_seconds) or in_flight_seconds < 0):
            raise ValueError(f"in_flight_seconds must be a finite number >= 0, got {in_flight_seconds!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(f"timeout must be a finite positive number of seconds, got {timeout!r}")
        if chunk_tokens is not None and (
            not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or not 0 < chunk_tokens <= 4096
        ):
            raise ValueError(f"chunk_tokens must be an int in 1..4096 or None, got {chunk_tokens!r}")
        if fingerprint is not None and (not isinstance(fingerprint, str) or not fingerprint):
            raise TypeError("fingerprint must be a non-empty str or None")
        if not isinstance(url, str):
            raise TypeError(f"url must be a str, got {type(url).__name__}")
        self.url = url
        self._secrets = url_secrets(url)
        self.timeout = float(timeout)
        self.chunk_tokens = chunk_tokens
        self.verify = bool(verify)
        self.in_flight_seconds = float(in_flight_seconds)
        self._fingerprint = fingerprint
        self._cluster = bool(cluster)
        self._connected: Any = client  # built on first use: a cluster client contacts its nodes at once
        self._script: Any = None
        self._hits = self._misses = self._evictions = self._rejected = 0
        self._writes = self._store_errors = self._round_trips = 0
        self.errors = 0
        """Calls that failed (Redis unreachable, slow, refusing, out of memory, damaged values)."""
        self.waits = 0
        """Lookups that waited for an announced store (:meth:`announce`)."""
        self._failing: str | None = None  # the kind of failure logged for the current outage
        self._node_lost = False  # a cluster node failed the last fetch while others answered
        self._unstorable_logged = False
        self._layouts: dict[str, tuple[KVLayout, int, int]] = {}  # ns -> (layout, chunk_tokens, seed)
        self._announced: dict[str, float] = {}  # marker key -> when this process's announcement expires

    # ------------------------------------------------------------------------------ namespaces

    @property
    def fingerprint(self) -> str | None:
        return self._fingerprint

    def bind(self, fingerprint: str | llama_cpp.Llama | None, *, model_info: Mapping[str, str] | None = None) -> None:
        """Answer lookups from the namespace of this fingerprint (or of this loaded model)."""
        if isinstance(fingerprint, llama_cpp.Llama):
            own = getattr(fingerprint, "fingerprint", None)
            fingerprint = own if isinstance(own, str) and own else model_fingerprint(fingerprint)
        if fingerprint is not None and (not isinstance(fingerprint, str) or not fingerprint):
            raise TypeError("fingerprint must be a non-empty str, a llama_cpp.Llama or None")
        self._fingerprint = fingerprint

    # ------------------------------------------------------------------------------- the mapping

    @property
    def cache_size(self) -> int:
        """Unique bytes held in the bound namespace (0 when unbound or unreachable)."""
        if self._fingerprint is None:
            return 0
        fingerprint = self._fingerprint
        return _as_count(self._call("size", lambda: self._client.get(redis_keys.meta_key(fingerprint, "bytes"))))

    def __len__(self) -> int:
        if self._fingerprint is None:
            return 0
        count = self._call("len", lambda: self._client.zcard(redis_keys.meta_key(self._fingerprint, "lru")))
        return int(count) if isinstance(count, int) else 0

    def __contains__(self, key: Sequence[int]) -> bool:  # type: ignore[override]
        return self.match_length(key) > 0

    def match_length(self, key: Sequence[int], *, namespace: str | None = None) -> int:
        """Tokens of ``key`` a lookup would restore (0 on a miss), from metadata alone (one round trip).
        ``namespace``: that fingerprint's states (None: the bound one)."""
        query = as_token_array(key)
        plan = self._find(query, namespace or self._fingerprint)
        return 0 if plan is None else plan.length

    def __getitem__(self, key: Sequence[int]) -> Any:
        return self.lookup_prefix(key)

    def lookup_prefix(self, key: Sequence[int], *, namespace: str | None = None) -> Any:
        """As ``cache[key]`` (this tier always answers with the shared prefix only), from the states of
        ``namespace`` when given (see :meth:`BaseLlamaCache.lookup_prefix`)."""
        query = as_token_array(key)
        state = self._lookup(query, namespace or self._fingerprint)
        with self._lock:
            if state is None:
                self._misses += 1
            else:
                self._hits += 1
        if state is None:
            raise KeyError("no cached prefix for this key")
        return state

    def __setitem__(self, key: Sequence[int], value: Any) -> None:
        """Store a llama-cache transformer state under ``key`` (its tokens, in its model's namespace).

        Never raises for the value or for Redis: failures are logged and counted.

        Raises:
            TypeError, ValueError: ``key`` is not a sequence of token ids.
        """
        tokens = as_token_array(key)
        if not isinstance(value, LlamaState) or value.layout is None or not value.fingerprint:
            with self._lock:
                self._store_errors += 1
                first, self._unstorable_logged = not self._unstorable_logged, True
            if first:
                logger.warning("redis cache: only llama-cache transformer states are stored; not a %s", type(value).__name__)
            return
        held = np.asarray(value.tokens)
        shared = min(len(held), len(tokens))
        if not len(held) or not np.array_equal(held[:shared], tokens[:shared]):
            # The entry is filed under the tokens the state holds, which must agree with the key.
            with self._lock:
                self._store_errors += 1
            logger.warning("redis cache: the state does not hold the tokens of its key; not stored")
            return
        try:
            self._store(value)
        finally:
            self._landed(value.fingerprint, held)

    def touch(self, keys: Sequence[Sequence[int]], *, namespace: str | None = None) -> None:
        """Make the entries stored under exactly ``keys`` (in ``namespace``, else the bound namespace) the
        most recently used, those still held; one round trip for all. For a faster tier's hits
        (:class:`~llama_cache.caches.tiered.TieredCache`). Never raises for Redis failures.

        Raises:
            TypeError, ValueError: a key is not a sequence of token ids.
        """
        fingerprint = namespace or self._fingerprint
        members = [redis_keys.digest(as_token_array(key)).hex() for key in keys]
        if fingerprint is None or not members:
            return
        lru, clock = redis_keys.meta_key(fingerprint, "lru"), redis_keys.meta_key(fingerprint, "clock")
        self._call("touch", lambda: pipelined(self._client, [
            (lru, ("EVAL", TOUCH_SCRIPT, 2, lru, clock, member)) for member in members
        ]))

    def announce(self, key: Sequence[int], *, namespace: str | None = None) -> None:
        """Say that the state of ``key`` (in ``namespace``, else the bound one) is about to be stored.

        Sets one short-lived marker per chunk of ``key`` (the chunk's tokens under its predecessor's
        id, living ``in_flight_seconds``), in one round trip. Until the store lands (its script
        deletes them) or they expire, a lookup or ``match_length`` in any process that would find a
        longer prefix once it lands waits for it, polling, for at most ``in_flight_seconds``: a
        writer may answer its caller first and store afterwards (write-behind,
        :class:`~llama_cache.caches.tiered.TieredCache` with ``write_through``) while the next request
        on another instance still finds the state. A marker whose writer died expires and the lookup
        proceeds without it. Lookups in this process do not wait for its own announced stores (a
        faster tier in front, or the caller, holds those states). Two writers announcing different chunks after the same one at once keep
        the last marker (the other's readers do not wait: a shorter hit). A namespace this process
        has neither looked up nor stored in costs one more round trip (its chunk length).
        Never raises for Redis failures (counted in ``errors``).

        Raises:
            TypeError, ValueError: ``key`` is not a sequence of token ids.
        """
        tokens = as_token_array(key)
        fingerprint = namespace or self._fingerprint
        if fingerprint is None or not len(tokens) or len(tokens) > _MAX_TOKENS or self.in_flight_seconds <= 0:
            return
        known = self._layouts.get(fingerprint)
        if known is None and self.chunk_tokens is None:
            record = self._call("announce", lambda: self._client.hmget(redis_keys.meta_key(fingerprint, "meta"),
                                                                       ["layout", "chunk_tokens", "seed"]))
            known = self._namespace_info(record) if record is not None else None
            if known is None:
                return  # no namespace yet (or unreachable): nothing another process could find
            self._layouts[fingerprint] = known
        chunk_tokens = self.chunk_tokens or (known[1] if known is not None else 0)
        lifetime = max(1, round(1000 * self.in_flight_seconds))
        commands: list[tuple[Any, tuple[Any, ...]]] = []
        for piece in pieces(fingerprint, tokens, chunk_tokens):
            marker = redis_keys.marker_key(fingerprint, piece.prev)
            commands.append((marker, ("SET", marker, piece.tokens.astype("<i4").tobytes(), "PX", lifetime)))
        expires = time.monotonic() + self.in_flight_seconds
        with self._lock:
            if len(self._announced) > _MAX_ANNOUNCED:  # announcements whose store never came
                now = time.monotonic()
                self._announced = {marker: until for marker, until in self._announced.items() if until > now}
            for marker, _ in commands:
                self._announced[marker] = expires
        self._call("announce", lambda: pipelined(self._client, commands))

    def _landed(self, fingerprint: str, tokens: npt.NDArray[np.int32]) -> None:
        """Forget this process's announcements of the chunks of ``tokens`` (its store is done)."""
        with self._lock:
            if not self._announced:
                return
            size = self.chunk_tokens or (self._layouts[fingerprint][1] if fingerprint in self._layouts else 0)
            if not size:
                return
            for piece in pieces(fingerprint, np.asarray(tokens, dtype=np.int32), size):
                self._announced.pop(redis_keys.marker_key(fingerprint, piece.prev), None)

    def stats(self) -> CacheStats:
        """This instance's counters; the namespace's entries and bytes (one round trip, counted)."""
        entries = size = 0
        fingerprint = self._fingerprint
        if fingerprint is not None:
            def run() -> list[Any]:
                pipe = self._client.pipeline(transaction=False)
                pipe.zcard(redis_keys.meta_key(fingerprint, "lru"))
                pipe.get(redis_keys.meta_key(fingerprint, "bytes"))
                return pipe.execute()

            reply = self._call("stats", run)
            if reply is not None:
                entries, size = int(reply[0]), _as_count(reply[1])
        with self._lock:
            return CacheStats(
                hits=self._hits, misses=self._misses, entries=entries, bytes=size, capacity_bytes=self.capacity_bytes,
                evictions=self._evictions, rejected=self._rejected, writes=self._writes,
                store_errors=self._store_errors, round_trips=self._round_trips,
            )

    def clear(self) -> None:
        """Remove every entry and chunk of the bound namespace (others are untouched)."""
        if self._fingerprint is None:
            return
        ns = redis_keys.ns(self._fingerprint)
        pattern = f"llc:{{{ns}}}:*"

        def run() -> None:
            chunks = [key for key, _ in self._client.hscan_iter(redis_keys.meta_key(self._fingerprint, "refs"))]
            keys = list(self._client.scan_iter(match=pattern, count=1000))
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.delete(key)
            for ident in chunks:
                pipe.delete(redis_keys.CHUNK_KEY_PREFIX + ident)
            pipe.execute()

        self._call("clear", run)

    def close(self) -> None:
        """Close the connections (the cache stays usable: redis-py reconnects)."""
        if self._connected is None:
            return
        try:
            self._connected.close()
        except (redis.RedisError, redis.exceptions.RedisClusterException, OSError):
            pass

    # -------------------------------------------------------------------------------- lookups

    def _find(self, query: npt.NDArray[np.int32], fingerprint: str | None) -> _Plan | None:
        """The longest prefix of ``query`` the namespace's metadata knows chunks for, once no announced
        store that would make it longer is in flight (or after ``in_flight_seconds`` of waiting)."""
        deadline = None
        while True:
            plan, in_flight = self._find_once(query, fingerprint)
            if not in_flight or self.in_flight_seconds <= 0:
                return plan
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.in_flight_seconds
                with self._lock:
                    self.waits += 1
            elif now >= deadline:
                logger.info("redis cache: an announced store did not land within %.1f s; answering without it",
                            self.in_flight_seconds)
                return plan
            time.sleep(min(_POLL_SECONDS, max(0.0, deadline - now)))

    def _find_once(self, query: npt.NDArray[np.int32], fingerprint: str | None) -> tuple[_Plan | None, bool]:
        """The longest prefix of ``query`` the namespace's metadata knows chunks for, and whether an
        announced store of a longer one is in flight.

        One round trip asks, for each of the query's full chunks, whether its id is stored (one field
        of its predecessor's prefix index), and which child of the last one shares most of the
        query's remaining tokens (one field per remaining token); a second is needed only when the
        chain breaks earlier, to ask the same of the chunk where it breaks (and to read that chunk's
        marker again: when it changed, a store landed between the trips and the lookup asks once
        more rather than answer a torn view's shorter hit). The cost of each is the
        query's length, whatever the number of entries or of children. The first also reads the
        in-flight markers (:meth:`announce`) of every chunk on the query's path, in one ``MGET``,
        before anything else: the namespace's keys live on one node, which runs a pipeline's commands
        in order, so a store's script lands either after the markers were read (the lookup waits and
        polls again) or before everything was read (a whole view, never a torn, shorter one).
        """
        if fingerprint is None or not len(query):
            return None, False
        known = self._layouts.get(fingerprint)
        size = self.chunk_tokens or (known[1] if known is not None else None)
        ids = chain_ids(fingerprint, query, size) if size else []
        blob = np.ascontiguousarray(query, dtype="<i4").tobytes()

        meta, entry = redis_keys.meta_key(fingerprint, "meta"), redis_keys.entry_key(fingerprint, query)
        markers = [redis_keys.marker_key(fingerprint, prev) for prev in [b"", *ids]]
        # The markers first (see the docstring): read last, they could be read after a store's
        # script that the chunk reads before it missed, a shorter hit that does not wait.
        commands: list[tuple[Any, tuple[Any, ...]]] = [
            (markers[0], ("MGET", *markers)),
            (meta, ("HMGET", meta, "layout", "chunk_tokens", "seed")), (entry, ("HMGET", entry, "head", "chain")),
        ]
        prev = b""
        for k, ident in enumerate(ids):
            field = redis_keys.prefixes_key(fingerprint, prev)
            commands.append((field, ("HGET", field, blob[4 * k * size : 4 * (k + 1) * size])))
            prev = ident
        commands += _ask_children(fingerprint, prev, blob[4 * len(ids) * (size or 0) :], size)
        reply = self._call("lookup", lambda: pipelined(self._client, commands))
        if reply is None:
            return None, False
        in_flight, meta, exact, *found = reply
        info = self._namespace_info(meta)
        if info is None:  # no namespace yet, though its first store may be in flight
            first = in_flight[0] if isinstance(in_flight, list) and in_flight else None
            return None, _extends(first, query, 0, 0, size or _LONGEST_CHUNK)
        self._layouts[fingerprint] = info
        layout, chunk_tokens, seed = info
        if size != chunk_tokens:
            # The first lookup of this process (the chain length was unknown), or the namespace was
            # recreated meanwhile (Redis restarted): once more with the recorded length.
            return self._find_once(query, fingerprint) if size is None or self.chunk_tokens is None else (None, False)
        present = found[: len(ids)]
        unbroken = next((k for k, ident in enumerate(ids) if present[k] != ident.hex().encode()), len(ids))
        marker = in_flight[unbroken] if isinstance(in_flight, list) and len(in_flight) > unbroken else None
        if self._announced.get(markers[unbroken], 0.0) > time.monotonic():
            # This process's own store: the faster tier it answered from holds that state already.
            marker = None
        torn = False
        if unbroken == len(ids):
            children = found[len(ids)] if len(found) > len(ids) else None
        else:
            prev = ids[unbroken - 1] if unbroken else b""
            rest = blob[4 * unbroken * chunk_tokens :]
            # The marker where the chain broke is read again, first: a store landing between the two
            # round trips would give children from after it beside a chain from before it, a torn,
            # shorter view that no longer sees the marker the store deleted.
            asked = [(markers[unbroken], ("GET", markers[unbroken])),
                     *_ask_children(fingerprint, prev, rest, chunk_tokens)]
            second = self._call("lookup", lambda: pipelined(self._client, asked))
            again, children = second if isinstance(second, list) and len(second) == 2 else (marker, None)
            # Only a marker that shares the query's tokens where the chain broke could make it longer.
            torn = again != marker and _extends(marker, query, unbroken * chunk_tokens, unbroken * chunk_tokens,
                                                chunk_tokens)
        plan = _walk(fingerprint, query, ids[:unbroken], children, chunk_tokens, layout, seed, exact)
        # A torn view is a valid, shorter hit; being in flight, the lookup asks again.
        return plan, torn or _extends(marker, query, unbroken * chunk_tokens, plan.length, chunk_tokens)

    def _lookup(self, query: npt.NDArray[np.int32], fingerprint: str | None) -> LlamaState | None:
        plan = self._find(query, fingerprint)
        if plan is None or plan.length == 0:
            return None
        keys = [redis_keys.chunk_key(ident) for ident, _, _ in plan.chunks]

        commands: list[tuple[Any, tuple[Any, ...]]] = [(key, ("GET", key)) for key in keys]
        if plan.head is not None:  # a hit on an entry stored under exactly the query refreshes it
            lru, clock = (redis_keys.meta_key(plan.fingerprint, name) for name in ("lru", "clock"))
            # A plain EVAL: redis-py refuses EVALSHA (a registered script) and its own eval() in a
            # cluster's pipelines, and a refused call here made every exact hit a miss.
            commands.append((lru, ("EVAL", TOUCH_SCRIPT, 2, lru, clock, redis_keys.digest(query).hex())))

        # Room for each chunk's value; the refresh script answers an integer.
        bounds = [frame_size(plan.layout, plan.chunk_tokens)] * len(keys) + [0] * (len(commands) - len(keys))
        decoded: dict[int, tuple[npt.NDArray[np.int32], KVSegment] | CorruptStateError] = {}

        def decode(at: int, value: Any) -> None:
            # Checked as each window arrives, while Redis sends the next; used only if the reply stays.
            if at < len(keys) and isinstance(value, (bytes, memoryview)):
                ident, prev, start = plan.chunks[at]
                try:
                    decoded[at] = decode_frame(value, namespace=plan.fingerprint, ident=ident, prev=prev, start=start,
                                               layout=plan.layout, verify=self.verify)
                except CorruptStateError as error:
                    decoded[at] = error

        replies = self._call("fetch", lambda: redis_transfer.fetch(self._client, commands, bounds, decode))
        if replies is None:
            return None
        values = replies[: len(keys)]
        self._note_lost_node(next((reply for reply in values if isinstance(reply, Exception)), None))
        segments: list[KVSegment] = []
        covered = 0
        for at, ((ident, _, start), value) in enumerate(zip(plan.chunks, values)):
            if not isinstance(value, (bytes, memoryview)):
                logger.info("redis cache: chunk %s is gone (evicted); a shorter hit", ident.hex())
                break
            if at not in decoded:  # (fetch passes on every value it returns; this keeps the lookup whole regardless)
                decode(at, value)
            frame = decoded[at]
            if isinstance(frame, CorruptStateError):
                self._note_damage(ident, str(frame))
                break
            tokens, segment = frame
            expected = query[start : start + len(tokens)]
            usable = min(len(tokens), plan.length - start)
            if not np.array_equal(tokens[:usable], expected[:usable]):
                self._note_damage(ident, "chunk holds other tokens than the query's")
                break
            segments.append(segment)
            covered = start + usable
        if covered == 0:
            return None
        if 2 * len(segments) < len(values):
            # A hit cut short by a lost or damaged chunk: its chunks move out of the reply buffer, which
            # the state would otherwise keep whole (and which later lookups then cannot reuse).
            segments = [segment.slice_copy(0, plan.layout) for segment in segments]
        head = plan.head if covered == plan.length else None
        source = Head(plan.fingerprint, plan.seed, np.array(query[:covered], dtype=np.int32),
                      head.logits if head is not None else None, plan.chunk_tokens, plan.layout)
        return assemble(source, segments, covered)

    def _note_lost_node(self, error: Exception | None) -> None:
        """Count and log (once per outage) a cluster node failing while the others answered (``error``),
        or note that every node answered (None)."""
        with self._lock:
            was_lost, self._node_lost = self._node_lost, error is not None
            if error is not None:
                self.errors += 1
        if error is not None and not was_lost:
            logger.warning("redis cache: a cluster node failed (%s: %s); its chunks are misses until it answers again",
                           type(error).__name__, self._scrub(str(error)))
        elif error is None and was_lost:
            logger.warning("redis cache: every cluster node answers again")

    def _note_damage(self, ident: bytes, reason: str) -> None:
        with self._lock:
            self.errors += 1
        logger.warning("redis cache: chunk %s is damaged (%s); a shorter hit", ident.hex(), reason)

    @staticmethod
    def _namespace_info(meta: Any) -> tuple[KVLayout, int, int] | None:
        """The namespace record (layout, chunk length, seed), validated; None if absent or damaged."""
        try:
            layout_json, chunk_tokens, seed = meta
            if layout_json is None:
                return None
            layout = _parse_layout(layout_json)
            info = (layout, int(chunk_tokens), int(seed))
        except (ValueError, TypeError, CorruptStateError) as error:
            logger.warning("redis cache: damaged namespace record (%s); a miss", error)
            return None
        if not 0 < info[1] <= 4096:
            return None
        return info

    # --------------------------------------------------------------------------------- stores

    def _store(self, state: LlamaState) -> None:
        fingerprint = state.fingerprint
        layout = state.layout
        assert layout is not None
        known = self._layouts.get(fingerprint)
        if known is None and self.chunk_tokens is None:
            # Chains must be cut as the namespace's are: read its record once (one round trip).
            record = self._call("store", lambda: self._client.hmget(redis_keys.meta_key(fingerprint, "meta"),
                                                                    ["layout", "chunk_tokens", "seed"]), store=True)
            if record is None:
                return  # Redis is unreachable: the store is skipped (counted once)
            info = self._namespace_info(record)
            if info is not None:
                self._layouts[fingerprint] = known = info
        chunk_tokens = self.chunk_tokens or (known[1] if known is not None else default_chunk_tokens(layout))
        tokens = np.asarray(state.tokens, dtype=np.int32)
        if len(tokens) > _MAX_TOKENS:
            return
        chain = pieces(fingerprint, tokens, chunk_tokens)
        if self._fingerprint is None:
            self._fingerprint = fingerprint

        layout_json = json.dumps(layout_to_json(layout), sort_keys=True)

        meta, prefixes = redis_keys.meta_key(fingerprint, "meta"), redis_keys.prefixes_key(fingerprint, chain[-1].prev)
        asked: list[tuple[Any, tuple[Any, ...]]] = [
            (meta, ("HSETNX", meta, "layout", layout_json)),
            (meta, ("HSETNX", meta, "chunk_tokens", chunk_tokens)),
            (meta, ("HSETNX", meta, "seed", int(state.seed))),
            # The values themselves: Redis may have evicted one that is still linked.
            *((key, ("EXISTS", key)) for key in map(redis_keys.chunk_key, (piece.id for piece in chain))),
            (prefixes, ("HGET", prefixes, chain[-1].tokens.astype("<i4").tobytes())),
            (meta, ("HMGET", meta, "layout", "chunk_tokens", "seed")),
        ]
        reply = self._call("store", lambda: pipelined(self._client, asked), store=True)
        if reply is None:
            return
        recorded = reply.pop()
        if known is None and isinstance(recorded, list):
            info = self._namespace_info(recorded)  # the record this store made, or found
            if info is not None:
                self._layouts[fingerprint] = info
        if not isinstance(recorded, list) or recorded[:2] != [layout_json.encode(), str(chunk_tokens).encode()]:
            # One fingerprint has one KV layout; chunks of another length would never be found.
            with self._lock:
                self._store_errors += 1
            logger.warning("redis cache: the namespace holds another KV layout or chunk length; not stored")
            return
        known_ids = {piece.id for piece, found in zip(chain, reply[3:-1]) if found}
        ids = [piece.id for piece in chain]
        last = chain[-1]
        holder = reply[-1]  # a stored chunk after the same predecessor whose tokens start with the last's
        if last.n_tokens < chunk_tokens and last.id not in known_ids and isinstance(holder, bytes):
            try:
                longer = bytes.fromhex(holder.decode())
            except ValueError:
                longer = b""
            if len(longer) == ID_BYTES and longer != last.id:
                ids[-1] = longer
                known_ids.add(longer)
        new = [piece for piece in chain if piece.id not in known_ids and piece.id in ids]
        head = b"".join(encode_head(state, chunk_tokens))
        by_id = {piece.id: piece for piece in chain}

        def write() -> Any:
            sizes = redis_transfer.set_chunks(self._client, fingerprint, layout, state.segments, new) if new else {}
            args: list[Any] = [redis_keys.prefix(fingerprint), redis_keys.digest(tokens).hex(), head, self.capacity_bytes, len(ids),
                               chunk_tokens]
            for ident in ids:
                piece = by_id.get(ident)
                if piece is not None:
                    args += [ident.hex(), sizes.get(ident, 0), piece.prev.hex(), piece.tokens.astype("<i4").tobytes()]
                else:  # an existing longer chunk: already registered, its size already counted
                    args += [ident.hex(), 0, last.prev.hex(), b""]
            keys = [redis_keys.entry_key(fingerprint, tokens), *(redis_keys.meta_key(fingerprint, name) for name in ("lru", "refs", "info", "bytes", "clock"))]
            if self._script is None:
                self._script = self._client.register_script(STORE_SCRIPT)
            return self._script(keys=keys, args=args)

        result = self._call("store", write, store=True, trips=2 if new else 1)
        if result is None:
            return
        over, freed, evicted = result
        if freed:
            self._call("store", lambda: self._client.delete(*[redis_keys.CHUNK_KEY_PREFIX + ident for ident in freed]), store=True)
        with self._lock:
            self._evictions += int(evicted)
            if int(over):
                self._rejected += 1
            else:
                self._writes += 1

    # --------------------------------------------------------------------------------- upkeep

    def sweep(self, grace_seconds: float = 60.0) -> int:
        """Collect what clients that died mid-store and Redis's own evictions leave behind.

        In the bound namespace: drops entries whose record or chunks are gone, rebuilds the reference
        counts, chunk registrations and byte count from the entries that remain, and deletes chunk keys
        of the namespace no entry links and idle for ``grace_seconds`` (younger ones may belong to a
        store in progress). Scans keys (``SCAN``): run it now and then, not per request. Concurrent
        stores may be counted wrong until the next sweep; never raises for Redis failures.

        Returns:
            The number of keys deleted (0 when Redis is unreachable).
        """
        fingerprint = self._fingerprint
        if fingerprint is None:
            return 0
        result = self._call("sweep", lambda: redis_sweep.sweep(self._client, fingerprint, grace_seconds))
        if result:
            logger.info("redis cache: sweep removed %d keys", result)
        return int(result or 0)

    # ------------------------------------------------------------------------------ the client

    @property
    def _client(self) -> Any:
        """The redis-py client, made on first use (inside :meth:`_call`, so that a cluster that cannot
        be reached or refuses the credentials is a counted failure, not an exception out of the
        constructor; the next call tries again)."""
        client = self._connected
        if client is None:
            with self._lock:
                if self._connected is None:
                    self._connected = connect(self.url, self.timeout, self._cluster)
                client = self._connected
        return client

    def _call(self, what: str, run: Any, *, store: bool = False, trips: int = 1) -> Any:
        """Run ``run()`` against Redis; on failure log once per outage, count, and return None."""
        try:
            result = run()
        except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as error:
            # RedisClusterException (a cluster client refusing a call, or finding no node) is not a RedisError.
            with self._lock:
                self.errors += 1
                if store:
                    self._store_errors += 1
                kind = type(error).__name__
                first = self._failing is None
                self._failing = kind
            if first:
                logger.warning("redis cache: %s failed (%s: %s); misses until Redis answers again", what, kind,
                               self._scrub(str(error)))
            return None
        with self._lock:
            self._round_trips += trips
            recovered = self._failing is not None
            self._failing = None
        if recovered:
            logger.warning("redis cache: Redis answers again")
        return result

    def _scrub(self, text: str) -> str:
        """``text`` (an error message) with the URL's password replaced by ``***``."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def __repr__(self) -> str:
        return f"{type(self).__name__}({redact_url(self.url)!r}, capacity_bytes={self.capacity_bytes})"


class _Plan:
    """The best prefix of a query the metadata knows: its chunks (id, prev, start) and length."""

    __slots__ = ("fingerprint", "chunks", "length", "layout", "chunk_tokens", "seed", "head")

    def __init__(self, fingerprint: str, chunks: list[tuple[bytes, bytes, int]], length: int, layout: KVLayout,
                 chunk_tokens: int, seed: int, head: Head | None) -> None:
        self.fingerprint = fingerprint
        self.chunks = chunks
        self.length = length
        self.layout = layout
        self.chunk_tokens = chunk_tokens
        self.seed = seed
        self.head = head


def _ask_children(fingerprint: str, prev: bytes, rest: bytes, size: int | None) -> list[tuple[Any, tuple[Any, ...]]]:
    """The command asking "which child of ``prev`` holds each prefix of ``rest``'s first chunk" (none
    while the chunk length is unknown), as :func:`_pipelined` takes it."""
    if not size:
        return []
    head, key = rest[: 4 * size], redis_keys.prefixes_key(fingerprint, prev)
    return [(key, ("HMGET", key, *([head[: 4 * n] for n in range(1, len(head) // 4 + 1)] or [b""])))]


def _walk(fingerprint: str, query: npt.NDArray[np.int32], ids: list[bytes], children: Any, chunk_tokens: int,
          layout: KVLayout, seed: int, exact: Any) -> _Plan:
    """The query's stored full chunks ``ids``, then the child sharing most of the rest (``children``:
    the ids holding each prefix of the rest, shortest first)."""
    chunks: list[tuple[bytes, bytes, int]] = []
    prev = b""
    for k, ident in enumerate(ids):
        chunks.append((ident, prev, k * chunk_tokens))
        prev = ident
    position = len(ids) * chunk_tokens
    best, shared = None, 0
    if isinstance(children, list):
        # The longest prefix some child holds (a shorter one may be gone with another child).
        for n in range(len(children), 0, -1):
            name = children[n - 1]
            if isinstance(name, bytes) and len(name) == 2 * ID_BYTES:
                try:
                    best, shared = bytes.fromhex(name.decode()), n
                    break
                except ValueError:
                    continue
    if best is not None and position + shared <= len(query):
        chunks.append((best, prev, position))
        position += shared
    head = None
    if position == len(query) and isinstance(exact, list) and isinstance(exact[0], bytes):
        try:
            decoded = decode_head(exact[0])
            if decoded.fingerprint == fingerprint and np.array_equal(decoded.tokens, query) and decoded.layout == layout:
                head = decoded
        except CorruptStateError:
            head = None
    return _Plan(fingerprint, chunks, position, layout, chunk_tokens, head.seed if head is not None else seed, head)


@functools.lru_cache(maxsize=64)
def _parse_layout(text: bytes) -> KVLayout:
    """A namespace record's layout, parsed and validated once per distinct text."""
    return layout_from_json(json.loads(text))


def _extends(marker: Any, query: npt.NDArray[np.int32], start: int, length: int, chunk_tokens: int) -> bool:
    """Whether an in-flight marker (the tokens of a chunk being stored at ``start``; untrusted) shares
    more of ``query`` than the ``length`` tokens already found."""
    if not isinstance(marker, bytes) or not 0 < len(marker) <= 4 * chunk_tokens or len(marker) % 4:
        return False
    announced = np.frombuffer(marker, dtype="<i4")
    ours = query[start : start + len(announced)]
    differ = np.flatnonzero(announced[: len(ours)] != ours)
    shared = int(differ[0]) if len(differ) else len(ours)
    return start + shared > length


def _as_count(value: Any) -> int:
    """A non-negative count read from Redis (anything else: 0)."""
    try:
        return max(0, int(value))
    except (TypeError, ValueError):
        return 0
