"""LlamaDiskCache against a hostile neighbour: the index and the payload folder are untrusted input.

Each test tampers with a real cache directory the way another user of a shared directory could, then
checks that the cache only misses (logged), never touches a file outside its folder, never blocks,
never allocates what a forged row asks for, and that ``check(fix=True)`` repairs what it finds. The
last tests run seeded loops of random tampering under real completions of the default model: one
tampers between completions, the other rewrites, truncates and deletes the files from another process
while completions run (LLAMA_CACHE_REWRITE_COMPLETIONS sets its length; LLAMA_CACHE_FUZZ_LONG=1 runs
both loops long).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llama_cache.caches import disk
from llama_cache.caches.disk import CacheDirectoryError, LlamaDiskCache
from llama_cache.inspection import add_inspect_command, run_inspect
from llama_cache.state.llama_state import LlamaState

REPO = Path(__file__).resolve().parents[1]


def make_state(tokens: list[int], nbytes: int = 2000, fingerprint: str = "test") -> LlamaState:
    array = np.asarray(tokens, dtype=np.int32)
    opaque = ((np.arange(nbytes, dtype=np.int64) * (tokens[-1] + 1)) % 251).astype(np.uint8)
    return LlamaState(array, None, 0, fingerprint, opaque=opaque)


@pytest.fixture
def sentinel(tmp_path: Path) -> Path:
    """A file outside the cache that nothing may remove or change."""
    outside = tmp_path / "outside"
    outside.mkdir()
    path = outside / "precious.txt"
    path.write_text("do not delete")
    return path


@pytest.fixture
def cache_dir(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "cache"
    with LlamaDiskCache(directory, write_behind=False) as cache:
        for token in range(1, 5):
            cache[[token, 100]] = make_state([token, 100])
    yield directory


def _sql(directory: Path, statement: str, *params: Any) -> None:
    conn = sqlite3.connect(directory / disk.INDEX_FILE, isolation_level=None)
    try:
        conn.execute(statement, params)
    finally:
        conn.close()


def _rows(directory: Path) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(directory / disk.INDEX_FILE)
    try:
        return conn.execute("SELECT id, file, size FROM entries ORDER BY id").fetchall()
    finally:
        conn.close()


def _inspect(directory: Path, *options: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    add_inspect_command(parser.add_subparsers(dest="command"), [])
    return run_inspect(parser.parse_args(["inspect", str(directory), *options]))


# -- paths outside the folder ---------------------------------------------------------------------


@pytest.mark.parametrize("forged", ["absolute", "dotdot"])
def test_a_row_naming_a_file_outside_the_folder_never_reaches_it(
    cache_dir: Path, sentinel: Path, forged: str, caplog: pytest.LogCaptureFixture
) -> None:
    name = str(sentinel) if forged == "absolute" else os.path.relpath(sentinel, cache_dir / disk.DATA_DIR)
    _sql(cache_dir, "UPDATE entries SET file = ?, size = ?, raw_size = ? WHERE id = 1", name, 13, 13)
    with caplog.at_level(logging.WARNING, logger="llama_cache"):
        cache = LlamaDiskCache(cache_dir, capacity_bytes=10**6, write_behind=False)
        with pytest.raises(KeyError):
            cache[[1, 100]]  # the forged row is not an entry: a miss
        assert len(cache) == 3
    assert any("malformed entries row #1" in r.message and "file" in r.message for r in caplog.records)
    # Eviction: fill the cache until every old entry is gone.
    for token in range(10, 400):
        cache[[token]] = make_state([token], 20_000)
    report = cache.check(fix=True, grace_seconds=0)
    assert report.removed_entries >= 1 and any("#1" in row for row in report.malformed_rows)
    assert cache.check().malformed_rows == ()
    cache.close()
    status, text = _inspect(cache_dir, "--fix", "--grace", "0")
    assert status == 0
    assert sentinel.read_text() == "do not delete"


def test_inspect_fix_removes_forged_rows_without_following_them(cache_dir: Path, sentinel: Path) -> None:
    _sql(cache_dir, "UPDATE entries SET file = ? WHERE id = 2", str(sentinel))
    _sql(cache_dir, "UPDATE entries SET file = ? WHERE id = 3", "../../outside/precious.txt")
    status, text = _inspect(cache_dir, "--check")
    assert status == 1 and "2 malformed rows" in text
    status, text = _inspect(cache_dir, "--fix")
    assert status == 0 and "removed 2 entries" in text
    assert sentinel.read_text() == "do not delete"
    with LlamaDiskCache(cache_dir) as cache:
        assert len(cache) == 2 and cache.check().ok is False  # the two payloads are orphans now
        assert cache.check(fix=True, grace_seconds=0).removed_files == 2
        assert cache.check().ok


@pytest.mark.parametrize("where", ["payload", "subdir", "data"])
def test_symbolic_links_in_the_folder_are_never_followed(
    cache_dir: Path, sentinel: Path, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    rows = _rows(cache_dir)
    file = rows[0][1]
    data = cache_dir / disk.DATA_DIR
    # The outside folder gets a perfect copy of the payload: following the link would succeed.
    outside_copy = sentinel.parent / Path(file).name
    shutil.copy(data / file, outside_copy)
    if where == "payload":
        (data / file).unlink()
        (data / file).symlink_to(outside_copy)
    elif where == "subdir":
        sub = data / Path(file).parent
        for other in sub.iterdir():
            if other.name != Path(file).name:
                shutil.copy(other, sentinel.parent / other.name)
        shutil.rmtree(sub)
        sub.symlink_to(sentinel.parent)
    else:
        moved = sentinel.parent / "data"
        shutil.copytree(data, moved)
        shutil.rmtree(data)
        data.symlink_to(moved)
    with caplog.at_level(logging.WARNING, logger="llama_cache"):
        with LlamaDiskCache(cache_dir, write_behind=False) as cache:
            with pytest.raises(KeyError):
                cache[[1, 100]]
            cache.check(fix=True, grace_seconds=0)
            cache.clear()
    assert outside_copy.exists() and sentinel.read_text() == "do not delete"
    if where == "data":
        assert len(list((sentinel.parent / "data").rglob("*.llst"))) == 4


# -- resources ------------------------------------------------------------------------------------

_BOMB_CHILD = textwrap.dedent(
    """
    import logging, resource, sys
    from llama_cache.caches.disk import LlamaDiskCache
    logging.basicConfig(level=logging.WARNING)
    cache = LlamaDiskCache(sys.argv[1], write_behind=False)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    hit = True
    try:
        cache[[7, 7, 7]]
    except KeyError:
        hit = False
    report = cache.check(deep=True)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(hit, (after - before) // 1024, len(report.malformed_rows) + len(report.corrupt_files))
    """
)


def test_a_forged_raw_size_cannot_exhaust_memory(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    with LlamaDiskCache(directory, write_behind=False, compress=1) as cache:
        cache[[7, 7, 7]] = make_state([7, 7, 7], 5000)
        (entry,) = cache.entries()
    # 640 MiB of zeros compress to about 600 KB: the payload becomes a decompression bomb.
    compressor = zlib.compressobj(9)
    zeros = bytes(16 << 20)
    bomb = b"".join(compressor.compress(zeros) for _ in range(64)) + compressor.flush()
    (directory / disk.DATA_DIR / entry.file).write_bytes(bomb)
    _sql(directory, "UPDATE entries SET size = ?, raw_size = ?", len(bomb), 640 << 20)
    result = subprocess.run(
        [sys.executable, "-c", _BOMB_CHILD, str(directory)], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    hit, grown_mib, flagged = result.stdout.split()
    assert hit == "False" and flagged == "1"
    assert int(grown_mib) < 400  # at most what a 3-token state may be, not the 640 MiB the row asks for
    assert "raw_size" in result.stderr


def test_a_fifo_in_place_of_a_payload_never_blocks(cache_dir: Path) -> None:
    file = _rows(cache_dir)[0][1]
    path = cache_dir / disk.DATA_DIR / file
    path.unlink()
    os.mkfifo(path)
    outcome: list[Any] = []

    def lookup() -> None:
        with LlamaDiskCache(cache_dir, write_behind=False) as cache:
            try:
                cache[[1, 100]]
                outcome.append("hit")
            except KeyError:
                outcome.append("miss")
            outcome.append(cache.check(fix=True, deep=True, grace_seconds=0))

    worker = threading.Thread(target=lookup, daemon=True)
    worker.start()
    worker.join(120)  # a hang detector, not a timing assertion: open() on a FIFO blocks forever
    assert not worker.is_alive(), "the lookup blocked on a FIFO"
    assert outcome[0] == "miss"
    assert not path.exists()  # not an entry any more; the FIFO, an orphan, was removed


# -- malformed rows -------------------------------------------------------------------------------

_MALFORMED = {
    "odd-length key": ("UPDATE entries SET key = x'010203' WHERE id = 1",),
    "negative token": ("UPDATE entries SET key = x'ffffffff64000000' WHERE id = 1",),
    "text for a size": ("UPDATE entries SET size = 'big' WHERE id = 1",),
    "text for an id in the log": ("INSERT INTO changes (op, entry_id) VALUES (2, 'x')",),
    "unknown codec": ("UPDATE entries SET codec = 'lz4' WHERE id = 1",),
    "negative size": ("UPDATE entries SET size = -5, raw_size = -5 WHERE id = 1",),
    "null namespace": ("UPDATE entries SET namespace = '' WHERE id = 1",),
    "real number recency": ("UPDATE entries SET recency = 1.5 WHERE id = 1",),
    "text floor": ("UPDATE meta SET value = 'x' WHERE name = 'floor'",),
    "model info not JSON": ("INSERT INTO models (fingerprint, info) VALUES ('test', '{oops')",),
}


@pytest.mark.parametrize("damage", list(_MALFORMED), ids=list(_MALFORMED))
def test_one_malformed_row_is_a_logged_miss_that_check_fix_removes(
    cache_dir: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    reader = LlamaDiskCache(cache_dir, write_behind=False)  # open before the damage: replays it
    assert len(reader) == 4
    for statement in _MALFORMED[damage]:
        _sql(cache_dir, statement)
    _sql(cache_dir, "INSERT INTO changes (op, entry_id) VALUES (2, 2)")  # wake the reader up
    with caplog.at_level(logging.WARNING, logger="llama_cache"):
        fresh = LlamaDiskCache(cache_dir, write_behind=False)  # never raises
        for cache in (reader, fresh):
            for token in (2, 3, 4):
                assert cache[[token, 100]].n_tokens == 2
            [1, 100] in cache  # noqa: B015 - must not raise
            len(cache)
            cache.stats()
            cache.entries()
            cache.models()
            cache[[9, 9]] = make_state([9, 9])
            assert cache[[9, 9]].n_tokens == 2
    entry_damage = damage not in ("text for an id in the log", "text floor", "model info not JSON")
    if entry_damage:
        with pytest.raises(KeyError):
            fresh[[1, 100]]
        assert any("malformed" in r.message for r in caplog.records)
    report = fresh.check(fix=True)
    assert report.removed_entries == (1 if entry_damage else 0)
    assert fresh.check().malformed_rows == ()
    status, _ = _inspect(cache_dir, "--fix")
    assert status == 0
    reader.close()
    fresh.close()


def test_an_old_schema_is_rebuilt_empty(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    directory = tmp_path / "cache"
    directory.mkdir()
    conn = sqlite3.connect(directory / disk.INDEX_FILE)
    conn.execute("CREATE TABLE entries (id INTEGER PRIMARY KEY, namespace TEXT, key BLOB, file TEXT)")
    conn.execute("INSERT INTO entries VALUES (1, 'x', x'01000000', '../../etc/passwd')")
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    with caplog.at_level(logging.WARNING, logger="llama_cache"):
        with LlamaDiskCache(directory, write_behind=False) as cache:
            assert len(cache) == 0
            cache[[1]] = make_state([1])
            assert cache[[1]].n_tokens == 1
    assert any("rebuilding it empty" in r.message for r in caplog.records)
    conn = sqlite3.connect(directory / disk.INDEX_FILE)
    conn.execute(f"PRAGMA user_version = {disk.SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(CacheDirectoryError, match="schema version"):
        LlamaDiskCache(directory)


# -- bad arguments and unusable directories ---------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"cache_dir": ""}, ValueError),
        ({"cache_dir": None}, TypeError),
        ({"compress": True}, TypeError),
        ({"compress": 0}, ValueError),
        ({"compress": 10}, ValueError),
        ({"compress": "lz4"}, ValueError),
        ({"timeout": -1.0}, ValueError),
        ({"timeout": float("nan")}, ValueError),
        ({"timeout": float("inf")}, ValueError),
        ({"timeout": "5"}, TypeError),
        ({"max_pending": 0}, ValueError),
        ({"fingerprint": ""}, ValueError),
        ({"fingerprint": 5}, TypeError),
        ({"write_behind": "yes"}, TypeError),
    ],
)
def test_bad_arguments_raise_clear_errors(tmp_path: Path, kwargs: dict[str, Any], error: type) -> None:
    kwargs.setdefault("cache_dir", tmp_path / "cache")
    with pytest.raises(error):
        LlamaDiskCache(**kwargs)


def test_compress_accepts_zlib_and_levels(tmp_path: Path) -> None:
    assert LlamaDiskCache(tmp_path / "a", compress="zlib").compress == 6
    assert LlamaDiskCache(tmp_path / "b", compress=9).compress == 9


def test_an_unusable_directory_raises_an_os_error_naming_it(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(CacheDirectoryError, match="file") as caught:
        LlamaDiskCache(not_a_dir)
    assert isinstance(caught.value, OSError) and not isinstance(caught.value, sqlite3.Error)
    # A damaged index is not one of these: it is moved aside (tests/test_disk_rewritten.py).
    blocked = tmp_path / "blocked"
    (blocked / disk.INDEX_FILE).mkdir(parents=True)  # the index cannot be created
    with pytest.raises(CacheDirectoryError, match="blocked"):
        LlamaDiskCache(blocked)
    # Directories that cannot be created, whoever asks (root ignores permissions, not these): the same
    # branch a read-only directory takes, with its own errno.
    for unusable, code in ((not_a_dir / "cache", errno.ENOTDIR), (tmp_path / ("x" * 300), errno.ENAMETOOLONG)):
        with pytest.raises(CacheDirectoryError) as caught:
            LlamaDiskCache(unusable)
        assert caught.value.errno == code and str(unusable) in str(caught.value)
    if os.geteuid() != 0:  # root ignores permissions
        read_only = tmp_path / "ro"
        read_only.mkdir()
        read_only.chmod(0o555)
        try:
            with pytest.raises(CacheDirectoryError) as caught:
                LlamaDiskCache(read_only)
            assert caught.value.errno == errno.EACCES and str(read_only) in str(caught.value)
        finally:
            read_only.chmod(0o755)


def test_states_it_cannot_store_are_refused_at_the_call(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = LlamaDiskCache(tmp_path / "cache")
    negative = LlamaState(np.array([1, -3], dtype=np.int32), None, 0, "test", opaque=np.zeros(8, np.uint8))
    nameless = LlamaState(np.array([1], dtype=np.int32), None, 0, None, opaque=np.zeros(8, np.uint8))  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="llama_cache"):
        cache[[1, 3]] = negative
        cache[[1]] = nameless
    assert cache.stats().store_errors == 2 and len(cache) == 0
    cache.close()


# -- orphans --------------------------------------------------------------------------------------


def test_orphans_of_killed_writers_are_reclaimed_at_open(cache_dir: Path) -> None:
    data = cache_dir / disk.DATA_DIR
    old = data / "cd" / ("1" * 32 + ".llst")
    young = data / "cd" / ("2" * 32 + ".llst")
    old.parent.mkdir(exist_ok=True)
    old.write_bytes(bytes(50_000))
    young.write_bytes(bytes(50_000))
    stale = time.time() - disk.ORPHAN_GRACE_SECONDS - 60
    os.utime(old, (stale, stale))
    foreign = data / "cd" / "notes.txt"  # not a payload name: not ours to remove
    foreign.write_text("x")
    with LlamaDiskCache(cache_dir) as cache:
        assert not old.exists() and young.exists() and foreign.exists()
        assert len(cache) == 4 and cache.check().orphan_files == ("cd/" + "2" * 32 + ".llst",)


# -- a real model under random tampering ------------------------------------------------------------

_PROMPTS = (
    "Q: What is the capital of France?\nA:",
    "Q: Name a primary colour.\nA:",
    "The three laws of motion are",
    "Q: What is 2 + 2?\nA:",
)


_SQL_ACTS = {"column", "swap", "delete_row", "junk_row", "changes", "meta", "models", "drop_table"}
# Acts on chunked entries, drawn only for a directory holding chunks (llama_cache.Llama's states).
_CHUNK_ACTS = ["chunk_column", "chunk_column", "chunk_swap", "chunk_delete", "link_column", "link_swap",
               "link_delete", "link_junk", "chunk_file", "chunk_file"]
_CHUNK_COLUMNS = ("id", "namespace", "prev", "start", "tokens", "file", "size", "raw_size", "codec")


def _has_chunks(directory: Path) -> bool:
    conn = sqlite3.connect(directory / disk.INDEX_FILE, timeout=30)
    try:
        return conn.execute("SELECT 1 FROM chunks LIMIT 1").fetchone() is not None
    except sqlite3.Error:  # dropped by an earlier act
        return False
    finally:
        conn.close()


def _tamper(rng: random.Random, directory: Path, outside: Path) -> str:
    """One random act of vandalism on the index (entries, chunks, links...) or the payload folder
    (payloads, chain heads, chunk files); returns what it did."""
    data = directory / disk.DATA_DIR
    files = sorted(p for p in data.rglob("*.llst") if p.is_file() and not p.is_symlink())
    act = rng.choice(
        ["column", "column", "column", "swap", "delete_row", "junk_row", "changes", "meta", "models",
         "file_bytes", "file_truncate", "file_fifo", "file_link", "file_dir", "subdir_link", "file_delete",
         "drop_table"] + (_CHUNK_ACTS if _has_chunks(directory) else [])
    )
    conn = sqlite3.connect(directory / disk.INDEX_FILE, isolation_level=None, timeout=30)
    try:
        ids = [row[0] for row in conn.execute("SELECT id FROM entries")] if act in _SQL_ACTS else []
        values: list[Any] = [
            -1, 0, 1, 2**40, 2**62, -(2**62), 1.5, float("nan"), "x", "", "zlib", "raw", b"\x01\x02\x03",
            b"\xff\xff\xff\xff", None, str(outside / "precious.txt"), "../../outside/precious.txt",
            "/etc/passwd", "ab/" + "0" * 32 + ".llst", "a" * 300,
        ]
        if act in _CHUNK_ACTS:
            return _tamper_chunks(rng, conn, act, values, files, data)
        if act == "column" and ids:
            column = rng.choice(disk.ENTRY_COLUMNS[1:])
            value = rng.choice(values)
            try:
                conn.execute(f"UPDATE entries SET {column} = ? WHERE id = ?", (value, rng.choice(ids)))
            except sqlite3.Error:
                pass  # NOT NULL or UNIQUE refused it
            return f"column {column}={value!r:.40}"
        if act == "swap" and len(ids) >= 2:
            a, b = rng.sample(ids, 2)
            column = rng.choice(["file", "key", "namespace", "size", "kind", "cut", "logits", "n_state"])
            va, vb = (conn.execute(f"SELECT {column} FROM entries WHERE id = ?", (i,)).fetchone()[0] for i in (a, b))
            try:
                conn.execute(f"UPDATE entries SET {column} = ? WHERE id = ?", (vb, a))
                conn.execute(f"UPDATE entries SET {column} = ? WHERE id = ?", (va, b))
            except sqlite3.Error:
                pass
            return f"swap {column}"
        if act == "delete_row" and ids:
            conn.execute("DELETE FROM entries WHERE id = ?", (rng.choice(ids),))
            return "delete row"
        if act == "junk_row":
            row = [rng.choice(values) if rng.random() < 0.5 else good for good in (
                "junk", b"\x01\x00\x00\x00", os.urandom(16), 0, 1, 1, 1, "ab/" + "1" * 32 + ".llst", 100, 100, "raw",
                0.0, 0.0, 10**9, 0)]
            try:
                conn.execute(
                    "INSERT INTO entries (namespace, key, key_hash, kind, cut, logits, n_state, file, size, raw_size, "
                    "codec, created, accessed, recency, hits) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
                conn.execute("INSERT INTO changes (op, entry_id) VALUES (1, last_insert_rowid())")
            except sqlite3.Error:
                pass
            return "junk row"
        if act == "changes":
            op, entry = rng.choice([1, 2, 3, 7, "x", None]), rng.choice(ids + ["x", -1, 10**9] if ids else ["x"])
            try:
                conn.execute("INSERT INTO changes (op, entry_id, key) VALUES (?, ?, ?)", (op, entry, rng.choice(values)))
            except sqlite3.Error:
                pass
            return f"changes op={op!r}"
        if act == "meta":
            conn.execute("UPDATE meta SET value = ? WHERE name = 'floor'", (rng.choice([-1, "x", 10**9, 1.5]),))
            return "meta floor"
        if act == "models":
            try:
                conn.execute("INSERT OR REPLACE INTO models (fingerprint, info) VALUES (?, ?)",
                             (rng.choice(["x", "", "a" * 400]), rng.choice(["{", "[]", '{"a": 1}', "x" * 10**5])))
            except sqlite3.Error:
                pass
            return "models"
        if act == "drop_table":
            table = rng.choice(["entries", "changes", "meta", "models", "chunks", "links"])
            conn.execute(f"DROP TABLE IF EXISTS {table}")
            return f"drop {table}"
    except sqlite3.Error:
        return f"{act} (refused: a table is gone)"
    finally:
        conn.close()
    if not files:
        return "nothing"
    target = rng.choice(files)
    if act == "file_bytes":
        raw = bytearray(target.read_bytes())
        for _ in range(rng.randint(1, 8)):
            if raw:
                raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        target.write_bytes(bytes(raw))
    elif act == "file_truncate":
        with open(target, "r+b") as handle:
            handle.truncate(rng.randrange(max(target.stat().st_size, 1)))
    elif act == "file_fifo":
        target.unlink()
        os.mkfifo(target)
    elif act == "file_link":
        copy = outside / f"copy-{rng.randrange(10**6)}.llst"
        shutil.copy(target, copy)
        target.unlink()
        target.symlink_to(copy)
    elif act == "file_dir":
        target.unlink()
        target.mkdir()
    elif act == "subdir_link":
        sub = target.parent
        moved = outside / f"sub-{rng.randrange(10**6)}"
        shutil.copytree(sub, moved)
        shutil.rmtree(sub)
        sub.symlink_to(moved)
    else:
        target.unlink()
    return act


def _tamper_chunks(
    rng: random.Random, conn: sqlite3.Connection, act: str, values: list[Any], files: list[Path], data: Path
) -> str:
    """One act of :func:`_tamper` on the chunk rows, the links or the chunk files."""
    chunks = [row[0] for row in conn.execute("SELECT id FROM chunks")]
    links = conn.execute("SELECT entry_id, pos FROM links").fetchall()
    entries = [row[0] for row in conn.execute("SELECT id FROM entries")]
    # Odd values, and plausible ones: other chunks' ids, an empty predecessor, chunk starts, entry ids.
    odd = values + chunks[:4] + [b"", bytes(16), 16, 32] + entries[:2]
    try:
        if act == "chunk_column" and chunks:
            column, value = rng.choice(_CHUNK_COLUMNS), rng.choice(odd)
            conn.execute(f"UPDATE chunks SET {column} = ? WHERE id = ?", (value, rng.choice(chunks)))
            return f"chunk {column}={value!r:.40}"
        if act == "chunk_swap" and len(chunks) >= 2:
            a, b = rng.sample(chunks, 2)
            column = rng.choice(_CHUNK_COLUMNS)
            if column == "id":  # the primary key: through a spare id
                spare = os.urandom(16)
                for old, new in ((a, spare), (b, a), (spare, b)):
                    conn.execute("UPDATE chunks SET id = ? WHERE id = ?", (new, old))
            else:
                va, vb = (conn.execute(f"SELECT {column} FROM chunks WHERE id = ?", (i,)).fetchone()[0] for i in (a, b))
                conn.execute(f"UPDATE chunks SET {column} = ? WHERE id = ?", (vb, a))
                conn.execute(f"UPDATE chunks SET {column} = ? WHERE id = ?", (va, b))
            return f"chunk swap {column}"
        if act == "chunk_delete" and chunks:
            conn.execute("DELETE FROM chunks WHERE id = ?", (rng.choice(chunks),))
            return "chunk delete"
        if act == "link_column" and links:
            column, value = rng.choice(["entry_id", "pos", "chunk"]), rng.choice(odd)
            conn.execute(f"UPDATE links SET {column} = ? WHERE entry_id = ? AND pos = ?", (value, *rng.choice(links)))
            return f"link {column}={value!r:.40}"
        if act == "link_swap" and len(links) >= 2:
            a, b = rng.sample(links, 2)
            ca, cb = (conn.execute("SELECT chunk FROM links WHERE entry_id = ? AND pos = ?", key).fetchone()[0]
                      for key in (a, b))
            conn.execute("UPDATE links SET chunk = ? WHERE entry_id = ? AND pos = ?", (cb, *a))
            conn.execute("UPDATE links SET chunk = ? WHERE entry_id = ? AND pos = ?", (ca, *b))
            return "link swap"
        if act == "link_delete" and links:
            conn.execute("DELETE FROM links WHERE entry_id = ? AND pos = ?", rng.choice(links))
            return "link delete"
        if act == "link_junk":
            conn.execute("INSERT INTO links (entry_id, pos, chunk) VALUES (?, ?, ?)",
                         (rng.choice(odd), rng.choice(odd), rng.choice(odd)))
            return "link junk"
    except sqlite3.Error:
        return f"{act} (refused)"  # NOT NULL or a primary key refused it
    if act != "chunk_file":
        return "nothing"
    named = {row[0] for row in conn.execute("SELECT file FROM chunks")}
    targets = [p for p in files if p.relative_to(data).as_posix() in named]  # never a path a row made up
    if not targets:
        return "nothing"
    target = rng.choice(targets)
    how = rng.choice(["bytes", "truncate", "delete", "swap"])
    if how == "bytes":
        raw = bytearray(target.read_bytes())
        for _ in range(rng.randint(1, 8)):
            if raw:
                raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        target.write_bytes(bytes(raw))
    elif how == "truncate":
        with open(target, "r+b") as handle:
            handle.truncate(rng.randrange(max(target.stat().st_size, 1)))
    elif how == "delete":
        target.unlink()
    else:  # two chunk files trade contents: each row names a file holding another chunk
        other = rng.choice(targets)
        first, second = target.read_bytes(), other.read_bytes()
        target.write_bytes(second)
        other.write_bytes(first)
    return f"chunk file {how}"


def _snapshot_outside(outside: Path) -> dict[str, tuple[int, float, bool]]:
    return {
        str(p): (p.lstat().st_size, p.lstat().st_mtime, p.is_symlink())
        for p in sorted(outside.rglob("*"))
    }


class _Counter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def _fuzz(tmp_path: Path, trials: int, seed: int) -> dict[str, Any]:
    """Random tampering, then a real completion through the tampered cache, ``trials`` times.

    Half the trials run llama_cache.Llama on a directory of its states (chunks of 4 tokens, so that
    entries are chains of several chunks and share some), half a plain llama_cpp.Llama on a directory
    of llama-cpp-python's states.
    """
    import llama_cpp

    import llama_cache
    from llama_cache.llama import Llama

    model = str(llama_cache.default_model_path())
    engines = {
        "ours": Llama(model_path=model, n_ctx=512, verbose=False, seed=0),
        "plain": llama_cpp.Llama(model_path=model, n_ctx=512, verbose=False, seed=0),
    }
    cold: dict[tuple[str, str], str] = {}
    for name, llm in engines.items():
        for prompt in _PROMPTS:
            llm.reset()
            cold[name, prompt] = llm.create_completion(prompt, max_tokens=6, temperature=0)["choices"][0]["text"]
        with LlamaDiskCache(tmp_path / f"pristine-{name}", capacity_bytes=64 << 20, chunk_tokens=4) as cache:
            llm.set_cache(cache)
            for prompt in _PROMPTS:
                llm.reset()
                llm.create_completion(prompt, max_tokens=6, temperature=0)
            cache.bind(llm)  # also records the model's name
        llm.set_cache(None)
    rng = random.Random(seed)
    figures = {"trials": 0, "exceptions": 0, "hangs": 0, "outside_touched": 0, "wrong_texts": 0, "hits": 0,
               "trials_with_warnings": 0}
    failures: list[str] = []
    counter = _Counter()
    package_logger = logging.getLogger("llama_cache")
    package_logger.addHandler(counter)
    level, package_logger.level = package_logger.level, logging.WARNING
    start = time.perf_counter()
    try:
        for trial in range(trials):
            name = "ours" if trial % 2 == 0 else "plain"
            llm = engines[name]
            outside = tmp_path / f"outside-{trial}"
            outside.mkdir()
            for sentinel in ("precious.txt", "passwd"):
                (outside / sentinel).write_text(sentinel)
            directory = tmp_path / f"trial-{trial}"
            shutil.copytree(tmp_path / f"pristine-{name}", directory, symlinks=True)
            acts = [_tamper(rng, directory, outside) for _ in range(rng.randint(1, 3))]
            before = _snapshot_outside(outside)
            prompt = rng.choice(_PROMPTS)
            write_behind, fix = rng.random() < 0.5, rng.random() < 0.5
            result: list[Any] = []
            warnings_before = counter.count

            def run() -> None:
                try:
                    cache = LlamaDiskCache(
                        directory, capacity_bytes=64 << 20, write_behind=write_behind, chunk_tokens=4
                    )
                    llm.set_cache(cache)
                    llm.reset()
                    text = llm.create_completion(prompt, max_tokens=6, temperature=0)["choices"][0]["text"]
                    hits = cache.stats().hits
                    cache.check(fix=fix, deep=True, grace_seconds=0)
                    len(cache)
                    cache.close()
                    result.append((text, hits))
                except BaseException as error:  # noqa: BLE001 - counted and reported
                    result.append(error)
                finally:
                    llm.set_cache(None)

            worker = threading.Thread(target=run, daemon=True)
            worker.start()
            worker.join(120)  # a hang detector only
            figures["trials"] += 1
            if worker.is_alive():
                figures["hangs"] += 1
                failures.append(f"trial {trial} {name} {acts}: hung")
                break
            figures["trials_with_warnings"] += counter.count > warnings_before
            outcome = result[0]
            if isinstance(outcome, BaseException):
                figures["exceptions"] += 1
                failures.append(f"trial {trial} {name} {acts}: {type(outcome).__name__}: {outcome}")
            else:
                text, hits = outcome
                figures["hits"] += hits
                if text != cold[name, prompt]:
                    figures["wrong_texts"] += 1
                    failures.append(f"trial {trial} {name} {acts}: {text!r} != {cold[name, prompt]!r}")
            if _snapshot_outside(outside) != before:
                figures["outside_touched"] += 1
                failures.append(f"trial {trial} {name} {acts}: files outside changed")
            shutil.rmtree(directory, ignore_errors=True)
    finally:
        package_logger.removeHandler(counter)
        package_logger.setLevel(level)
    figures["seconds"] = round(time.perf_counter() - start, 1)
    figures["failures"] = failures[:10]
    return figures


def _assert_clean(figures: dict[str, Any]) -> None:
    print(json.dumps(figures))  # the figures, for whoever runs pytest -s
    assert figures["exceptions"] == figures["hangs"] == figures["outside_touched"] == figures["wrong_texts"] == 0, (
        figures["failures"]
    )
    assert figures["hits"] > 0  # tampering left some entries intact, and they served
    assert figures["trials_with_warnings"] > 0  # and the tampering was noticed


@pytest.mark.model
def test_random_tampering_under_real_completions(tmp_path: Path) -> None:
    _assert_clean(_fuzz(tmp_path, trials=int(os.environ.get("LLAMA_CACHE_FUZZ_TRIALS", "120")), seed=1234))


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("LLAMA_CACHE_FUZZ_LONG"), reason="set LLAMA_CACHE_FUZZ_LONG=1 (about 5 minutes)")
def test_random_tampering_under_real_completions_long(tmp_path: Path) -> None:
    _assert_clean(_fuzz(tmp_path, trials=1000, seed=99))


# -- a real model while another process rewrites, truncates and deletes the directory's files ---------

_COMPLETING_CHILD = """
    import json, logging, random, sys
    import llama_cache
    from llama_cache.caches.disk import LlamaDiskCache
    from llama_cache.llama import Llama
    logging.basicConfig(level=logging.CRITICAL)
    directory, completions, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    prompts = json.loads(sys.argv[4])
    llm = Llama(model_path=str(llama_cache.default_model_path()), n_ctx=512, verbose=False, seed=0)
    cold = {}
    for prompt in prompts:
        llm.reset()
        cold[prompt] = llm.create_completion(prompt, max_tokens=6, temperature=0)["choices"][0]["text"]
    cache = LlamaDiskCache(directory, capacity_bytes=64 << 20, chunk_tokens=4)
    llm.set_cache(cache)
    print("ready", flush=True)
    rng = random.Random(seed)
    figures = {"completions": 0, "exceptions": 0, "wrong_texts": 0, "failures": []}
    for _ in range(completions):
        prompt = rng.choice(prompts)
        llm.reset()
        try:
            text = llm.create_completion(prompt, max_tokens=6, temperature=0)["choices"][0]["text"]
        except Exception as error:  # counted and reported
            figures["exceptions"] += 1
            figures["failures"].append(f"{type(error).__name__}: {error}")
            continue
        figures["completions"] += 1
        if text != cold[prompt]:
            figures["wrong_texts"] += 1
            figures["failures"].append(f"{text!r} != {cold[prompt]!r}")
    stats = cache.stats()
    figures.update(hits=stats.hits, misses=stats.misses, index_resets=stats.index_resets)
    cache.close()
    print(json.dumps(figures), flush=True)
"""


def _vandalize(rng: random.Random, directory: Path) -> str:
    """Rewrite, truncate or delete one file of the directory (the index and its journal included),
    or the whole index or a payload folder; returns what it did."""
    # os.walk, not rglob: the cache removes a shard folder when it empties, maybe while it is listed.
    files = [p for root, _, names in os.walk(directory) for p in map(Path(root).joinpath, names)
             if p.is_file() and not p.is_symlink()]
    act = rng.choice(["rewrite", "rewrite", "truncate", "truncate", "delete", "delete", "index", "folder"])
    try:
        if act == "index":
            target = directory / disk.INDEX_FILE
            target.write_bytes(os.urandom(rng.randrange(4096)) if rng.random() < 0.5 else b"")
            return act
        if act == "folder":
            folders = [p for p in (directory / disk.DATA_DIR).iterdir() if p.is_dir()]
            if folders:
                shutil.rmtree(rng.choice(folders), ignore_errors=True)
            return act
        if not files:
            return "nothing"
        target = rng.choice(files)
        size = target.stat().st_size
        if act == "rewrite":  # as `cp other file` would: cut, then other bytes, any length
            with open(target, "wb") as handle:
                handle.write(os.urandom(rng.randrange(size + 1)))
        elif act == "truncate":
            with open(target, "r+b") as handle:
                handle.truncate(rng.randrange(size + 1))
        else:
            target.unlink()
    except OSError:
        return f"{act} (gone meanwhile)"
    return act


def _rewrite_fuzz(tmp_path: Path, completions: int, seed: int) -> dict[str, Any]:
    """Completions of the default model in a child process through a disk cache whose files this
    process rewrites, truncates and deletes meanwhile (seeded), until the child finishes.

    Returns:
        The child's figures (completions, exceptions, wrong texts, hits, index resets), whether it
        crashed (killed by a signal or exited with an error) and the acts done.
    """
    directory = tmp_path / "cache"
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_COMPLETING_CHILD), str(directory), str(completions), str(seed),
         json.dumps(_PROMPTS)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )
    assert child.stdout is not None
    ready = child.stdout.readline()
    rng = random.Random(seed)
    acts: dict[str, int] = {}
    while ready == "ready\n" and child.poll() is None:
        act = _vandalize(rng, directory)
        acts[act] = acts.get(act, 0) + 1
        time.sleep(rng.random() * 0.02)
    out, err = child.communicate(timeout=600)
    crashed = child.returncode != 0 or ready != "ready\n"
    figures: dict[str, Any] = {"crashed": crashed, "returncode": child.returncode, "acts": acts}
    if crashed:
        figures["stderr"] = err[-3000:]
    else:
        figures.update(json.loads(out.strip().splitlines()[-1]))
    return figures


def _assert_survived(figures: dict[str, Any], completions: int) -> None:
    print(json.dumps(figures))  # the figures, for whoever runs pytest -s
    assert not figures["crashed"], figures
    assert figures["exceptions"] == figures["wrong_texts"] == 0, figures["failures"][:10]
    assert figures["completions"] == completions
    assert sum(n for act, n in figures["acts"].items() if act != "nothing") > 0


@pytest.mark.model
def test_rewriting_the_directory_under_live_completions(tmp_path: Path) -> None:
    completions = int(os.environ.get("LLAMA_CACHE_REWRITE_COMPLETIONS", "8"))
    _assert_survived(_rewrite_fuzz(tmp_path, completions, seed=4321), completions)


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("LLAMA_CACHE_FUZZ_LONG"), reason="set LLAMA_CACHE_FUZZ_LONG=1 (about 5 minutes)")
def test_rewriting_the_directory_under_live_completions_long(tmp_path: Path) -> None:
    _assert_survived(_rewrite_fuzz(tmp_path, 600, seed=77), 600)
