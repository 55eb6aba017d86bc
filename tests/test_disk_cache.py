"""LlamaDiskCache: the shared contract, persistence, crash safety, damage, several processes, a real model."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llama_cache.caches import disk
from llama_cache.caches.disk import LlamaDiskCache, payloads, schema
from llama_cache.inspection import add_inspect_command, run_inspect
from llama_cache.state.format import encode, encoded_size
from llama_cache.state.chunks import default_chunk_tokens, encode_chunk, encode_head, pieces
from llama_cache.state.llama_state import LlamaState
from llama_cache.testing.states import synthetic_state
from tests.cache_contract import CacheContract

REPO = Path(__file__).resolve().parents[1]


def make_state(
    tokens: Sequence[int], nbytes: int = 1000, fingerprint: str = "test", logits: bool = False
) -> LlamaState:
    """A real opaque (recurrent-like) state whose bytes are a pattern derived from its last token."""
    tokens = np.asarray(list(tokens), dtype=np.int32)
    last = int(tokens[-1]) if len(tokens) else 0
    opaque = ((np.arange(nbytes, dtype=np.int64) * (last + 1)) % 251).astype(np.uint8)
    row = np.full(16, last, dtype=np.float32) if logits else None
    return LlamaState(tokens, row, 0, fingerprint, opaque=opaque)


def make_cut_state(
    tokens: Sequence[int], nbytes: int = 1000, fingerprint: str = "test", logits: bool = False
) -> LlamaState:
    """A real transformer-like state (it can be cut back) of about ``nbytes`` llama.cpp bytes."""
    tokens = np.asarray(list(tokens), dtype=np.int32)
    n = len(tokens)
    row = max(2, (nbytes // (4 * max(n, 1))) & ~1)  # bytes per token of each K row
    last = np.full(16, n, dtype=np.float32) if logits else None
    rng = np.random.default_rng(int(tokens.sum()) + n)
    return synthetic_state(tokens, row, rng, fingerprint=fingerprint, logits=last)


BLOCK = max(512, os.statvfs(tempfile.gettempdir()).f_frsize)  # the file system's block, where tmp_path lives


def on_disk(size: int) -> int:
    """What a file of ``size`` bytes takes on disk (whole blocks), as the cache charges it."""
    return -(-size // BLOCK) * BLOCK


def disk_size(state: LlamaState, chunk_tokens: int | None = None) -> int:
    """Bytes a state's files take in an empty disk cache (whole blocks): its payload, or its chain head
    and chunks."""
    if state.layout is None:
        return on_disk(encoded_size(encode(state)))
    size = chunk_tokens or default_chunk_tokens(state.layout)
    chain = pieces(state.fingerprint, state.tokens, size)
    return on_disk(encoded_size(encode_head(state, size))) + sum(
        on_disk(encoded_size(encode_chunk(state.fingerprint, piece, state.layout, state.segments))) for piece in chain
    )


def pattern_ok(state: LlamaState) -> bool:
    last = int(state.tokens[-1]) if state.n_tokens else 0
    data = np.asarray(state.seq_bytes())
    expected = ((np.arange(len(data), dtype=np.int64) * (last + 1)) % 251).astype(np.uint8)
    return bool(np.array_equal(data, expected))


# -- the contract ---------------------------------------------------------------------------------


class _DiskContract(CacheContract):
    """Cuttable (transformer) states answer by longest common prefix; opaque (recurrent) ones only
    queries their whole key prefixes."""

    policy = "longest_common_prefix"
    write_behind = True
    maker: Any = staticmethod(make_cut_state)

    @pytest.fixture(autouse=True)
    def _directory(self, open_cache: Any) -> None:
        self._open = open_cache

    def make_cache(self, capacity_bytes: int) -> Any:
        return self._open(capacity_bytes, write_behind=self.write_behind)

    def make_state(self, tokens: Sequence[int], nbytes: int = 1000) -> Any:
        return self.maker(tokens, nbytes)

    def make_state_of(self, tokens: Sequence[int], fingerprint: str) -> Any:
        return self.maker(tokens, 1000, fingerprint=fingerprint)

    def size_of(self, state: Any) -> int:
        return disk_size(state)  # the bytes of its payload file

    def tokens_of(self, state: Any) -> tuple[int, ...]:
        return tuple(state.tokens.tolist())

    def test_replacing_a_key_never_overcounts(self) -> None:
        # Unlike the in-memory tiers, a store of the same tokens under a key is not written again
        # (only touched); a state with logits replaces one without.
        cache = self.make_cache(10**6)
        first = self.make_state([1, 2], nbytes=3000)
        cache[[1, 2]] = first
        size_one = cache.cache_size
        for _ in range(3):
            cache[[1, 2]] = self.make_state([1, 2], nbytes=5000)
        assert len(cache) == 1 and cache.cache_size == size_one == self.size_of(first)
        assert cache.stats().writes == 1
        with_logits = self.maker([1, 2], 3000, logits=True)  # the same KV as ``first``
        cache[[1, 2]] = with_logits
        assert len(cache) == 1 and cache.cache_size == self.size_of(with_logits)
        assert cache[[1, 2]].logits is not None and cache.stats().writes == 2


class TestDiskCacheContract(_DiskContract):
    write_behind = True


class TestDiskCacheContractSynchronous(_DiskContract):
    write_behind = False


class TestDiskCacheContractRecurrentStates(_DiskContract):
    policy = "whole_key_prefix"
    maker = staticmethod(make_state)


# -- persistence, namespaces, write-behind ---------------------------------------------------------


def test_a_new_instance_sees_entries_and_lru_order(open_cache: Any) -> None:
    size = disk_size(make_state([1]))
    first = open_cache(3 * size + size // 2)
    for token in (1, 2, 3):
        first[[token]] = make_state([token])
    first[[1]]  # 2 is now the least recently used
    first.close()

    second = open_cache(3 * size + size // 2)
    assert len(second) == 3 and second.cache_size == 3 * size
    assert list(second.keys()) == [(2,), (3,), (1,)]
    assert pattern_ok(second[[3]])  # 2 stays the oldest
    second[[4]] = make_state([4])
    assert [2] not in second and all([t] in second for t in (1, 3, 4))
    assert second.stats().evictions == 1
    assert [entry.hits for entry in second.entries()] == [1, 1, 0]  # 1, 3, 4


def test_re_storing_a_key_keeps_its_hit_count(open_cache: Any) -> None:
    cache = open_cache(write_behind=False)
    cache[[1, 2]] = make_state([1, 2])
    cache[[1, 2, 3]]
    cache[[1, 2, 4]]
    cache[[1, 2]] = make_state([1, 2], logits=True)  # a completion re-storing its prompt, now with logits
    (entry,) = cache.entries()
    assert entry.hits == 2 and cache.stats().writes == 2


def test_one_directory_serves_two_models_without_mixing_them(open_cache: Any) -> None:
    model_a = open_cache(fingerprint="model-a")
    model_b = open_cache(fingerprint="model-b")
    model_a[[1, 2, 3]] = make_state([1, 2, 3], 500, fingerprint="model-a")
    model_b[[1, 2, 3]] = make_state([1, 2, 3], 700, fingerprint="model-b")
    model_b[[9]] = make_state([9], fingerprint="model-b")
    assert model_a[[1, 2, 3, 4]].fingerprint == "model-a"
    assert model_b[[1, 2, 3, 4]].fingerprint == "model-b"
    assert [9] in model_b and [9] not in model_a
    with pytest.raises(KeyError):
        model_a[[9]]
    assert len(model_a) == len(model_b) == 3  # one directory, one budget
    unbound = open_cache()
    assert unbound[[1, 2, 3, 4]].fingerprint == "model-b"  # most recently used of the tie
    unbound.bind("model-a")
    assert unbound[[1, 2, 3]].fingerprint == "model-a"
    del model_a[[1, 2, 3]]
    assert [1, 2, 3] not in model_a and model_b[[1, 2, 3]].fingerprint == "model-b"


def test_write_behind_returns_before_the_write_and_lookups_wait_for_it(
    open_cache: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = open_cache()
    writing, release = threading.Event(), threading.Event()
    writers: list[threading.Thread] = []
    real_write = payloads.write_all

    def slow_write(fd: int, data: Any) -> None:
        writers.append(threading.current_thread())
        writing.set()
        assert release.wait(10)
        real_write(fd, data)

    monkeypatch.setattr(payloads, "write_all", slow_write)
    cache[[1, 2]] = make_state([1, 2], 100_000)
    # The caller did not wait for the disk: the write, held until release, runs on another thread.
    assert writing.wait(10) and not release.is_set()
    assert writers and threading.current_thread() not in writers
    threading.Timer(0.2, release.set).start()
    assert pattern_ok(cache[[1, 2]])  # the lookup waited for the queued write
    cache[[3]] = make_state([3])
    cache.flush()
    assert len(open_cache(write_behind=False)) == 2


def test_compressed_entries_round_trip(open_cache: Any) -> None:
    cache = open_cache(compress=1)
    state = make_state([5, 6], 50_000)
    cache[[5, 6]] = state
    got = cache[[5, 6, 7]]
    assert pattern_ok(got) and cache.entries()[0].codec == "zlib"
    assert open_cache(compress="zlib").compress == 6
    assert cache.cache_size < disk_size(state)  # the pattern compresses
    assert cache.check(deep=True).ok


def test_fsync_mode_stores_and_reads(open_cache: Any) -> None:
    cache = open_cache(fsync=True, write_behind=False)
    cache[[1]] = make_state([1])
    assert pattern_ok(cache[[1]])


def test_values_it_cannot_store_are_logged_and_counted_never_raised(
    open_cache: Any, caplog: pytest.LogCaptureFixture
) -> None:
    cache = open_cache()
    unfingerprinted = make_state([1])
    unfingerprinted.fingerprint = ""
    with caplog.at_level(logging.WARNING, logger="llama_cache"):
        cache[[1]] = b"not a state"
        cache[[1]] = unfingerprinted
        cache[[7, 8]] = make_state([1, 2])  # a state that does not hold its key's tokens
    assert len(cache) == 0 and cache.stats().store_errors == 3
    assert sum("not caching" in record.message for record in caplog.records) == 3
    with pytest.raises(ValueError):
        cache[[1, -1]] = make_state([1])  # a bad key still raises


def _segmented_state(n: int, seq_id: int = 0, shuffled: bool = False) -> LlamaState:
    """A transformer-like state: llama.cpp's per-sequence bytes for 2 layers, V transposed."""
    rng = np.random.default_rng(n)
    cells = np.zeros(n, dtype=[("pos", "<i4"), ("n_seq", "<u4"), ("seq", "<i4")])
    cells["pos"] = rng.permutation(n) if shuffled else np.arange(n)
    cells["n_seq"] = 1
    cells["seq"] = seq_id
    parts = [np.array([0xAF143CD8, seq_id, 1, n], "<u4").tobytes(), cells.tobytes(), np.array([1, 2], "<u4").tobytes()]
    for _ in range(2):
        parts += [np.array([1], "<i4").tobytes(), np.array([8], "<u8").tobytes(), rng.bytes(8 * n)]
    for _ in range(2):
        parts += [np.array([1], "<i4").tobytes(), np.array([2, 4], "<u4").tobytes(), rng.bytes(4 * n * 2)]
    raw = np.frombuffer(b"".join(parts), dtype=np.uint8)
    logits = rng.standard_normal(16).astype(np.float32)
    state = LlamaState.from_seq_bytes(np.arange(n, dtype=np.int32), logits, 0, "test", raw)
    assert state.layout is not None
    return state


@pytest.mark.parametrize("shuffled", [False, True], ids=["in-order", "cells-out-of-order"])
def test_loaded_states_serve_llama_cpp_bytes_from_the_mapping(open_cache: Any, shuffled: bool) -> None:
    from llama_cache.state.kv_layout import serialize_segments

    original = _segmented_state(50, shuffled=shuffled)
    cache = open_cache()
    cache[range(50)] = original
    loaded = cache[range(50)]
    assert isinstance(loaded, LlamaState) and loaded.layout == original.layout
    for seq_id in (0, 3):
        expected = serialize_segments(original.layout, list(original.segments), seq_id)
        assert np.array_equal(np.asarray(loaded.seq_bytes(seq_id)), expected)
    # Stored as chunks and read back as views of their mapped files: one segment per chunk.
    assert len(loaded.segments) == -(-50 // default_chunk_tokens(original.layout)) == cache.storage().chunks
    head = loaded.prefix(20, None)
    assert np.array_equal(head.seq_bytes(0), original.prefix(20, None).seq_bytes(0))
    assert np.array_equal(loaded.logits, original.logits)


# -- damage --------------------------------------------------------------------------------------


def _file_of(cache: LlamaDiskCache, n_tokens: int | None = None) -> Path:
    entries = cache.entries()
    entry = entries[-1] if n_tokens is None else next(e for e in entries if e.n_tokens == n_tokens)
    return cache.cache_dir / disk.DATA_DIR / entry.file


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as file:
        file.truncate(path.stat().st_size // 2)


@pytest.mark.parametrize("damage", [_flip_last_byte, _truncate, Path.unlink], ids=["tampered", "truncated", "missing"])
def test_a_damaged_payload_is_a_logged_miss_and_is_cleaned_up(
    open_cache: Any, caplog: pytest.LogCaptureFixture, damage: Any
) -> None:
    cache = open_cache(write_behind=False)
    cache[[1, 2, 3]] = make_cut_state([1, 2, 3], 5000)
    cache[[1, 2, 4]] = make_cut_state([1, 2, 4], 5000)
    damage(_file_of(cache))  # [1, 2, 4], the most recently used
    with caplog.at_level(logging.WARNING, logger="llama_cache"):
        assert tuple(cache[[1, 2, 9]].tokens) == (1, 2, 3)  # the next best entry answers
    assert any("dropping entry" in record.message for record in caplog.records)
    assert len(cache) == 1 and cache.cache_size == disk_size(make_cut_state([1, 2, 3], 5000))
    damage(_file_of(cache))
    with pytest.raises(KeyError):
        cache[[1, 2, 9]]
    assert len(cache) == 0 and cache.stats().misses == 1
    assert cache.check(deep=True).ok  # rows and files were both removed


def test_a_payload_from_another_namespace_is_refused(open_cache: Any) -> None:
    cache = open_cache(write_behind=False)
    cache[[1]] = make_state([1], fingerprint="aa")
    cache[[2]] = make_state([2], fingerprint="bb")  # same bytes length, other model
    entries = {entry.namespace: entry for entry in cache.entries()}
    data_dir = cache.cache_dir / disk.DATA_DIR
    (data_dir / entries["bb"].file).write_bytes((data_dir / entries["aa"].file).read_bytes())
    cache.bind("bb")
    with pytest.raises(KeyError):
        cache[[2]]
    assert len(cache) == 1


def test_check_finds_and_fixes_every_kind_of_inconsistency(open_cache: Any) -> None:
    cache = open_cache(write_behind=False)
    for token in range(4):
        cache[[token]] = make_state([token], 3000)
    assert len(cache.entries()) == 4
    data_dir = cache.cache_dir / disk.DATA_DIR
    by_key = {tuple(k): e.file for k, e in zip(cache.keys(), cache.entries())}
    (data_dir / by_key[(0,)]).unlink()
    _truncate(data_dir / by_key[(1,)])
    _flip_last_byte(data_dir / by_key[(2,)])
    orphan = data_dir / "ab" / ("0" * 32 + ".llst")
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"left by a crash")
    quick = cache.check()
    assert len(quick.missing_files) == 1 and len(quick.size_mismatches) == 1 and not quick.corrupt_files
    assert quick.orphan_files == ("ab/" + "0" * 32 + ".llst",) and not quick.ok
    deep = cache.check(deep=True)
    assert len(deep.problems) == 3
    fixed = cache.check(fix=True, deep=True)  # the orphan is younger than the grace period: kept
    assert fixed.removed_entries == 3 and fixed.removed_files == 0 and orphan.exists()
    assert cache.check(fix=True, grace_seconds=0).removed_files == 1
    assert cache.check(deep=True).ok
    assert list(cache.keys()) == [(3,)] and pattern_ok(cache[[3]])


def test_a_full_disk_leaves_the_rest_of_the_cache_intact(
    open_cache: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cache = open_cache()
    cache[[1]] = make_state([1], 4000)
    cache[[2]] = make_state([2], 4000)
    cache.flush()
    real_write = payloads.write_all

    def full_disk(fd: int, data: Any) -> None:
        real_write(fd, memoryview(data)[: len(memoryview(data)) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(payloads, "write_all", full_disk)
    with caplog.at_level(logging.WARNING, logger="llama_cache"):
        cache[[1]] = make_state([1], 9000, logits=True)  # a replacement that cannot be written
        cache[[3]] = make_state([3], 4000)
        assert pattern_ok(cache[[1]]) and len(cache[[1]].seq_bytes()) == 4000  # the old entry survives
    assert [3] not in cache and len(cache) == 2 and cache.write_errors == 2
    assert cache.stats().store_errors == 2 and cache.stats().writes == 2
    assert any("no space left" in record.message for record in caplog.records)
    assert cache.check().ok  # no partial file left behind
    monkeypatch.setattr(payloads, "write_all", real_write)
    cache[[3]] = make_state([3], 4000)
    assert pattern_ok(cache[[3]])


def test_change_log_trimming_makes_a_lagging_process_rebuild(
    open_cache: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(schema, "_TRIM_EVERY", 10)
    monkeypatch.setattr(schema, "_TRIM_KEEP", 3)
    size = disk_size(make_state([0]))
    writer = open_cache(8 * size, write_behind=False)
    reader = open_cache(8 * size)
    assert len(reader) == 0
    for token in range(40):
        writer[[token]] = make_state([token])
        if token % 7 == 6:
            writer[[token - 3]]  # touches are logged too
    assert list(reader.keys()) == list(writer.keys())
    assert len(reader) == len(writer) == 8 and reader.cache_size == writer.cache_size == 8 * size
    assert reader._store.view.last_seq == writer._store.view.last_seq
    assert pattern_ok(reader[[39]])


# -- several processes -----------------------------------------------------------------------------

_SCRIPT_HEAD = """
import os, sys, random, time
import numpy as np
from llama_cache.caches.disk import LlamaDiskCache
from llama_cache.state.llama_state import LlamaState

def make_state(tokens, nbytes):
    tokens = np.asarray(tokens, dtype=np.int32)
    last = int(tokens[-1])
    opaque = ((np.arange(nbytes, dtype=np.int64) * (last + 1)) % 251).astype(np.uint8)
    return LlamaState(tokens, None, 0, "test", opaque=opaque)

def pattern_ok(state):
    last = int(state.tokens[-1])
    data = np.asarray(state.seq_bytes())
    return bool(np.array_equal(data, ((np.arange(len(data), dtype=np.int64) * (last + 1)) % 251).astype(np.uint8)))
"""


def _run_python(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


_KILL_ZYGOTE = _SCRIPT_HEAD + textwrap.dedent(
    """
    # Forks writers on demand: each child starts in milliseconds (imports are done), so the parent can
    # kill many of them at random moments within the time budget.
    def child(seed, directory, writes):
        if writes:  # SIGKILL itself right after its writes-th payload file, before the index names it
            import signal
            from llama_cache.caches.disk import payloads
            write, written = payloads.DataDir.write, []

            def write_then_die(*args, **kwargs):
                size = write(*args, **kwargs)
                written.append(size)
                if len(written) == writes:
                    os.kill(os.getpid(), signal.SIGKILL)
                return size

            payloads.DataDir.write = write_then_die
        rng = random.Random(seed)
        cache = LlamaDiskCache(directory, capacity_bytes=3_000_000, write_behind=rng.random() < 0.5)
        while True:
            key = [rng.randrange(6), rng.randrange(6), rng.randrange(400)]
            if rng.random() < 0.75:
                cache[key] = make_state(key, 2_000 + (key[2] * 7919) % 60_000)
            else:
                try:
                    state = cache[key]
                except KeyError:
                    continue
                if not pattern_ok(state) or state.n_tokens != 3:
                    os._exit(3)

    directory = sys.argv[1]
    for line in sys.stdin:
        command, value, writes = line.split()
        if command == "spawn":
            pid = os.fork()
            if pid == 0:
                try:
                    child(int(value), directory, int(writes))
                finally:
                    os._exit(4)
            print(pid, flush=True)
        else:
            _, status = os.waitpid(int(value), 0)
            print(status, flush=True)
    """
)


def test_writers_killed_at_random_moments_never_corrupt_the_cache(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    directory = tmp_path / "cache"
    zygote = subprocess.Popen(
        [sys.executable, "-c", _KILL_ZYGOTE, str(directory)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
    )
    assert zygote.stdin is not None and zygote.stdout is not None
    rng = random.Random(1234)
    try:
        for kill in range(60):  # the first writer kills itself after 20 files: entries exist, by count
            zygote.stdin.write(f"spawn {kill} {20 if kill == 0 else 0}\n")
            zygote.stdin.flush()
            pid = int(zygote.stdout.readline())
            if kill > 0:
                time.sleep(rng.uniform(0.0, 0.25))
                os.kill(pid, signal.SIGKILL)
            zygote.stdin.write(f"reap {pid} 0\n")
            zygote.stdin.flush()
            status = int(zygote.stdout.readline())
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    finally:
        zygote.stdin.close()
        zygote.wait(timeout=10)
        zygote.stdout.close()

    with caplog.at_level(logging.WARNING, logger="llama_cache"):
        cache = LlamaDiskCache(directory, capacity_bytes=3_000_000, write_behind=False)
        try:
            keys = list(cache.keys())
            assert len(keys) > 10  # the children did store entries
            for key in keys:
                state = cache[key]  # an exact key is its own best entry
                assert tuple(state.tokens.tolist()) == key and pattern_ok(state)
            assert cache.cache_size <= 3_000_000
            report = cache.check(deep=True)
            assert report.index_ok and report.problems == ()
            sizes = [entry.size for entry in cache.entries()]  # whole states: no chunks
            assert report.bytes_indexed == sum(sizes) and cache.cache_size == sum(on_disk(size) for size in sizes)
            cache.check(fix=True, grace_seconds=0)  # orphans of killed writes are the only leftovers
            report = cache.check(deep=True)
            assert report.ok and report.disk_usage <= 3_000_000  # the orphans were all the budget missed
        finally:
            cache.close()
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]


_PEER = _SCRIPT_HEAD + textwrap.dedent(
    """
    directory, me, other = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    cache = LlamaDiskCache(directory, capacity_bytes=50_000_000)
    seen = set()
    deadline = time.monotonic() + 40
    for i in range(40):
        cache[[me, i, 7]] = make_state([me, i, 7], 3_000 + 100 * i)
        for j in range(40):
            if j not in seen and [other, j, 7] in cache:
                state = cache[[other, j, 7, 1]]
                if tuple(state.tokens.tolist()) == (other, j, 7):
                    assert pattern_ok(state)
                    seen.add(j)
    while len(seen) < 40 and time.monotonic() < deadline:
        for j in range(40):
            if j not in seen and [other, j, 7] in cache:
                assert pattern_ok(cache[[other, j, 7]])
                seen.add(j)
        time.sleep(0.01)
    cache.close()
    print(len(seen))
    """
)


def test_two_processes_write_and_read_concurrently(tmp_path: Path) -> None:
    directory = str(tmp_path / "cache")
    peers = [
        subprocess.Popen([sys.executable, "-c", _PEER, directory, str(me), str(1 - me)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        for me in (0, 1)
    ]
    outputs = [peer.communicate(timeout=90) for peer in peers]
    for peer, (out, err) in zip(peers, outputs):
        assert peer.returncode == 0, err
        assert out.split() == ["40"]  # each saw all 40 entries of the other
    cache = LlamaDiskCache(directory, write_behind=False)
    try:
        assert len(cache) == 80 and cache.check(deep=True).ok
    finally:
        cache.close()


_FORKER = _SCRIPT_HEAD + textwrap.dedent(
    """
    directory = sys.argv[1]
    cache = LlamaDiskCache(directory, capacity_bytes=50_000_000)
    cache[[1]] = make_state([1], 1000)
    assert pattern_ok(cache[[1]])
    for i in range(5):
        cache[[2, i]] = make_state([2, i], 50_000)  # still queued when fork() comes: drained first
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            assert all([2, i] in cache for i in range(5))
            cache[[3]] = make_state([3], 1000)  # the child's own connection and writer
            assert pattern_ok(cache[[3]]) and pattern_ok(cache[[2, 4]])
            cache.flush()
        except BaseException as error:
            print("child failed:", repr(error), file=sys.stderr)
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert pattern_ok(cache[[3]])  # the parent sees what the child stored
    cache[[4]] = make_state([4], 1000)
    cache[[5]] = make_state([5], 1000)
    # No flush, no close: the queued writes are drained at exit.
    """
)


def test_fork_and_exit_drain_pending_writes(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    result = _run_python(_FORKER, str(directory))
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and result.stderr == ""  # the cache prints nothing
    cache = LlamaDiskCache(directory, write_behind=False)
    try:
        assert sorted(cache.keys()) == [(1,), (2, 0), (2, 1), (2, 2), (2, 3), (2, 4), (3,), (4,), (5,)]
        assert cache.check(deep=True).ok
    finally:
        cache.close()


# -- the inspect command ---------------------------------------------------------------------------


def test_inspect_lists_entries_and_checks(open_cache: Any) -> None:
    cache = open_cache(write_behind=False)
    cache[[1, 2, 3]] = make_state([1, 2, 3], 2048, fingerprint="model-a")
    cache[[4]] = make_state([4], 1000, fingerprint="model-b")
    cache[[1, 2, 3]]
    parser = argparse.ArgumentParser()
    add_inspect_command(parser.add_subparsers(dest="command"), [])
    status, text = run_inspect(parser.parse_args(["inspect", str(cache.cache_dir), "--check"]))
    assert status == 0
    lines = text.splitlines()
    assert lines[1].split() == ["#", "tokens", "size", "codec", "namespace", "hits", "last", "access", "created"]
    assert lines[3].split()[:6] == ["1", "3", "2.1", "KiB", "raw", "model-a"]  # most recently used first
    assert "total: 2 entries" in text and "2 namespace(s)" in text and "no problem found" in text
    _file_of(cache, 1).unlink()
    status, text = run_inspect(parser.parse_args(["inspect", str(cache.cache_dir), "--check"]))
    assert status == 1 and "1 entries whose file is missing" in text
    status, text = run_inspect(parser.parse_args(["inspect", str(cache.cache_dir), "--fix"]))
    assert status == 0 and "removed 1 entries" in text and len(cache) == 1
    status, text = run_inspect(parser.parse_args(["inspect", str(cache.cache_dir / "nowhere")]))
    assert status == 2 and "no disk cache" in text


# -- a real model ----------------------------------------------------------------------------------

_PROMPT = (
    "The library keeps the model state of every prompt it has seen on disk, so a new process can "
    "answer a repeated question without evaluating it again. Question: what is the capital of France?"
    " Answer:"
)
_SUFFIX = " Please answer in one short sentence. Answer:"

_MODEL_CHILD = textwrap.dedent(
    """
    import json, sys
    import llama_cache
    from llama_cache.caches.disk import LlamaDiskCache
    from llama_cache.llama import Llama

    directory, prompt, suffix = sys.argv[1], sys.argv[2], sys.argv[3]
    llm = Llama(model_path=str(llama_cache.default_model_path()), n_ctx=1024, verbose=False, seed=0)
    cache = LlamaDiskCache(directory, fingerprint=llm.fingerprint)
    llm.set_cache(cache)
    results = []
    for text in (prompt, prompt + suffix):
        out = llm.create_completion(text, max_tokens=16, temperature=0)
        results.append([out["choices"][0]["text"], llm.last_prompt_tokens_evaluated])
    results.append(cache.stats().hits)
    cache.close()
    print(json.dumps(results))
    """
)


@pytest.mark.model
def test_a_hit_loaded_by_a_new_process_matches_a_cold_run(tmp_path: Path) -> None:
    import llama_cache
    from llama_cache.llama import Llama

    llm = Llama(model_path=str(llama_cache.default_model_path()), n_ctx=1024, verbose=False, seed=0)
    cold = []
    for text in (_PROMPT, _PROMPT + _SUFFIX):
        llm.reset()
        out = llm.create_completion(text, max_tokens=16, temperature=0)
        cold.append([out["choices"][0]["text"], llm.last_prompt_tokens_evaluated])
    llm.reset()
    directory = tmp_path / "cache"
    cache = LlamaDiskCache(directory, fingerprint=llm.fingerprint)
    llm.set_cache(cache)
    llm.create_completion(_PROMPT, max_tokens=16, temperature=0)  # a miss: prompt + answer stored
    llm.reset()
    llm.create_completion(_PROMPT, max_tokens=16, temperature=0)  # a repeat: the prompt's own state too
    assert llm.last_prompt_tokens_evaluated == 1
    cache.close()

    result = _run_python(_MODEL_CHILD, str(directory), _PROMPT, _SUFFIX, timeout=120)
    assert result.returncode == 0, result.stderr
    (same_text, same_evaluated), (longer_text, longer_evaluated), hits = json.loads(result.stdout)
    assert hits >= 2
    assert same_text == cold[0][0] and same_evaluated < cold[0][1]
    assert same_evaluated == 0  # an exact repeat samples from the stored logits
    assert longer_text == cold[1][0] and longer_evaluated < cold[1][1]


# -- llama-cpp-python's own states -----------------------------------------------------------------


def _upstream_state(tokens: list[int], n_ctx: int = 16, n_vocab: int = 8, fingerprint: str | None = None) -> Any:
    import llama_cpp

    input_ids = np.zeros(n_ctx, dtype=np.intc)
    input_ids[: len(tokens)] = tokens
    input_ids[len(tokens) :] = 3  # stale tokens past n_tokens, kept as they were
    scores = np.zeros((len(tokens), n_vocab), dtype=np.single)
    scores[-1] = np.arange(n_vocab)  # only the last row carries information
    raw = bytes(range(256)) * 3
    state = llama_cpp.llama.LlamaState(
        input_ids=input_ids, scores=scores, n_tokens=len(tokens), llama_state=raw, llama_state_size=len(raw), seed=42
    )
    if fingerprint is not None:
        state.fingerprint = fingerprint
    return state


def test_llama_cpp_python_states_round_trip_as_their_own_type(open_cache: Any) -> None:
    import llama_cpp

    cache = open_cache()
    original = _upstream_state([5, 6, 7])
    cache[[5, 6, 7, 8]] = original  # filed under the tokens the state holds
    loaded = cache[[5, 6, 7, 9]]
    assert type(loaded) is llama_cpp.llama.LlamaState
    assert np.array_equal(loaded.input_ids, original.input_ids) and loaded.input_ids.dtype == np.intc
    assert np.array_equal(loaded.scores, original.scores) and loaded.scores.dtype == np.single
    assert (loaded.n_tokens, loaded.llama_state, loaded.llama_state_size, loaded.seed) == (
        3, original.llama_state, original.llama_state_size, 42
    )
    assert not hasattr(loaded, "fingerprint")
    (entry,) = cache.entries()
    assert (entry.namespace, entry.n_tokens, entry.kind) == (disk.UNBOUND_NAMESPACE, 3, "llama_cpp")
    # Only the informative score row is on disk: far less than the whole matrix.
    assert entry.size < original.scores.nbytes + len(original.llama_state) + 2 * original.input_ids.nbytes + 400


def test_llama_cpp_python_states_are_filed_by_fingerprint_then_binding(open_cache: Any) -> None:
    cache = open_cache(write_behind=False)
    cache[[1, 2]] = _upstream_state([1, 2], fingerprint="model-a")
    cache.bind("model-b")
    cache[[3, 4]] = _upstream_state([3, 4])
    assert sorted(entry.namespace for entry in cache.entries()) == ["model-a", "model-b"]
    assert [3, 4] in cache and [1, 2] not in cache
    cache.bind("model-a")
    assert cache[[1, 2]].fingerprint == "model-a"


# -- the models of the namespaces ----------------------------------------------------------------


def test_inspect_names_the_model_of_each_namespace(open_cache: Any) -> None:
    cache = open_cache(write_behind=False)
    cache.bind("model-a", model_info={"file": "tiny.gguf", "desc": "llama 135M Q4_1", "n_params": "134515008"})
    cache[[1, 2, 3]] = make_state([1, 2, 3], fingerprint="model-a")
    cache[[4]] = make_state([4], fingerprint="model-b")
    assert cache.models() == {"model-a": {"file": "tiny.gguf", "desc": "llama 135M Q4_1", "n_params": "134515008"}}
    parser = argparse.ArgumentParser()
    add_inspect_command(parser.add_subparsers(dest="command"), [])
    status, text = run_inspect(parser.parse_args(["inspect", str(cache.cache_dir)]))
    assert status == 0
    assert "namespace model-a (tiny.gguf, llama 135M Q4_1, 135M params): 1 entries" in text
    assert "namespace model-b: 1 entries" in text
    with pytest.raises(TypeError):
        cache.bind("model-a", model_info={"file": 3})  # type: ignore[dict-item]
    with pytest.raises(ValueError):
        cache.bind(None, model_info={"file": "x"})


PLAIN_PROMPT = "Q: What is the capital of France?\nA:"


def plain_cold_answer(model: str) -> str:
    """``PLAIN_PROMPT``'s greedy answer from a plain ``llama_cpp.Llama`` with no cache."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=model, n_ctx=512, verbose=False, seed=0)
    try:
        return str(llm(PLAIN_PROMPT, max_tokens=16, temperature=0)["choices"][0]["text"])
    finally:
        llm.close()

_PLAIN_CHILD = textwrap.dedent(
    """
    import json, sys
    import llama_cpp
    import llama_cache
    from llama_cache.caches.disk import LlamaDiskCache

    llm = llama_cpp.Llama(model_path=str(llama_cache.default_model_path()), n_ctx=512, verbose=False, seed=0)
    cache = LlamaDiskCache(sys.argv[1])
    llm.set_cache(cache)
    out = llm(sys.argv[2], max_tokens=16, temperature=0)
    print(json.dumps([out["choices"][0]["text"], cache.stats().hits]))
    """
)


@pytest.mark.model
def test_a_plain_llama_cpp_llama_uses_the_disk_cache_unchanged(tmp_path: Path) -> None:
    import llama_cpp

    import llama_cache

    model = str(llama_cache.default_model_path())
    cold = plain_cold_answer(model)
    directory = tmp_path / "cache"
    llm = llama_cpp.Llama(model_path=model, n_ctx=512, verbose=False, seed=0)
    cache = LlamaDiskCache(directory)
    llm.set_cache(cache)  # the spec's example, unchanged
    first = llm(PLAIN_PROMPT, max_tokens=16, temperature=0)["choices"][0]["text"]
    cache.flush()
    files = sorted(p.name for p in (directory / disk.DATA_DIR).rglob("*.llst"))
    assert cache.stats().writes == 1 and len(files) == 1
    second = llm(PLAIN_PROMPT, max_tokens=16, temperature=0)["choices"][0]["text"]
    stats = cache.stats()  # waits for the queued store
    assert first == second == cold and stats.hits == 1
    # The second completion stored the state it had just restored: nothing new was written.
    assert stats.writes == 1 and sorted(p.name for p in (directory / disk.DATA_DIR).rglob("*.llst")) == files
    cache.close()

    result = _run_python(_PLAIN_CHILD, str(directory), PLAIN_PROMPT, timeout=120)
    assert result.returncode == 0, result.stderr
    text, hits = json.loads(result.stdout)
    assert text == cold and hits == 1

    rebound = LlamaDiskCache(directory, write_behind=False)
    rebound.bind(llm)  # a plain Llama's fingerprint and its model's name
    assert rebound.fingerprint is not None and len(rebound.fingerprint) == 32
    (info,) = rebound.models().values()
    assert info["file"] == Path(model).name and int(info["n_params"]) > 0
    rebound.close()


@pytest.mark.model
def test_after_a_pure_hit_a_completion_writes_no_new_payload(tmp_path: Path) -> None:
    import llama_cache
    from llama_cache.llama import Llama

    llm = Llama(model_path=str(llama_cache.default_model_path()), n_ctx=512, verbose=False, seed=0)
    directory = tmp_path / "cache"
    cache = LlamaDiskCache(directory, fingerprint=llm.fingerprint)
    llm.set_cache(cache)
    first = llm.create_completion(PLAIN_PROMPT, max_tokens=8, temperature=0)["choices"][0]["text"]
    llm.reset()
    # The first repeat evaluates the prompt's last token again and stores the prompt's own state.
    assert llm.create_completion(PLAIN_PROMPT, max_tokens=8, temperature=0)["choices"][0]["text"] == first
    assert llm.last_prompt_tokens_evaluated == 1
    cache.flush()
    files = sorted(p.name for p in (directory / disk.DATA_DIR).rglob("*.llst"))
    writes, hits = cache.stats().writes, cache.stats().hits
    assert len(files) == len(cache) + cache.storage().chunks and writes >= 2
    llm.reset()
    second = llm.create_completion(PLAIN_PROMPT, max_tokens=8, temperature=0)["choices"][0]["text"]
    assert second == first and cache.stats().hits == hits + 1 and llm.last_prompt_tokens_evaluated == 0
    assert cache.stats().writes == writes
    assert sorted(p.name for p in (directory / disk.DATA_DIR).rglob("*.llst")) == files
    cache.close()
