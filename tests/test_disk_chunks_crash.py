"""Chunked entries survive writers killed at any instant: no broken chain, no leaked chunk, exact bytes.

A zygote process forks writers that store states sharing prefixes (so chunks are shared, partial tails
absorbed, and entries evicted from a small capacity), delete some and look some up; the test kills
each with SIGKILL at a random instant (or the writer kills itself right after writing a payload file),
then opens the directory and checks every entry against the bytes
:func:`tests.test_disk_chunks.kv_state` makes for its tokens.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from llama_cache.caches.disk import LlamaDiskCache
from tests.test_disk_chunks import REPO, assert_sound, kv_state, restores_exactly

# Entries are 2 to 10 files of a block (4 KiB) each, much of it shared, and an empty cache takes
# 76 KiB: stores keep evicting.
CAPACITY = 160 << 10
CHUNK_TOKENS = 4

_ZYGOTE = textwrap.dedent(
    f"""
    import os, random, signal, sys
    from llama_cache.caches.disk import LlamaDiskCache
    from tests.test_disk_chunks import kv_state, restores_exactly

    # Three shared prefixes (none a multiple of the chunk length), then a few tokens of a small
    # alphabet (so branches and partial tails recur), then 0, which ends every key and nothing else:
    # no key is a prefix of another, so each key is its own best entry.
    PREFIXES = [list(range(10, 20)), list(range(10, 17)) + [50] * 6, list(range(30, 52))]

    def make_key(rng):
        return rng.choice(PREFIXES) + [rng.randrange(1, 4) for _ in range(rng.randrange(0, 10))] + [0]

    def child(seed, directory, writes):
        if writes:  # SIGKILL itself right after its writes-th payload file, before the index names it
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
        cache = LlamaDiskCache(directory, capacity_bytes={CAPACITY}, chunk_tokens={CHUNK_TOKENS},
                               write_behind=rng.random() < 0.5)
        while True:
            draw = rng.random()
            if draw < 0.7:
                key = make_key(rng)
                cache[key] = kv_state(key, logits=rng.random() < 0.5)
            elif draw < 0.85:
                keys = list(cache.keys())
                if keys:
                    try:
                        del cache[rng.choice(keys)]
                    except KeyError:  # deleted by the write-behind thread's eviction meanwhile
                        pass
            else:
                try:
                    state = cache.lookup_prefix(make_key(rng))
                except KeyError:
                    continue
                if not restores_exactly(state):
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


def _verify(directory: Path) -> tuple[int, int]:
    """Every entry restores exactly; the index and the files agree once orphans are swept. Returns the
    bytes the directory took as the budget counts them and the orphan files the kill left."""
    with LlamaDiskCache(directory, CAPACITY, chunk_tokens=CHUNK_TOKENS, write_behind=False) as cache:
        size = cache.disk_usage
        assert cache.cache_size < size <= CAPACITY
        report = cache.check()
        assert report.index_ok and report.problems == () and report.leaked_chunks == (), report
        for key in cache.keys():
            state = cache[key]
            assert restores_exactly(state, key)
            if state.logits is not None:
                assert np.array_equal(state.logits, kv_state(key, logits=True).logits)
        cache.check(fix=True, grace_seconds=0)  # orphans of killed writes are the only leftovers
        assert_sound(cache)
    return size, len(report.orphan_files)


ROUNDS = 30
FILLING_WRITES = 120  # the first writer's payload files before it dies: enough to fill the capacity


def test_chunked_writers_killed_at_random_instants_leave_exact_entries(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every third writer kills itself right after writing a payload file (an orphan, by construction);
    the others are killed by the test at a random instant. Bounded by rounds, not by time."""
    directory = tmp_path / "cache"
    zygote = subprocess.Popen(
        [sys.executable, "-c", _ZYGOTE, str(directory)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
    )
    assert zygote.stdin is not None and zygote.stdout is not None
    rng = random.Random(2026)
    sizes, orphans = [], []
    try:
        with caplog.at_level(logging.WARNING, logger="llama_cache"):
            for round_ in range(ROUNDS):
                writes = 0 if round_ % 3 else FILLING_WRITES if round_ == 0 else rng.randrange(1, 40)
                zygote.stdin.write(f"spawn {round_} {writes}\n")
                zygote.stdin.flush()
                pid = int(zygote.stdout.readline())
                if not writes:
                    time.sleep(rng.uniform(0.02, 0.4))
                    os.kill(pid, signal.SIGKILL)
                zygote.stdin.write(f"reap {pid} 0\n")
                zygote.stdin.flush()
                status = int(zygote.stdout.readline())
                # Killed, not exited: a child that read wrong bytes exits with 3.
                assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
                size, orphaned = _verify(directory)
                sizes.append(size)
                orphans.append(orphaned)
    finally:
        zygote.stdin.close()
        zygote.wait(timeout=10)
        zygote.stdout.close()
    assert sizes[0] > CAPACITY * 0.7  # the capacity was reached: stores evicted
    assert all(orphans[round_] > 0 for round_ in range(0, ROUNDS, 3))  # the self-killed writers' files
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]
