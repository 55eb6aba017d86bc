"""LlamaDiskCache while another process rewrites, truncates or deletes its directory's files.

Nothing the directory holds may end the process: SQLite's shared-memory index (``-shm``) and memory-
mapped payloads both turned a file truncated by someone else into SIGBUS. Each test runs the cache in a
child process, tampers from this one, and asserts that the child exits normally. A damaged index is
moved aside and started again empty, counted in ``stats().index_resets``.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from llama_cache.caches import disk
from llama_cache.caches.disk import CacheDirectoryError, LlamaDiskCache
from llama_cache.state.llama_state import LlamaState

REPO = Path(__file__).resolve().parents[1]


def make_state(tokens: list[int], nbytes: int = 20_000) -> LlamaState:
    array = np.asarray(tokens, dtype=np.int32)
    return LlamaState(array, None, 0, "test", opaque=np.full(nbytes, tokens[0] % 251, np.uint8))


def _child(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )


def _died_of(child: subprocess.Popen[str]) -> str:
    out, err = child.communicate(timeout=300)
    if child.returncode < 0:
        return f"killed by {signal.Signals(-child.returncode).name}: {err[-2000:]}"
    assert child.returncode == 0, err[-2000:]
    return out


# Stores and looks up without pause, through the writer thread: every instant of a commit is exposed.
_BUSY_CHILD = """
    import logging, sys
    import numpy as np
    from llama_cache.caches.disk import LlamaDiskCache
    from llama_cache.state.llama_state import LlamaState
    logging.basicConfig(level=logging.CRITICAL)
    cache = LlamaDiskCache(sys.argv[1], capacity_bytes=4 << 20, chunk_tokens=0)
    print("ready", flush=True)
    hits = 0
    for i in range(int(sys.argv[2])):
        tokens = np.array([1 + i % 50, 2, 3], dtype=np.int32)
        cache[tokens] = LlamaState(tokens, None, 0, "test", opaque=np.full(20_000, i % 251, np.uint8))
        try:
            state = cache[[1 + (i * 7) % 50, 2, 3]]
        except KeyError:
            continue
        opaque = np.frombuffer(state.seq_bytes(), dtype=np.uint8)
        assert int(opaque.min()) == int(opaque.max()), "a wrong state"
        hits += 1
    cache.close()
    print("done", hits, flush=True)
"""


def test_rewriting_every_file_while_the_writer_commits_never_kills_the_process(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    child = _child(_BUSY_CHILD, str(directory), "1500")
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    rng = random.Random(7)
    rewrites = 0
    while child.poll() is None:  # until the child finishes its loop (or dies)
        # os.walk, not rglob: a shard folder may be removed (emptied) while it is listed.
        for path in [Path(root, name) for root, _, names in os.walk(directory) for name in names]:
            try:
                if not path.is_file():
                    continue
                size = path.stat().st_size
                if path.name == disk.INDEX_FILE and rng.random() < 0.9:
                    continue  # mostly spared: an index spoilt at once would be reset before any commit
                if path.parent.parent.name == disk.DATA_DIR and rng.random() < 0.2:
                    path.unlink()
                else:  # overwritten: cut to nothing, then garbage of any length up to what it was
                    with open(path, "wb") as handle:
                        handle.write(os.urandom(rng.randrange(size + 1)))
                rewrites += 1
            except OSError:
                pass  # gone meanwhile
    out = _died_of(child)
    assert out.startswith("done"), out
    assert rewrites > 0


_MAPPED_CHILD = """
    import sys
    import numpy as np
    from llama_cache.caches.disk import LlamaDiskCache
    cache = LlamaDiskCache(sys.argv[1], write_behind=False, chunk_tokens=0)
    state = cache[[1, 2, 3]]
    print("loaded", flush=True)
    sys.stdin.readline()  # the payload file is truncated meanwhile
    print("sum", int(np.frombuffer(state.seq_bytes(), dtype=np.uint8).sum(dtype=np.int64)), flush=True)
"""


def test_a_payload_truncated_after_a_lookup_leaves_the_state_intact(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    with LlamaDiskCache(directory, write_behind=False, chunk_tokens=0) as cache:
        cache[[1, 2, 3]] = make_state([1, 2, 3], 1 << 20)
        (entry,) = cache.entries()
    child = _child(_MAPPED_CHILD, str(directory))
    assert child.stdout is not None and child.stdout.readline() == "loaded\n"
    with open(directory / disk.DATA_DIR / entry.file, "r+b") as handle:
        handle.truncate(0)
    assert child.stdin is not None
    child.stdin.write("go\n")
    child.stdin.flush()
    out = _died_of(child)
    assert out == f"sum {1 << 20}\n", out


# -- a damaged index ------------------------------------------------------------------------------


def _fill(directory: Path) -> None:
    with LlamaDiskCache(directory, write_behind=False) as cache:
        for token in range(1, 5):
            cache[[token, 100]] = make_state([token, 100])


def test_a_damaged_index_is_moved_aside_and_started_again_empty(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "cache"
    _fill(directory)
    (directory / disk.INDEX_FILE).write_bytes(b"not a database at all" * 100)
    with caplog.at_level(logging.WARNING, logger="llama_cache"):
        with LlamaDiskCache(directory, write_behind=False) as cache:
            assert len(cache) == 0 and cache.stats().index_resets == 1
            cache[[1, 100]] = make_state([1, 100])
            assert cache[[1, 100]].n_tokens == 2
    assert any("damaged" in r.message for r in caplog.records)
    (aside,) = directory.glob(f"{disk.INDEX_FILE}.damaged-*")
    assert aside.read_bytes().startswith(b"not a database")
    with LlamaDiskCache(directory, write_behind=False) as cache:  # the new index is a good one
        assert len(cache) == 1 and cache.stats().index_resets == 0
        # The old entries' payloads are orphans now, reclaimed like any other.
        assert len(cache.check().orphan_files) == 4


def test_an_index_damaged_while_in_use_is_reset_without_raising(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "cache"
    _fill(directory)
    cache = LlamaDiskCache(directory, write_behind=False)
    assert cache[[1, 100]].n_tokens == 2
    with open(directory / disk.INDEX_FILE, "r+b") as handle:  # in place: the same file, spoilt
        handle.write(os.urandom(4096))
    with caplog.at_level(logging.WARNING, logger="llama_cache"):
        with pytest.raises(KeyError):
            cache[[1, 100]]
        cache[[7, 100]] = make_state([7, 100])
        assert cache[[7, 100]].n_tokens == 2
    assert cache.stats().index_resets == 1 and len(cache) == 1
    cache.close()


def test_an_index_deleted_or_replaced_while_in_use_is_followed(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    _fill(directory)
    first, second = LlamaDiskCache(directory, write_behind=False), LlamaDiskCache(directory, write_behind=False)
    assert len(first) == len(second) == 4
    (directory / disk.INDEX_FILE).unlink()
    first[[9, 100]] = make_state([9, 100])  # a new, empty index at the path
    assert len(second) == 1 and second[[9, 100]].n_tokens == 2  # both use it, no reset counted
    assert first.stats().index_resets == second.stats().index_resets == 0
    first.close()
    second.close()


def test_an_index_switched_to_wal_by_someone_else_never_maps_shared_memory(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    _fill(directory)
    cache = LlamaDiskCache(directory, write_behind=False)
    outsider = sqlite3.connect(directory / disk.INDEX_FILE, isolation_level=None)
    assert outsider.execute("PRAGMA journal_mode = WAL").fetchone()[0] == "wal"
    outsider.execute("DELETE FROM entries WHERE id = 1")
    outsider.close()
    (directory / f"{disk.INDEX_FILE}-wal").write_bytes(os.urandom(10_000))
    try:
        cache[[2, 100]]  # a hit or a miss, never a fault
    except KeyError:
        pass
    cache[[8, 100]] = make_state([8, 100])
    assert cache[[8, 100]].n_tokens == 2
    with open(f"/proc/{os.getpid()}/maps") as maps:
        assert "-shm" not in maps.read()
    cache.close()


def test_a_directory_that_cannot_be_used_still_raises(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(CacheDirectoryError):
        LlamaDiskCache(not_a_dir)
    blocked = tmp_path / "blocked"
    (blocked / disk.INDEX_FILE).mkdir(parents=True)  # the index cannot be created: not damage
    with pytest.raises(CacheDirectoryError, match="blocked"):
        LlamaDiskCache(blocked)


@pytest.mark.parametrize("how", ["emptied", "table dropped"])
def test_an_index_emptied_in_place_while_in_use_is_started_again(tmp_path: Path, how: str) -> None:
    directory = tmp_path / "cache"
    _fill(directory)
    cache = LlamaDiskCache(directory, write_behind=False)
    assert len(cache) == 4
    if how == "emptied":
        (directory / disk.INDEX_FILE).write_bytes(b"")  # the same file, now an empty database
    else:
        outsider = sqlite3.connect(directory / disk.INDEX_FILE, isolation_level=None)
        outsider.execute("DROP TABLE changes")
        outsider.close()
    with pytest.raises(KeyError):
        cache[[1, 100]]
    cache[[7, 100]] = make_state([7, 100])
    assert cache[[7, 100]].n_tokens == 2
    cache.close()


def test_an_index_left_in_wal_mode_by_an_earlier_version_keeps_its_entries(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    _fill(directory)
    earlier = sqlite3.connect(directory / disk.INDEX_FILE, isolation_level=None)  # as llama-cache did
    assert earlier.execute("PRAGMA journal_mode = WAL").fetchone()[0] == "wal"
    earlier.close()
    with LlamaDiskCache(directory, write_behind=False) as cache:
        assert len(cache) == 4 and cache[[3, 100]].n_tokens == 2
        assert cache.stats().index_resets == 0
        with open(f"/proc/{os.getpid()}/maps") as maps:
            assert "-shm" not in maps.read()
    with open(directory / disk.INDEX_FILE, "rb") as index:
        assert index.read(20)[18:20] == b"\x01\x01"  # a rollback journal again
