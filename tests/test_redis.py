"""LlamaRedisCache against real redis-server processes on loopback (started here, never mocked)."""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from llama_cache.caches.redis_tier import LlamaRedisCache
from llama_cache.caches.redis_frames import encode_frame, frame_size
from llama_cache.state.chunks import default_chunk_tokens, encode_head, pieces
from llama_cache.state.llama_state import LlamaState
from llama_cache.testing.redis_server import RedisCluster, RedisServer, redis_available
from tests.cache_contract import CacheContract
from tests.test_disk_cache import make_cut_state

pytestmark = pytest.mark.skipif(not redis_available(), reason="redis-server is not installed")

Deployment = RedisServer | RedisCluster
KINDS = ["server", "cluster"]


def deploy(kind: str, args: list[str] | None = None, password: str | None = None) -> Deployment:
    """One redis-server, or a 3-node Redis Cluster, on loopback (a context manager stopping it)."""
    if kind == "cluster":
        return RedisCluster(3, args=args, password=password)
    auth = ["--requirepass", password] if password is not None else []
    return RedisServer(args=[*auth, *(args or [])], password=password)


def raw_client(deployment: Deployment) -> Any:
    """A plain redis-py client of the deployment, to inspect or damage what the cache wrote."""
    import redis
    import redis.cluster

    if isinstance(deployment, RedisCluster):
        first = deployment.servers[0]
        return redis.cluster.RedisCluster(host="127.0.0.1", port=first.port, password=deployment.password)
    return redis.Redis(host="127.0.0.1", port=deployment.port, password=deployment.password)


def evicted_keys(deployment: Deployment) -> int:
    """Keys Redis evicted on its own (``maxmemory``), over every node."""
    import re

    return sum(int(count) for count in re.findall(r"evicted_keys:(\d+)", deployment.cli("info", "stats")))


@pytest.fixture(scope="module", params=KINDS)
def server(request: pytest.FixtureRequest) -> Iterator[Deployment]:
    """One redis-server, or a 3-node cluster, for the whole module: every test runs on both."""
    with deploy(request.param) as running:
        yield running


@pytest.fixture
def fresh(server: Deployment) -> Deployment:
    """The module's deployment, emptied (and its nodes running)."""
    nodes = server.servers if isinstance(server, RedisCluster) else [server]
    if not all(node.running for node in nodes):
        for node in nodes:
            node.start()
        if isinstance(server, RedisCluster):
            server.wait_ready()
    server.flushall()
    return server


def fixed_state(tokens: Sequence[int], nbytes: int = 1000, fingerprint: str = "test", logits: bool = False) -> LlamaState:
    """A transformer state of one KV layout (as every state of one model has), ``nbytes`` made up by
    its logits row (so that sizes vary as the contract needs while the layout does not)."""
    tokens = list(tokens)
    kv = make_cut_state(tokens or [0], 64 * max(len(tokens), 1), fingerprint=fingerprint)
    row = make_cut_state([0], 64, fingerprint=fingerprint)
    assert kv.layout == row.layout or not tokens
    width = max(1, (nbytes - 64 * len(tokens)) // 4) if logits or nbytes > 64 * len(tokens) else 0
    values = np.arange(width, dtype=np.float32) + len(tokens) if width else None
    return LlamaState(np.array(tokens, dtype=np.int32), values, 0, fingerprint, layout=kv.layout,
                      segments=kv.segments)


def redis_size(state: LlamaState) -> int:
    """Bytes a state takes in an empty Redis tier: its head and its chunks."""
    assert state.layout is not None
    size = default_chunk_tokens(state.layout)
    chain = pieces(state.fingerprint, state.tokens, size)
    head = sum(part.nbytes for part in encode_head(state, size))
    return head + sum(frame_size(state.layout, piece.n_tokens) for piece in chain)


class TestRedisContract(CacheContract):
    policy = "shared_prefix"

    @pytest.fixture(autouse=True)
    def _server(self, fresh: Deployment) -> None:
        self._url = fresh.url

    def make_cache(self, capacity_bytes: int) -> Any:
        return LlamaRedisCache(self._url, capacity_bytes, fingerprint="test")

    def make_state(self, tokens: Sequence[int], nbytes: int = 1000) -> Any:
        return fixed_state(tokens, nbytes)

    def make_state_of(self, tokens: Sequence[int], fingerprint: str) -> Any:
        return fixed_state(tokens, 1000, fingerprint=fingerprint)

    def size_of(self, state: Any) -> int:
        return redis_size(state)

    def tokens_of(self, state: Any) -> tuple[int, ...]:
        return tuple(state.tokens.tolist())

    def test_replacing_a_key_never_overcounts(self) -> None:
        # The chunks of a key are content-addressed: a new state for the same tokens reuses them, and
        # replacing an entry only swaps its head.
        cache = self.make_cache(10**6)
        first = make_cut_state([1, 2], 3000)
        cache[[1, 2]] = first
        size_one = cache.cache_size
        assert size_one == redis_size(first)
        for _ in range(3):
            cache[[1, 2]] = make_cut_state([1, 2], 3000, logits=True)
        assert len(cache) == 1
        assert cache.cache_size == redis_size(make_cut_state([1, 2], 3000, logits=True))
        assert cache[[1, 2]].logits is not None

    def test_empty_key_and_query(self) -> None:
        cache = self.make_cache(10**6)
        cache[[1]] = self.make_state([1])
        with pytest.raises(KeyError):
            cache[[]]


# -- what comes back --------------------------------------------------------------------------------


def test_hits_return_the_stored_bytes_cut_to_the_shared_prefix(fresh: Deployment) -> None:
    cache = LlamaRedisCache(fresh.url, 10**8, fingerprint="test", chunk_tokens=8)
    state = make_cut_state(range(100), 100 * 400, logits=True)
    cache[range(100)] = state
    exact = cache[range(100)]
    assert np.array_equal(exact.seq_bytes(), state.seq_bytes()) and np.array_equal(exact.logits, state.logits)
    longer = cache[[*range(100), 7, 7]]
    assert longer.n_tokens == 100 and longer.logits is None
    diverging = cache[[*range(37), 999]]  # mid-chunk, where no entry ends
    assert diverging.n_tokens == 37 and diverging.logits is None
    assert np.array_equal(diverging.seq_bytes(), state.prefix(37, None).seq_bytes())
    assert cache.match_length([*range(37), 999]) == 37


def test_a_state_found_stays_whole_while_later_lookups_reuse_the_reply_buffers(fresh: Deployment) -> None:
    from llama_cache.caches.redis_transfer import REPLY_BUFFERS

    cache = LlamaRedisCache(fresh.url, 10**9, fingerprint="test", chunk_tokens=64)
    first = make_cut_state(range(3000), 3000 * 800, logits=True)
    second = make_cut_state(range(1, 3001), 3000 * 800, logits=True)
    cache[first.tokens] = first
    cache[second.tokens] = second
    reuses = REPLY_BUFFERS.reuses
    held = cache[first.tokens]  # read into a recycled buffer (megabytes: pooled)
    for _ in range(3):  # later lookups may not read into the buffer the held state lives in
        assert np.array_equal(cache[second.tokens].seq_bytes(), second.seq_bytes())
    assert np.array_equal(held.seq_bytes(), first.seq_bytes()) and np.array_equal(held.logits, first.logits)
    del held
    assert np.array_equal(cache[first.tokens].seq_bytes(), first.seq_bytes())
    assert REPLY_BUFFERS.reuses > reuses  # the buffers were lent again, not mapped anew each time


def test_fetch_bounds_each_reply_by_its_own_command() -> None:
    import redis

    from llama_cache.caches import redis_client, redis_transfer

    with RedisServer() as server:
        client = redis_client.connect(server.url, timeout=5, cluster=False)
        client.set("a", b"12345")
        client.set("b", b"678")
        commands = [("a", ("GET", "a")), ("b", ("GET", "b")), ("c", ("EXISTS", "c"))]
        got = redis_transfer.fetch(client, commands, [5, 3, 0])
        assert [bytes(got[0]), bytes(got[1]), got[2]] == [b"12345", b"678", 0]
        refused = redis_transfer.fetch(client, commands, [5, 2, 0])  # b's value is longer than its bound
        assert all(isinstance(reply, redis.ResponseError) for reply in refused)
        assert bytes(redis_transfer.fetch(client, commands[:1], 5)[0]) == b"12345"  # the connection recovered
        with pytest.raises(ValueError):
            redis_transfer.fetch(client, commands, [5, 3])


def test_fetch_reads_many_windows_in_order_and_a_refusal_in_a_late_one_fails_the_node_not_the_process() -> None:
    import redis

    from llama_cache.caches import redis_client, redis_transfer

    rng = np.random.default_rng(7)
    values = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for size in (700_000, 5, 900_000, 1, 650_000, 300_000)]
    with RedisServer() as server:
        client = redis_client.connect(server.url, timeout=5, cluster=False)
        for i, value in enumerate(values):
            client.set(f"v{i}", value)
        commands = [(f"v{i}", ("GET", f"v{i}")) for i in range(len(values))] + [("none", ("GET", "none")),
                                                                                 ("n", ("EXISTS", "v0"))]
        bounds = [len(value) for value in values] + [10, 0]
        assert sum(bounds) > 2 * redis_transfer.WINDOW  # three windows, each sent before the last is read
        seen: dict[int, Any] = {}
        got = redis_transfer.fetch(client, commands, bounds, seen.__setitem__)
        assert [bytes(reply) for reply in got[: len(values)]] == values and got[-2:] == [None, 1]
        assert seen.keys() == set(range(len(commands))) and all(seen[at] is reply for at, reply in enumerate(got))
        seen.clear()
        refused = redis_transfer.fetch(client, commands, [*bounds[:4], 10, *bounds[5:]], seen.__setitem__)
        assert all(isinstance(reply, redis.ResponseError) for reply in refused)  # the 5th was too long
        assert seen and len(seen) < 4  # the first window was passed on as it came; the list is the truth
        def fail(at: int, reply: Any) -> None:
            raise RuntimeError("the caller's own failure")

        with pytest.raises(RuntimeError):
            redis_transfer.fetch(client, commands, bounds, fail)
        again = redis_transfer.fetch(client, commands, bounds)  # a new connection, the same answers
        assert [bytes(reply) for reply in again[: len(values)]] == values
        server.kill()  # the idle pooled connection is broken: the next fetch answers on a new one
        server.start()
        for i, value in enumerate(values):
            client.set(f"v{i}", value)
        assert [bytes(reply) for reply in redis_transfer.fetch(client, commands, bounds)[: len(values)]] == values


def test_a_chain_of_the_longest_chunks_is_found_at_every_token_through_its_prefix_index(fresh: Deployment) -> None:
    # Chunks of 4,096 tokens (the longest): a chunk after one made by the same store indexes its 4,096
    # prefixes in batched HSETs, as one Lua call may not unpack 8,192 fields.
    cache = LlamaRedisCache(fresh.url, 10**8, fingerprint="test", chunk_tokens=4096)
    state = make_cut_state(range(9000), 9000 * 16)
    cache[range(9000)] = state
    for length in (30, 4095, 4096, 4200, 8000, 8191, 8192, 8500, 8999):
        query = [*range(length), 100_000]
        assert cache.match_length(query) == length
        found = cache[query]
        assert found.n_tokens == length and np.array_equal(found.seq_bytes(), state.prefix(length, None).seq_bytes())
    cache[range(9100)] = make_cut_state(range(9100), 9100 * 16)  # the next turn: absorbs the partial chunk
    assert cache.match_length([*range(9050), 100_000]) == 9050
    assert cache[range(9000)].n_tokens == 9000  # (its last tokens' KV now read from the absorbing chunk)


def test_a_shared_prefix_is_stored_once(fresh: Deployment) -> None:
    cache = LlamaRedisCache(fresh.url, 10**8, fingerprint="test", chunk_tokens=8)
    base = make_cut_state(range(64), 64 * 400)
    cache[range(64)] = base
    one = cache.cache_size
    for k in range(5):
        tokens = [*range(64), 1000 + k]
        # The same KV for the shared 64 tokens (a real model makes it so); one new token each.
        grown = LlamaState(np.array(tokens, dtype=np.int32), None, 0, "test", layout=base.layout,
                           segments=(*base.segments, make_cut_state([1000 + k], 400).segments[0]))
        cache[tokens] = grown
    added = cache.cache_size - one
    assert 0 < added < one  # five entries cost less than the one they extend: chunks shared


def test_a_growing_conversation_keeps_one_tail_per_branch(fresh: Deployment) -> None:
    # Each turn's partial last chunk stayed beside the longer one of the next turn (~5% of the memory).
    cache = LlamaRedisCache(fresh.url, 10**8, fingerprint="test", chunk_tokens=8)
    full = make_cut_state(range(30), 30 * 400, logits=True)
    turns = [LlamaState(full.tokens[:n], full.logits, 0, "test", layout=full.layout, segments=full.prefix(n, None).segments)
             for n in (11, 14, 16, 21)]  # tails of 3 and 6 tokens, a full chunk, then a tail of 5
    for turn in turns:
        cache[turn.tokens] = turn
    last = turns[-1]
    chunks = sum(frame_size(last.layout, piece.n_tokens) for piece in pieces("test", last.tokens, 8))
    heads = sum(sum(part.nbytes for part in encode_head(turn, 8)) for turn in turns)
    assert cache.cache_size == chunks + heads  # every chunk once: no tail left behind
    assert len(_chunk_keys(fresh)) == 3
    for turn in turns:
        found = cache[turn.tokens]
        assert found.n_tokens == turn.n_tokens and found.logits is not None
        assert np.array_equal(found.seq_bytes(), turn.seq_bytes())
    cache[range(100, 111)] = make_cut_state(range(100, 111), 11 * 400)  # another branch keeps its own tail
    assert len(_chunk_keys(fresh)) == 5
    cache.clear()
    assert cache.cache_size == 0 and _chunk_keys(fresh) == []


def test_lookups_take_two_round_trips_whatever_the_number_of_entries(fresh: Deployment) -> None:
    cache = LlamaRedisCache(fresh.url, 10**9, fingerprint="test", chunk_tokens=8)
    trips = []
    for count in (10, 300):
        for i in range(len(cache), count):
            cache[[i, i, i]] = make_cut_state([i, i, i], 120)
        cache[[0, 0, 0, 5]]  # warm: the namespace record is read once per process
        before = cache.stats().round_trips
        cache[[count - 1, count - 1, count - 1, 5]]
        trips.append(cache.stats().round_trips - before - 1)  # the second stats() takes one
    assert trips[0] == trips[1] == 2


def test_models_never_see_each_others_states(fresh: Deployment) -> None:
    mine = LlamaRedisCache(fresh.url, 10**8, fingerprint="model-a")
    theirs = LlamaRedisCache(fresh.url, 10**8, fingerprint="model-b")
    theirs[[1, 2, 3]] = make_cut_state([1, 2, 3], 1200, fingerprint="model-b")
    with pytest.raises(KeyError):
        mine[[1, 2, 3]]
    mine[[1, 2, 3]] = make_cut_state([1, 2, 3], 1200, fingerprint="model-a")
    assert mine[[1, 2, 3]].fingerprint == "model-a" and theirs[[1, 2, 3]].fingerprint == "model-b"


def test_values_that_are_not_transformer_states_are_counted_not_stored(fresh: Deployment) -> None:
    from tests.test_disk_cache import make_state

    cache = LlamaRedisCache(fresh.url, 10**8, fingerprint="test")
    cache[[1, 2]] = make_state([1, 2])  # opaque (recurrent) state
    cache[[3]] = "not a state"
    assert len(cache) == 0 and cache.stats().store_errors == 2


# -- damage, eviction, sweeping -------------------------------------------------------------------


def _chunk_keys(server: Deployment) -> list[str]:
    return [key for key in server.cli("--scan", "--pattern", "llc:c:*").split() if key]


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "swap"])
def test_damaged_chunks_give_shorter_hits_or_misses_never_wrong_bytes(fresh: Deployment, damage: str) -> None:
    cache = LlamaRedisCache(fresh.url, 10**8, fingerprint="test", chunk_tokens=8)
    state = make_cut_state(range(64), 64 * 400, logits=True)
    cache[range(64)] = state
    other = make_cut_state(range(500, 564), 64 * 400)
    cache[range(500, 564)] = other
    client = raw_client(fresh)
    ids = [piece.id for piece in pieces("test", state.tokens, 8)]
    target = b"llc:c:" + ids[4].hex().encode()  # the fifth chunk: positions 32..39
    value = client.get(target)
    if damage == "flip":
        client.set(target, value[:-1] + bytes([value[-1] ^ 0xFF]))
    elif damage == "truncate":
        client.set(target, value[: len(value) // 2])
    elif damage == "delete":
        client.delete(target)
    else:
        client.set(target, client.get(b"llc:c:" + pieces("test", other.tokens, 8)[4].id.hex().encode()))
    found = cache[range(64)]
    assert found.n_tokens == 32 and found.logits is None
    assert np.array_equal(found.seq_bytes(), state.prefix(32, None).seq_bytes())


def test_a_hit_cut_short_keeps_its_own_bytes_not_the_reply_buffer(fresh: Deployment) -> None:
    from llama_cache.caches.redis_transfer import REPLY_BUFFERS

    cache = LlamaRedisCache(fresh.url, 10**9, fingerprint="test", chunk_tokens=64)
    first = make_cut_state(range(3000), 3000 * 2400)  # megabytes per node: pooled
    second = make_cut_state(range(1, 3001), 3000 * 2400)
    cache[first.tokens] = first
    cache[second.tokens] = second
    raw_client(fresh).delete(b"llc:c:" + pieces("test", first.tokens, 64)[3].id.hex().encode())
    REPLY_BUFFERS.clear()
    short = cache[first.tokens]  # 3 of 47 chunks: the rest of the buffer read is not kept
    assert short.n_tokens == 192 and np.array_equal(short.seq_bytes(), first.prefix(192, None).seq_bytes())
    # The buffers it was read into are idle while the short hit lives on.
    assert REPLY_BUFFERS.kept_nbytes > 2_000_000 and REPLY_BUFFERS.idle_nbytes == REPLY_BUFFERS.kept_nbytes
    reuses = REPLY_BUFFERS.reuses
    assert np.array_equal(cache[second.tokens].seq_bytes(), second.seq_bytes())
    assert REPLY_BUFFERS.reuses > reuses  # lent again, not mapped anew
    assert np.array_equal(short.seq_bytes(), first.prefix(192, None).seq_bytes())


@pytest.mark.parametrize("kind", KINDS)
def test_redis_evicting_on_its_own_never_gives_a_wrong_state(kind: str) -> None:
    with deploy(kind, ["--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru"]) as small:
        cache = LlamaRedisCache(small.url, 10**9, fingerprint="test", chunk_tokens=8)
        states = {}
        for i in range(40):
            tokens = list(range(i * 100, i * 100 + 48))
            states[i] = make_cut_state(tokens, 48 * 2000)
            cache[tokens] = states[i]
        hits = 0
        for i, state in states.items():
            try:
                found = cache[state.tokens.tolist()]
            except KeyError:
                continue
            hits += 1
            assert np.array_equal(found.seq_bytes(), state.prefix(found.n_tokens, None).seq_bytes())
        assert hits < 40 and evicted_keys(small) > 0  # Redis dropped some
        cache.sweep(grace_seconds=0)
        for state in states.values():
            try:
                found = cache[state.tokens.tolist()]
            except KeyError:
                continue
            hits += 1
            assert np.array_equal(found.seq_bytes(), state.prefix(found.n_tokens, None).seq_bytes())
        # Which keys Redis drops (metadata included) is its LRU sampling's choice; a state stored now
        # is whole again, and what is read back is right.
        latest = make_cut_state(range(9000, 9048), 48 * 2000)
        cache[range(9000, 9048)] = latest
        found = cache[range(9000, 9048)]
        assert np.array_equal(found.seq_bytes(), latest.prefix(found.n_tokens, None).seq_bytes())


def test_sweep_collects_what_a_dead_client_left(fresh: Deployment) -> None:
    cache = LlamaRedisCache(fresh.url, 10**8, fingerprint="test", chunk_tokens=8)
    kept = make_cut_state(range(40), 40 * 400)
    cache[range(40)] = kept
    orphan_state = make_cut_state(range(900, 940), 40 * 400)
    # A client that died after writing its chunks and before its script ran.
    client = raw_client(fresh)
    for piece in pieces("test", orphan_state.tokens, 8):
        client.set(b"llc:c:" + piece.id.hex().encode(),
                   bytes(encode_frame("test", piece, orphan_state.layout, orphan_state.segments,
                                      np.empty(frame_size(orphan_state.layout, piece.n_tokens), dtype=np.uint8))))
    before = cache.cache_size
    assert len(_chunk_keys(fresh)) == 10
    assert cache.sweep(grace_seconds=0) == 5
    assert len(_chunk_keys(fresh)) == 5 and cache.cache_size == before
    assert np.array_equal(cache[range(40)].seq_bytes(), kept.seq_bytes())
    # A chunk lost under an entry: the entry goes, and so do the chunks only it used.
    client.delete(b"llc:c:" + pieces("test", kept.tokens, 8)[2].id.hex().encode())
    cache.sweep(grace_seconds=0)
    assert len(cache) == 0 and cache.cache_size == 0 and _chunk_keys(fresh) == []


# -- outages ---------------------------------------------------------------------------------------


def test_a_server_that_never_answers_is_a_miss_within_the_timeout(caplog: pytest.LogCaptureFixture) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])  # and never answer
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        cache = LlamaRedisCache(f"redis://127.0.0.1:{listener.getsockname()[1]}/0", fingerprint="test", timeout=0.3)
        with caplog.at_level(logging.WARNING, logger="llama_cache"):
            with pytest.raises(KeyError):
                cache[[1, 2, 3]]
            cache[[1, 2, 3]] = make_cut_state([1, 2, 3], 1000)
            with pytest.raises(KeyError):
                cache[[1, 2, 3]]
        # Within the timeout, by count rather than by the clock: each operation made one attempt (one
        # connection, closed when it timed out), and every attempt's connect and reads are bounded by it.
        stop.set()
        thread.join()
        listener.setblocking(False)
        while True:  # the connections still waiting in the backlog
            try:
                accepted.append(listener.accept()[0])
            except BlockingIOError:
                break
        assert len(accepted) == 3
        options = cache._client.connection_pool.connection_kwargs
        assert options["socket_timeout"] == options["socket_connect_timeout"] == 0.3
        assert cache.errors >= 3 and cache.stats().store_errors >= 1
        assert sum("redis cache" in r.getMessage() for r in caplog.records) == 1  # logged once per outage
    finally:
        stop.set()
        thread.join()
        for connection in accepted:
            connection.close()
        listener.close()


@pytest.mark.parametrize("kind", KINDS)
def test_completions_go_on_while_redis_restarts(kind: str, caplog: pytest.LogCaptureFixture) -> None:
    with deploy(kind) as server:
        nodes = server.servers if isinstance(server, RedisCluster) else [server]
        cache = LlamaRedisCache(server.url, 10**8, fingerprint="test", timeout=0.5)
        cache[[1, 2, 3]] = fixed_state([1, 2, 3])
        assert cache[[1, 2, 3]].n_tokens == 3
        for node in nodes:
            node.kill()
        with caplog.at_level(logging.WARNING, logger="llama_cache"):
            with pytest.raises(KeyError):
                cache[[1, 2, 3]]
            cache[[4, 5]] = fixed_state([4, 5])  # skipped, not raised
            for node in nodes:
                node.start()
            if isinstance(server, RedisCluster):
                server.wait_ready()
            cache[[4, 5]] = fixed_state([4, 5])  # reconnects by itself
        assert cache[[4, 5]].n_tokens == 2
        assert any("answers again" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("kind", KINDS)
def test_passwords_pass_through_to_redis(kind: str) -> None:
    with deploy(kind, password="s3cret") as server:
        wrong = LlamaRedisCache(server.url.replace(":s3cret@", ":nope@"), fingerprint="test")
        wrong[[1]] = make_cut_state([1], 500)
        assert wrong.stats().store_errors == 1
        right = LlamaRedisCache(server.url, fingerprint="test")
        right[[1]] = make_cut_state([1], 500)
        assert right[[1]].n_tokens == 1


def test_usernames_and_passwords_in_multi_node_urls() -> None:
    # The password of a URL naming several nodes was dropped: "Authentication required" out of the
    # constructor.
    with RedisCluster(3, password="s3cret") as cluster:
        for node in cluster.servers:
            assert node.cli("acl", "setuser", "alice", "on", ">a1ice", "~*", "&*", "+@all").strip() == "OK"
        nodes = cluster.url.split("@", 1)[1]
        for url in (f"redis://alice:a1ice@{nodes}", f"redis://:s3cret@{nodes}/0", f"redis://default:s3cret@{nodes}"):
            cache = LlamaRedisCache(url, fingerprint="test")
            cache[[1, 2]] = make_cut_state([1, 2], 500)
            assert cache[[1, 2]].n_tokens == 2 and cache.errors == 0
        refused = LlamaRedisCache(f"redis://alice:wrong@{nodes}", fingerprint="test")  # nothing raised here
        with pytest.raises(KeyError):
            refused[[1, 2]]
        assert refused.errors == 1 and "wrong" not in repr(refused)


def test_a_rediss_url_naming_several_nodes_speaks_tls_to_each() -> None:
    with RedisCluster(3, password="s3cret", tls=True) as cluster:
        assert cluster.url.startswith("rediss://:s3cret@")
        cache = LlamaRedisCache(cluster.url, 10**8, fingerprint="test", chunk_tokens=8)
        state = make_cut_state(range(64), 64 * 400, logits=True)
        cache[range(64)] = state  # eight chunks, spread over the nodes by id
        found = cache[range(64)]
        assert np.array_equal(found.seq_bytes(), state.seq_bytes()) and cache.errors == 0
        plain = LlamaRedisCache(cluster.url.replace("rediss://", "redis://"), fingerprint="test")
        with pytest.raises(KeyError):
            plain[range(64)]  # the TLS ports refuse plaintext
        assert plain.errors == 1


@pytest.mark.parametrize("loss", ["killed", "stopped"])
def test_a_lost_cluster_node_makes_its_chunks_misses_and_the_others_serve(loss: str) -> None:
    from llama_cache.caches.redis_keys import chunk_key, meta_key

    # Without full coverage required, the nodes left answer for their own slots.
    with RedisCluster(3, args=["--cluster-require-full-coverage", "no"]) as cluster:
        cache = LlamaRedisCache(cluster.url, 10**8, fingerprint="test", chunk_tokens=8, timeout=0.5)
        state = make_cut_state(range(200), 200 * 100, logits=True)
        cache[range(200)] = state
        client = raw_client(cluster)
        holders = [client.get_node_from_key(chunk_key(piece.id)).port for piece in pieces("test", state.tokens, 8)]
        metadata = client.get_node_from_key(meta_key("test", "lru")).port
        victim = next(node for node in cluster.servers if node.port not in (metadata, holders[0]) and node.port in holders)
        assert victim.process is not None
        lost_from = holders.index(victim.port) * 8
        if loss == "killed":
            victim.kill()
        else:
            victim.process.send_signal(signal.SIGSTOP)  # accepts connections, never answers
        try:
            for _ in range(3):
                found = cache[range(200)]
                assert found.n_tokens == lost_from and found.logits is None
                assert np.array_equal(found.seq_bytes(), state.prefix(lost_from, None).seq_bytes())
            assert cache.errors >= 3 and cache.stats().hits == 3
        finally:
            if loss == "stopped":
                victim.process.send_signal(signal.SIGCONT)


@pytest.mark.model
def test_completions_go_on_when_a_cluster_node_is_lost() -> None:
    import llama_cache
    from llama_cache import Llama
    from llama_cache.caches.redis_keys import meta_key

    with RedisCluster(3, args=["--cluster-require-full-coverage", "no"]) as cluster:
        cache = LlamaRedisCache(cluster.url, timeout=0.5, chunk_tokens=16)
        llm = Llama(model_path=str(llama_cache.default_model_path()), n_ctx=1024, verbose=False, seed=0, cache=cache)
        prompt = llm.tokenize(b"The history of the printing press begins in the fifteenth century. " * 12)
        first = llm.create_completion(prompt, max_tokens=8, temperature=0)["choices"][0]["text"]
        assert cache.fingerprint is not None
        metadata = raw_client(cluster).get_node_from_key(meta_key(cache.fingerprint, "lru")).port
        next(node for node in cluster.servers if node.port != metadata).kill()
        for _ in range(2):
            llm.reset()
            again = llm.create_completion(prompt, max_tokens=8, temperature=0)["choices"][0]["text"]
            assert again == first and 0 < llm.last_prompt_tokens_evaluated < len(prompt)


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError):
        LlamaRedisCache(timeout=0)
    with pytest.raises(ValueError):
        LlamaRedisCache(timeout=float("nan"))
    with pytest.raises(ValueError):
        LlamaRedisCache(chunk_tokens=0)
    with pytest.raises(TypeError):
        LlamaRedisCache(url=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        LlamaRedisCache(fingerprint="")


# -- two processes, one model ----------------------------------------------------------------------

_SECOND_PROCESS = textwrap.dedent(
    """
    import json, sys
    import llama_cache
    from llama_cache import Llama, LlamaRAMCache, LlamaRedisCache, TieredCache
    url, prompt = sys.argv[1], json.loads(sys.argv[2])
    cache = TieredCache([LlamaRAMCache(1 << 30), LlamaRedisCache(url, cluster="," in url)])
    llm = Llama(model_path=str(llama_cache.default_model_path()), n_ctx=1024, verbose=False, seed=0, cache=cache)
    text = llm.create_completion(prompt, max_tokens=12, temperature=0)["choices"][0]["text"]
    ram, shared = cache.stats().tiers
    print(json.dumps({"text": text, "evaluated": llm.last_prompt_tokens_evaluated, "hits": shared.hits}))
    """
)


def _two_processes(url: str) -> None:
    """Process one fills RAM + Redis tiers; process two, with an empty RAM tier, hits from Redis:
    it evaluates only the new tokens and gives a cold run's greedy text."""
    import json

    import llama_cache
    from llama_cache import Llama

    prompt = "The history of the printing press begins in the fifteenth century. " * 12
    from llama_cache import LlamaRAMCache, TieredCache

    cache = TieredCache([LlamaRAMCache(1 << 30), LlamaRedisCache(url, cluster="," in url)])
    llm = Llama(model_path=str(llama_cache.default_model_path()), n_ctx=1024, verbose=False, seed=0, cache=cache)
    llm.create_completion(prompt, max_tokens=12, temperature=0)
    cache.flush()  # the Redis tier is written behind
    follow_up = prompt + "Its inventor was"
    cold = Llama(model_path=str(llama_cache.default_model_path()), n_ctx=1024, verbose=False, seed=0)
    expected = cold.create_completion(follow_up, max_tokens=12, temperature=0)["choices"][0]["text"]
    done = subprocess.run([sys.executable, "-c", _SECOND_PROCESS, url, json.dumps(follow_up)], capture_output=True,
                          text=True, timeout=300, check=True)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    new_tokens = len(llm.tokenize(follow_up.encode())) - len(llm.tokenize(prompt.encode()))
    assert report["hits"] == 1
    assert 0 < report["evaluated"] <= new_tokens + 1
    assert report["text"] == expected


@pytest.mark.model
def test_a_second_process_with_its_own_ram_tier_hits_what_the_first_computed(fresh: Deployment) -> None:
    _two_processes(fresh.url)


@pytest.mark.model
def test_an_exact_repeat_after_reset_evaluates_nothing_once_the_prompt_was_asked_again(fresh: Deployment) -> None:
    # 257 tokens: one full chunk and a one-token tail. On a cluster the exact hit's recency update
    # (a script in the fetch's pipeline) was refused by redis-py, and the whole prompt was evaluated again.
    import llama_cache
    from llama_cache import Llama

    cache = LlamaRedisCache(fresh.url)
    llm = Llama(model_path=str(llama_cache.default_model_path()), n_ctx=1024, verbose=False, seed=0, cache=cache)
    prompt = llm.tokenize(b"The history of the printing press begins in the fifteenth century. " * 40)[:257]
    assert len(prompt) == 257
    first = llm.create_completion(prompt, max_tokens=4, temperature=0)["choices"][0]["text"]
    assert llm.last_prompt_tokens_evaluated == 257
    llm.reset()
    # The first repeat is answered from prompt + answer's chunks: the last prompt token again, for its
    # logits; it stores the prompt's own state (its logits row), which serves the next repeat whole.
    again = llm.create_completion(prompt, max_tokens=4, temperature=0)["choices"][0]["text"]
    assert llm.last_prompt_tokens_evaluated == 1 and again == first
    llm.reset()
    again = llm.create_completion(prompt, max_tokens=4, temperature=0)["choices"][0]["text"]
    assert llm.last_prompt_tokens_evaluated == 0 and again == first
    stats = cache.stats()
    assert (stats.hits, stats.misses, cache.errors) == (2, 1, 0)
    llm.reset()
    llm.create_completion([*prompt, *llm.tokenize(b" Its inventor", add_bos=False)], max_tokens=4, temperature=0)
    assert 0 < llm.last_prompt_tokens_evaluated <= 3


def test_a_new_client_cuts_chains_as_the_namespace_records(fresh: Deployment) -> None:
    first = LlamaRedisCache(fresh.url, 10**8, fingerprint="test", chunk_tokens=32)
    state = make_cut_state(range(100), 100 * 400)
    first[range(40)] = state.prefix(40, None)
    second = LlamaRedisCache(fresh.url, 10**8, fingerprint="test")  # default chunk length: 256 here
    second[range(100)] = state  # before any lookup of its own
    assert second.stats().writes == 1 and second.stats().store_errors == 0
    found = first[range(100)]
    assert found.n_tokens == 100 and np.array_equal(found.seq_bytes(), state.seq_bytes())


def test_among_many_branches_the_one_sharing_most_answers(fresh: Deployment) -> None:
    cache = LlamaRedisCache(fresh.url, 10**9, fingerprint="test", chunk_tokens=8)
    base = list(range(100, 116))  # two full chunks every entry shares
    states = {}
    for i in range(60):
        tokens = [*base, i, i, i]
        states[i] = make_cut_state(tokens, 19 * 120)
        cache[tokens] = states[i]
    before = cache.stats().round_trips
    found = cache[[*base, 42, 42, 7]]
    assert cache.stats().round_trips - before - 1 == 2
    assert found.tokens.tolist() == [*base, 42, 42]
    # The branch's own positions (16, 17) come from entry 42's chunk.
    tail, own = found.segments[-1], states[42].segments[0]
    assert tail.n_tokens == 2
    for i in range(found.layout.n_layer):
        assert np.array_equal(tail.k[i], own.k[i][16:18])


# -- in-flight stores (announce) ------------------------------------------------------------------------


def test_a_lookup_during_an_announced_store_waits_for_it_and_finds_the_state(fresh: Deployment) -> None:
    writer = LlamaRedisCache(fresh.url, 10**8, fingerprint="test", chunk_tokens=8, in_flight_seconds=30)
    reader = LlamaRedisCache(fresh.url, 10**8, fingerprint="test", chunk_tokens=8, in_flight_seconds=30)
    turn = make_cut_state(range(45), 45 * 100)
    writer[range(20)] = turn.prefix(20, None)  # the conversation so far
    assert reader.match_length([*range(45), 99]) == 20 and reader.waits == 0
    writer.announce(range(45))  # the next answer's state, about to be stored
    stored = threading.Event()

    def store_later() -> None:
        writer[range(45)] = turn  # write-behind: after the answer went out
        stored.set()

    # The store starts only once the reader is waiting: it cannot have landed before the lookup began.
    waiting = threading.Thread(target=lambda: (_wait_until(lambda: reader.waits == 1), store_later()))
    waiting.start()
    found = reader[[*range(45), 99, 98]]
    waiting.join()
    assert stored.is_set() and reader.waits == 1
    assert found.n_tokens == 45
    assert np.array_equal(found.seq_bytes(), turn.prefix(45, None).seq_bytes())
    assert raw_client(fresh).exists(*(f"llc:{{{_ns('test')}}}:w:{piece.prev.hex()}" for piece in pieces("test", turn.tokens, 8))) == 0


def test_a_marker_whose_writer_died_expires_and_the_lookup_goes_on(fresh: Deployment) -> None:
    writer = LlamaRedisCache(fresh.url, 10**8, fingerprint="test", chunk_tokens=8, in_flight_seconds=0.3)
    reader = LlamaRedisCache(fresh.url, 10**8, fingerprint="test", chunk_tokens=8, in_flight_seconds=0.3)
    writer[range(16)] = make_cut_state(range(16), 16 * 100)
    writer.announce(range(40))  # ... and the writer dies before storing
    assert reader.match_length(range(40)) == 16  # what is stored, once the markers expired
    assert reader.waits == 1
    assert reader[range(40)].n_tokens == 16
    assert reader.waits == 1  # the markers are gone: no second wait
    writer.announce(range(300, 340))
    with pytest.raises(KeyError):
        reader[range(300, 340)]  # a miss, after the bound


def test_markers_of_other_tokens_make_no_lookup_wait(fresh: Deployment) -> None:
    writer = LlamaRedisCache(fresh.url, 10**8, fingerprint="test", chunk_tokens=8, in_flight_seconds=30)
    reader = LlamaRedisCache(fresh.url, 10**8, fingerprint="test", chunk_tokens=8, in_flight_seconds=30)
    writer[range(16)] = make_cut_state(range(16), 16 * 100)
    writer.announce([*range(16), 500, 501, 502])  # another branch after the same chunks
    assert reader.match_length([*range(16), 700, 701]) == 16
    assert reader.match_length(range(16)) == 16
    assert reader.waits == 0
    never = LlamaRedisCache(fresh.url, 10**8, fingerprint="test", chunk_tokens=8, in_flight_seconds=0)
    assert never.match_length([*range(16), 500, 501]) == 16 and never.waits == 0


def test_an_announce_without_redis_is_a_counted_failure() -> None:
    with RedisServer() as stopped:
        url = stopped.url
    cache = LlamaRedisCache(url, fingerprint="test", chunk_tokens=8, timeout=0.2)
    cache.announce(range(40))
    assert cache.errors == 1


def _wait_until(condition: Any) -> None:
    import time

    for _ in range(30_000):  # (a bound for a broken build, not a timing assertion)
        if condition():
            return
        time.sleep(0.002)
    raise AssertionError("the condition never held")


def _ns(fingerprint: str) -> str:
    from llama_cache.caches.redis_keys import ns

    return ns(fingerprint)


def test_a_write_through_store_in_flight_is_found_by_another_instance(fresh: Deployment) -> None:
    from llama_cache import LlamaRAMCache, TieredCache

    gate = threading.Event()

    class Held(LlamaRedisCache):
        """A Redis tier whose stores wait for the test (a slow network)."""

        def __setitem__(self, key: Sequence[int], value: Any) -> None:
            gate.wait(60)
            super().__setitem__(key, value)

    shared = Held(fresh.url, 10**8, fingerprint="test", chunk_tokens=8, in_flight_seconds=60)
    tiered = TieredCache([LlamaRAMCache(capacity_bytes=10**8), shared], write_through=True)
    other = LlamaRedisCache(fresh.url, 10**8, fingerprint="test", chunk_tokens=8, in_flight_seconds=60)
    state = make_cut_state(range(40), 40 * 100)
    try:
        tiered[range(40)] = state  # returns at once: announced, stored behind
        found: list[LlamaState] = []
        lookup = threading.Thread(target=lambda: found.append(other[[*range(40), 7]]))
        lookup.start()
        _wait_until(lambda: other.waits == 1)  # the other instance waits for the store...
        gate.set()  # ...which lands now
        lookup.join()
        assert found[0].n_tokens == 40
        assert np.array_equal(found[0].seq_bytes(), state.seq_bytes())
    finally:
        gate.set()
        tiered.close()


def test_a_store_landing_between_a_lookups_commands_is_waited_for_not_a_shorter_hit(
        fresh: Deployment, monkeypatch: pytest.MonkeyPatch) -> None:
    from llama_cache.caches import redis_tier

    writer = LlamaRedisCache(fresh.url, 10**8, fingerprint="test", chunk_tokens=8, in_flight_seconds=60)
    reader = LlamaRedisCache(fresh.url, 10**8, fingerprint="test", chunk_tokens=8, in_flight_seconds=60)
    state = make_cut_state(range(40), 40 * 100)
    real = redis_tier.pipelined
    armed = [True]

    def interleaved(client: Any, commands: Sequence[tuple[Any, tuple[Any, ...]]], **options: Any) -> list[Any]:
        if armed and any(args[0] == "MGET" for _, args in commands):  # the reader's first lookup trip
            armed.clear()
            first = real(client, commands[:1], **options)
            writer[range(40)] = state  # the store's script runs between two of the trip's commands
            return first + real(client, commands[1:], **options)
        return real(client, commands, **options)

    try:
        writer.announce(range(40))
        monkeypatch.setattr(redis_tier, "pipelined", interleaved)
        found = reader[[*range(40), 7]]
        assert not armed and found.n_tokens == 40
        assert np.array_equal(found.seq_bytes(), state.seq_bytes())
    finally:
        writer.close()
        reader.close()


def test_a_store_landing_between_a_lookups_two_round_trips_is_waited_for_not_a_torn_hit(
        fresh: Deployment, monkeypatch: pytest.MonkeyPatch) -> None:
    from llama_cache.caches import redis_tier

    writer = LlamaRedisCache(fresh.url, 10**8, fingerprint="test", chunk_tokens=8, in_flight_seconds=60)
    reader = LlamaRedisCache(fresh.url, 10**8, fingerprint="test", chunk_tokens=8, in_flight_seconds=60)
    turn = make_cut_state(range(45), 45 * 100)
    writer[range(20)] = turn.prefix(20, None)  # the chain breaks after two chunks: a second trip
    real = redis_tier.pipelined
    armed = [True]

    def between(client: Any, commands: Sequence[tuple[Any, tuple[Any, ...]]], **options: Any) -> list[Any]:
        if armed and not any(args[0] == "MGET" for _, args in commands):  # the reader's second trip
            armed.clear()
            writer[range(45)] = turn  # lands after the first trip read the chain, before the second
        return real(client, commands, **options)

    try:
        writer.announce(range(45))
        monkeypatch.setattr(redis_tier, "pipelined", between)
        found = reader[[*range(45), 99, 98]]
        assert not armed and reader.waits == 1
        assert found.n_tokens == 45  # the whole view after the store, not its children beside the chain before
        assert np.array_equal(found.seq_bytes(), turn.seq_bytes())
    finally:
        writer.close()
        reader.close()
