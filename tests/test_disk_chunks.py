"""The disk tier's KV chunks (issue #10): shared prefixes stored once, reference counts, damage, reuse.

Synthetic transformer states (:func:`kv_state`) hold KV bytes that are a function of the tokens up to
each position, as a real model's are: states sharing a prefix share its bytes, and any process can
recompute the exact bytes a state of given tokens must restore to. The tests marked ``model`` run the
default model through ``llama_cache.Llama``.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llama_cache.caches import disk
from llama_cache.caches.disk import LlamaDiskCache
from llama_cache.state.chunks import encode_chunk, encode_head, pieces
from llama_cache.state.format import encoded_size
from llama_cache.state.llama_state import LlamaState
from tests.test_disk_cache import on_disk

REPO = Path(__file__).resolve().parents[1]
C = 4  # tokens per chunk in the synthetic tests
_K_ROW, _V_ELEM, _V_EMBD = 16, 2, 8  # per token and layer: 16 bytes of keys, 2 x 8 of transposed values


def kv_state(tokens: Sequence[int], fingerprint: str = "test", logits: bool = False) -> LlamaState:
    """A two-layer transformer state in llama.cpp's per-sequence format whose KV at position ``i`` is a
    hash of ``tokens[: i + 1]``; its logits (when asked for) depend on the tokens too.
    """
    tokens = np.asarray(list(tokens), dtype=np.int32)
    n = len(tokens)
    rows = np.empty((n, 64), dtype=np.uint8)
    digest = b""
    for i, token in enumerate(tokens.tolist()):
        digest = hashlib.blake2b(digest + token.to_bytes(4, "little"), digest_size=64).digest()
        rows[i] = np.frombuffer(digest, dtype=np.uint8)
    cells = np.zeros(n, dtype=[("pos", "<i4"), ("n_seq", "<u4"), ("seq", "<i4")])
    cells["pos"] = np.arange(n)
    cells["n_seq"] = 1
    parts = [np.array([0xAF143CD8, 0, 1, n], "<u4").tobytes(), cells.tobytes(), np.array([1, 2], "<u4").tobytes()]
    for layer in range(2):
        keys = rows[:, 16 * layer : 16 * layer + _K_ROW]
        parts += [np.array([1], "<i4").tobytes(), np.array([_K_ROW], "<u8").tobytes(), keys.tobytes()]
    for layer in range(2):
        values = rows[:, 32 + 16 * layer : 48 + 16 * layer].reshape(n, _V_EMBD, _V_ELEM).transpose(1, 0, 2)
        parts += [np.array([1, _V_ELEM, _V_EMBD], "<u4").tobytes(), values.tobytes()]
    raw = np.frombuffer(b"".join(parts), dtype=np.uint8)
    row = (np.arange(16, dtype=np.float32) + float(rows[-1, 0])) if logits and n else None
    state = LlamaState.from_seq_bytes(tokens, row, 0, fingerprint, raw)
    assert state.layout is not None
    return state


def restores_exactly(state: Any, tokens: Sequence[int] | None = None) -> bool:
    """Whether ``state`` holds ``tokens`` (default: its own) with exactly the KV :func:`kv_state` makes."""
    held = state.tokens.tolist()
    if tokens is not None and held != list(tokens):
        return False
    expected = kv_state(held)
    return bool(np.array_equal(np.asarray(state.seq_bytes()), np.asarray(expected.seq_bytes())))


def chain(tokens: Sequence[int], fingerprint: str = "test") -> list[bytes]:
    """The chunk ids of a state of ``tokens`` in chunks of ``C``."""
    return [piece.id for piece in pieces(fingerprint, np.asarray(tokens, dtype=np.int32), C)]


def stored_size(tokens: Sequence[int]) -> int:
    """Bytes the chain head and every chunk of a state of ``tokens`` take on disk, in chunks of ``C``."""
    state = kv_state(tokens)
    assert state.layout is not None
    return encoded_size(encode_head(state, C)) + sum(
        encoded_size(encode_chunk("test", piece, state.layout, state.segments))
        for piece in pieces("test", state.tokens, C)
    )


def chunk_bytes(tokens: Sequence[int]) -> int:
    """Bytes of the chunk files of a state of ``tokens`` (its chain head left out)."""
    return stored_size(tokens) - encoded_size(encode_head(kv_state(tokens), C))


def charged_size(tokens: Sequence[int]) -> int:
    """What the chain head and chunk files of a state of ``tokens`` take on disk (whole blocks)."""
    state = kv_state(tokens)
    assert state.layout is not None
    return on_disk(encoded_size(encode_head(state, C))) + sum(
        on_disk(encoded_size(encode_chunk("test", piece, state.layout, state.segments)))
        for piece in pieces("test", state.tokens, C)
    )


def charged_chunks(tokens: Sequence[int]) -> int:
    """What the chunk files of a state of ``tokens`` take on disk (its chain head left out)."""
    return charged_size(tokens) - on_disk(encoded_size(encode_head(kv_state(tokens), C)))


def sql(cache: LlamaDiskCache, statement: str, *params: Any) -> list[tuple[Any, ...]]:
    """Run one statement on the cache's index from a connection of its own (as another process would)."""
    conn = sqlite3.connect(cache.cache_dir / disk.INDEX_FILE, isolation_level=None, timeout=30)
    try:
        return conn.execute(statement, params).fetchall()
    finally:
        conn.close()


def data_files(cache: LlamaDiskCache) -> dict[str, int]:
    """Every payload, head and chunk file of the directory: name relative to data/ -> size."""
    data = cache.cache_dir / disk.DATA_DIR
    return {str(p.relative_to(data)): p.stat().st_size for p in data.rglob("*.llst")}


def chunk_ids(cache: LlamaDiskCache) -> set[bytes]:
    return {row[0] for row in sql(cache, "SELECT id FROM chunks")}


def assert_sound(cache: LlamaDiskCache) -> None:
    """No leaked chunk, broken chain, orphan or empty folder; bytes equal to the files' sizes in whole
    blocks, and the directory within capacity as du counts it; every chunk row linked and named by one
    file, every file named by one row."""
    report = cache.check()
    assert report.ok and report.empty_folders == (), report
    files = data_files(cache)
    assert cache.cache_size == sum(on_disk(size) for size in files.values())
    assert report.disk_usage == report.budgeted_bytes <= cache.capacity_bytes
    chunk_files = [row[0] for row in sql(cache, "SELECT file FROM chunks")]
    entry_files = [entry.file for entry in cache.entries()]
    assert sorted(chunk_files + entry_files) == sorted(files)
    assert chunk_ids(cache) == {row[0] for row in sql(cache, "SELECT chunk FROM links")}


@pytest.fixture
def open_cache(open_cache: Any) -> Any:
    """conftest's factory, making synchronous caches with chunks of ``C`` unless told otherwise."""

    def factory(capacity_bytes: int = 10**7, **kwargs: Any) -> LlamaDiskCache:
        kwargs.setdefault("write_behind", False)
        kwargs.setdefault("chunk_tokens", C)
        return open_cache(capacity_bytes, **kwargs)

    return factory


PREFIX = list(range(100, 124))  # 6 full chunks shared by the entries below


def branch(*tokens: int) -> list[int]:
    return PREFIX + list(tokens)


# -- dedup across entries and processes ----------------------------------------------------------------


def test_entries_sharing_a_prefix_store_its_chunks_once(open_cache: Any) -> None:
    cache = open_cache()
    x, y = branch(1, 2, 3, 4, 5, 6, 7, 8), branch(9, 10, 11, 12)
    cache[x] = kv_state(x)
    cache[y] = kv_state(y)
    assert chunk_ids(cache) == set(chain(x)) | set(chain(y))
    assert len(chunk_ids(cache)) == 6 + 2 + 1
    report = cache.storage()
    assert report.chunks == 9 and report.entries == 2
    assert report.unique_bytes == sum(data_files(cache).values())
    # Stored whole, each entry would hold the prefix's 6 chunks: once more than they take.
    assert report.logical_bytes - report.unique_bytes == chunk_bytes(PREFIX)
    assert restores_exactly(cache[x], x) and restores_exactly(cache[y], y)
    assert_sound(cache)


def test_a_new_instance_counts_the_chunks_it_finds(open_cache: Any) -> None:
    first = open_cache()
    x, y = branch(1, 2, 3, 4, 5, 6, 7, 8), branch(9, 10, 11, 12)
    first[x] = kv_state(x)
    first[y] = kv_state(y)
    files = data_files(first).values()
    second = open_cache()
    assert second.cache_size == second.stats().bytes == sum(on_disk(size) for size in files)
    assert second.storage().unique_bytes == sum(files)
    assert first.storage() == second.storage()


def test_a_chunk_length_of_zero_stores_states_whole(open_cache: Any) -> None:
    cache = open_cache(chunk_tokens=0)
    x, y = branch(1, 2, 3, 4), branch(5, 6, 7, 8)
    cache[x] = kv_state(x)
    cache[y] = kv_state(y)
    assert sql(cache, "SELECT COUNT(*) FROM chunks") == [(0,)] and sql(cache, "SELECT COUNT(*) FROM links") == [(0,)]
    assert [entry.kind for entry in cache.entries()] == ["llama_cache", "llama_cache"]
    assert len(data_files(cache)) == 2
    report = cache.storage()
    assert report.chunks == 0 and report.unique_bytes == report.logical_bytes == sum(data_files(cache).values())
    assert restores_exactly(cache[x], x) and restores_exactly(cache.lookup_prefix(branch(5, 6, 0)), branch(5, 6))
    assert_sound(cache)


@pytest.mark.parametrize(
    ("value", "error"),
    [(-1, ValueError), (2**16 + 1, ValueError), (1.5, TypeError), (True, TypeError), ("4", TypeError)],
)
def test_bad_chunk_lengths_raise(tmp_path: Path, value: Any, error: type) -> None:
    with pytest.raises(error):
        LlamaDiskCache(tmp_path / "cache", chunk_tokens=value)


def test_chains_of_other_chunk_lengths_are_never_confused(open_cache: Any) -> None:
    fours, eights = open_cache(chunk_tokens=4), open_cache(chunk_tokens=8)
    w, x, y = PREFIX[:3], branch(1, 2, 3, 4), branch(5, 6, 7, 8)
    fours[w] = kv_state(w)  # one partial chunk
    fours[x] = kv_state(x)
    eights[y] = kv_state(y)
    # y's first chunk (8 tokens) extends x's first (4 tokens), which x's chain continues: not absorbed.
    # w's partial chunk, which nothing continues, is (w now ends on y's first chunk).
    assert sorted(row[0] for row in sql(fours, "SELECT start FROM chunks WHERE start < 24")) == sorted(
        list(range(0, 24, 4)) + list(range(0, 24, 8))
    )
    assert chunk_ids(fours) == set(chain(x)) | {piece.id for piece in pieces("test", np.asarray(y), 8)}
    for cache in (fours, eights):
        assert restores_exactly(cache[x], x) and restores_exactly(cache[y], y)
        assert restores_exactly(cache.lookup_prefix(branch(1, 2, 0)), branch(1, 2))
        assert restores_exactly(cache.lookup_prefix(w), w)
    assert fours.check(deep=True).ok  # every entry, w's included, reads back whole
    assert_sound(fours)


_STORE_CHILD = textwrap.dedent(
    """
    import sys
    from llama_cache.caches.disk import LlamaDiskCache
    from tests.test_disk_chunks import kv_state

    tokens = [int(t) for t in sys.argv[2].split(",")]
    cache = LlamaDiskCache(sys.argv[1], chunk_tokens=int(sys.argv[3]))
    cache[tokens] = kv_state(tokens)
    cache.close()
    print(cache.stats().writes)
    """
)


def test_another_process_writes_only_the_chunks_past_a_shared_prefix(open_cache: Any) -> None:
    cache = open_cache()
    x, y = branch(1, 2, 3, 4, 5, 6, 7, 8), branch(9, 10, 11, 12, 13, 14, 15, 16)
    cache[x] = kv_state(x)
    before = data_files(cache)
    result = subprocess.run(
        [sys.executable, "-c", _STORE_CHILD, str(cache.cache_dir), ",".join(map(str, y)), str(C)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1"]
    after = data_files(cache)
    assert set(before) <= set(after)
    assert len(after) - len(before) == 1 + 2  # y's chain head and its 2 own chunks; the prefix's 6 reused
    assert sorted(row[0] for row in sql(cache, "SELECT start FROM chunks")) == list(range(0, 24, 4)) + [24, 24, 28, 28]
    assert chunk_ids(cache) == set(chain(x)) | set(chain(y))
    assert cache.storage().unique_bytes == sum(after.values())
    assert restores_exactly(cache[y], y) and restores_exactly(cache[x], x)
    assert_sound(cache)


# -- reference counts ---------------------------------------------------------------------------------


def test_deleting_an_entry_frees_only_the_chunks_no_other_entry_links(open_cache: Any) -> None:
    cache = open_cache()
    x, y = branch(1, 2, 3, 4, 5, 6, 7, 8), branch(9, 10, 11, 12)
    cache[x] = kv_state(x)
    cache[y] = kv_state(y)
    files = {row[0]: row[1] for row in sql(cache, "SELECT id, file FROM chunks")}
    del cache[x]
    assert chunk_ids(cache) == set(chain(y))
    gone = set(chain(x)) - set(chain(y))
    assert len(gone) == 2 and not {files[ident] for ident in gone} & set(data_files(cache))
    assert restores_exactly(cache[y], y)
    assert_sound(cache)
    del cache[y]
    assert chunk_ids(cache) == set() and data_files(cache) == {}
    assert_sound(cache)


def test_overwriting_a_key_frees_the_chunks_of_the_state_it_replaced(open_cache: Any) -> None:
    cache = open_cache()
    old, new = branch(1, 2, 3, 4, 5, 6, 7, 8), branch(9, 10, 11, 12)
    cache[PREFIX] = kv_state(old)  # filed under PREFIX, holding more
    assert chunk_ids(cache) == set(chain(old))
    assert_sound(cache)
    cache[PREFIX] = kv_state(new)
    assert len(cache) == 1 and chunk_ids(cache) == set(chain(new))
    assert restores_exactly(cache[PREFIX], new)
    assert_sound(cache)
    chunk_files = sorted(row[0] for row in sql(cache, "SELECT file FROM chunks"))
    cache[PREFIX] = kv_state(new, logits=True)  # only the chain head changes
    assert sorted(row[0] for row in sql(cache, "SELECT file FROM chunks")) == chunk_files
    restored = cache[PREFIX]
    assert restores_exactly(restored, new) and np.array_equal(restored.logits, kv_state(new, logits=True).logits)
    assert_sound(cache)


def test_lru_eviction_frees_exactly_the_chunks_no_remaining_entry_links(open_cache: Any) -> None:
    branches = [branch(t, t + 1, t + 2, t + 3, t + 4, t + 5, t + 6, t + 7) for t in range(0, 80, 10)]
    own = charged_size(branches[0]) - charged_chunks(PREFIX)  # a branch's chain head and its 2 own chunks
    capacity = charged_size(branches[0]) + 2 * own + own // 2  # the prefix once and three branches
    cache = open_cache(capacity)
    for tokens in branches[:3]:
        cache[tokens] = kv_state(tokens)
    assert len(cache) == 3 and cache.stats().evictions == 0
    cache[branches[0]]  # branches[1] is now the least recently used
    cache[branches[3]] = kv_state(branches[3])
    assert cache.stats().evictions == 1
    assert sorted(cache.keys()) == sorted(tuple(b) for b in (branches[0], branches[2], branches[3]))
    assert chunk_ids(cache) == set().union(*(chain(tokens) for tokens in cache.keys()))
    assert_sound(cache)
    for tokens in branches[4:]:
        cache[tokens] = kv_state(tokens)
        assert len(cache) == 3
        assert chunk_ids(cache) == set().union(*(chain(key) for key in cache.keys()))
        assert_sound(cache)
    unrelated = list(range(500, 540))  # leaves no room for the prefix and a branch: everything else goes
    cache[unrelated] = kv_state(unrelated)
    assert list(cache.keys()) == [tuple(unrelated)] and chunk_ids(cache) == set(chain(unrelated))
    assert_sound(cache)
    for tokens in cache.keys():
        assert restores_exactly(cache[tokens], tokens)


def test_clear_leaves_no_chunk_row_link_or_file(open_cache: Any) -> None:
    cache = open_cache()
    for t in range(5):
        tokens = branch(t, t, t)
        cache[tokens] = kv_state(tokens)
    cache.clear()
    assert sql(cache, "SELECT COUNT(*) FROM chunks") == [(0,)] and sql(cache, "SELECT COUNT(*) FROM links") == [(0,)]
    assert data_files(cache) == {} and cache.cache_size == 0 and cache.storage().unique_bytes == 0
    assert_sound(cache)


# -- partial chunks ----------------------------------------------------------------------------------


def test_a_longer_state_absorbs_the_partial_tail_of_a_shorter_one(open_cache: Any) -> None:
    cache = open_cache()
    short, long = branch(1, 2), branch(1, 2, 3)  # tails of 2 and 3 tokens after the same chunk
    cache[short] = kv_state(short)
    (short_tail,) = sql(cache, "SELECT id, file FROM chunks WHERE start = 24")
    cache[long] = kv_state(long)
    assert sql(cache, "SELECT id FROM chunks WHERE start = 24") == [(chain(long)[-1],)]  # one tail
    assert short_tail[1] not in data_files(cache)
    assert sql(cache, "SELECT COUNT(DISTINCT entry_id) FROM links WHERE chunk = ?", chain(long)[-1]) == [(2,)]
    assert restores_exactly(cache.lookup_prefix(short), short) and restores_exactly(cache[long], long)
    assert cache.check(deep=True).ok  # both entries read back whole
    assert_sound(cache)


def test_a_shorter_state_reuses_the_longer_tail_it_begins(open_cache: Any) -> None:
    cache = open_cache()
    long, short = branch(1, 2, 3), branch(1)
    cache[long] = kv_state(long)
    before = data_files(cache)
    cache[short] = kv_state(short)
    after = data_files(cache)
    assert set(before) < set(after) and len(after) == len(before) + 1  # its chain head only
    assert chunk_ids(cache) == set(chain(long))
    assert restores_exactly(cache[short], short) and restores_exactly(cache[long], long)
    del cache[long]  # the tail stays: the shorter entry links it
    assert chunk_ids(cache) == set(chain(long)) and restores_exactly(cache[short], short)
    assert_sound(cache)


# -- damage --------------------------------------------------------------------------------------------


def _chunk_file(cache: LlamaDiskCache, ident: bytes) -> Path:
    ((file,),) = sql(cache, "SELECT file FROM chunks WHERE id = ?", ident)
    return cache.cache_dir / disk.DATA_DIR / file


def _flip(cache: LlamaDiskCache, ident: bytes, other: bytes) -> None:
    path = _chunk_file(cache, ident)
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(cache: LlamaDiskCache, ident: bytes, other: bytes) -> None:
    path = _chunk_file(cache, ident)
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size - 100)


def _delete(cache: LlamaDiskCache, ident: bytes, other: bytes) -> None:
    _chunk_file(cache, ident).unlink()


def _row_names_another_file(cache: LlamaDiskCache, ident: bytes, other: bytes) -> None:
    ((file, size, raw_size),) = sql(cache, "SELECT file, size, raw_size FROM chunks WHERE id = ?", other)
    sql(cache, "UPDATE chunks SET file = ?, size = ?, raw_size = ? WHERE id = ?", file, size, raw_size, ident)


def _link_to_another_chunk(cache: LlamaDiskCache, ident: bytes, other: bytes) -> None:
    sql(cache, "UPDATE links SET chunk = ? WHERE chunk = ?", other, ident)


def _link_deleted(cache: LlamaDiskCache, ident: bytes, other: bytes) -> None:
    sql(cache, "DELETE FROM links WHERE chunk = ?", ident)


def _row_deleted(cache: LlamaDiskCache, ident: bytes, other: bytes) -> None:
    sql(cache, "DELETE FROM chunks WHERE id = ?", ident)


_DAMAGE = {
    "byte-flipped": _flip,
    "truncated": _truncate,
    "file-deleted": _delete,
    "row-names-another-chunk-file": _row_names_another_file,
    "link-to-another-chunk": _link_to_another_chunk,
    "link-deleted": _link_deleted,
    "row-deleted": _row_deleted,
}


@pytest.mark.parametrize("which", ["own", "shared"])
@pytest.mark.parametrize("damage", list(_DAMAGE), ids=list(_DAMAGE))
def test_a_damaged_chunk_or_link_is_a_logged_miss_or_another_exact_hit(
    open_cache: Any, caplog: pytest.LogCaptureFixture, damage: str, which: str
) -> None:
    cache = open_cache()
    # x and y share the prefix; x's 7th chunk and y's 7th chunk follow the same chunk, at the same
    # position, with other tokens: the likeliest chunk to be taken for another.
    x, y, z = branch(1, 2, 3, 4, 5, 6, 7, 8), branch(9, 10, 11, 12), [7, 7, 7, 7, 7]
    for tokens in (y, x, z):
        cache[tokens] = kv_state(tokens)
    target, other = (chain(x)[6], chain(y)[6]) if which == "own" else (chain(x)[2], chain(y)[6])
    _DAMAGE[damage](cache, target, other)
    assert cache.check(deep=True).problems  # found before any lookup
    # The entries no damage reaches come back whole and exact; the others may miss. y's chunk is
    # reached by two damages to x's: a row naming its file (dropping x's chunk deletes the file) and a
    # link of x's to it (the chunk found in the wrong chain is dropped with every entry linking it).
    reach_y = which == "shared" or damage in ("row-names-another-chunk-file", "link-to-another-chunk")
    undamaged = [z] if reach_y else [z, y]
    with caplog.at_level(logging.WARNING, logger="llama_cache"):
        for query in (x + [99], x, y, branch(1, 2, 3, 0), z):
            for lookup in (cache.lookup_prefix, cache.__getitem__):
                try:
                    state = lookup(query)
                except KeyError:
                    assert query not in undamaged
                    continue
                # Another entry, or the prefix the query shares with one: with exactly its bytes.
                assert state.tokens[0] == query[0] and restores_exactly(state)
                assert state.tokens.tolist() != x  # the damaged entry never comes back
                if query in undamaged:
                    assert state.tokens.tolist() == query
    assert any("damaged chunk" in r.message for r in caplog.records)
    cache.check(fix=True, grace_seconds=0)
    assert cache.check(deep=True).ok
    assert_sound(cache)
    assert restores_exactly(cache[z], z)
    for key in cache.keys():
        assert restores_exactly(cache[key], key)


# -- a version-2 index -----------------------------------------------------------------------------

# The tables of a version-2 index (whole-state entries only), as llama-cache 33cf273 created them.
_V2_SCHEMA = (
    """CREATE TABLE entries (
        id INTEGER PRIMARY KEY AUTOINCREMENT, namespace TEXT NOT NULL, key BLOB NOT NULL,
        key_hash BLOB NOT NULL, kind INTEGER NOT NULL, cut INTEGER NOT NULL, logits INTEGER NOT NULL,
        n_state INTEGER NOT NULL, file TEXT NOT NULL, size INTEGER NOT NULL, raw_size INTEGER NOT NULL,
        codec TEXT NOT NULL, created REAL NOT NULL, accessed REAL NOT NULL, recency INTEGER NOT NULL,
        hits INTEGER NOT NULL DEFAULT 0, UNIQUE (namespace, key_hash)
    )""",
    "CREATE INDEX entries_recency ON entries (recency)",
    """CREATE TABLE changes (
        seq INTEGER PRIMARY KEY AUTOINCREMENT, op INTEGER NOT NULL, entry_id INTEGER NOT NULL,
        namespace TEXT, key BLOB
    )""",
    "CREATE TABLE meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
    "CREATE TABLE models (fingerprint TEXT PRIMARY KEY, info TEXT NOT NULL)",
)


def test_a_version_2_index_is_upgraded_in_place_and_its_entries_stay_readable(
    open_cache: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Whole-state payloads (their format is unchanged since version 2) and their rows, moved into an
    # index of version 2's schema.
    x, y = branch(1, 2, 3, 4, 5), branch(6, 7)
    source = open_cache(chunk_tokens=0, cache_dir=tmp_path / "v3")
    source[x] = kv_state(x)
    source[y] = kv_state(y, logits=True)
    source.close()
    directory = tmp_path / "v2"
    shutil.copytree(tmp_path / "v3" / disk.DATA_DIR, directory / disk.DATA_DIR)
    conn = sqlite3.connect(directory / disk.INDEX_FILE)
    for statement in _V2_SCHEMA:
        conn.execute(statement)
    conn.execute("ATTACH DATABASE ? AS v3", (str(tmp_path / "v3" / disk.INDEX_FILE),))
    for table in ("entries", "changes", "meta", "models"):
        conn.execute(f"INSERT INTO main.{table} SELECT * FROM v3.{table}")
    conn.commit()
    conn.execute("DETACH DATABASE v3")
    conn.execute("PRAGMA user_version = 2")
    conn.close()

    with caplog.at_level(logging.WARNING, logger="llama_cache"):
        cache = open_cache(cache_dir=directory)
        assert len(cache) == 2 and [entry.kind for entry in cache.entries()] == ["llama_cache", "llama_cache"]
        assert restores_exactly(cache[x], x)
        restored = cache[y]
        assert restores_exactly(restored, y) and np.array_equal(restored.logits, kv_state(y, logits=True).logits)
        assert restores_exactly(cache.lookup_prefix(branch(1, 2, 0)), branch(1, 2))
        z = branch(1, 2, 3, 9)
        cache[z] = kv_state(z)  # new stores are chunked
    assert not caplog.records  # upgraded, not rebuilt
    assert sql(cache, "PRAGMA user_version") == [(disk.SCHEMA_VERSION,)] and disk.SCHEMA_VERSION == 3
    assert sorted(entry.kind for entry in cache.entries()) == ["chunked", "llama_cache", "llama_cache"]
    assert chunk_ids(cache) == set(chain(z))
    assert restores_exactly(cache[z], z) and restores_exactly(cache[x], x)
    assert cache.check(deep=True).ok
    assert_sound(cache)


# -- the default model -----------------------------------------------------------------------------

_SYSTEM = (
    "You are the help desk of a public library. You answer questions about opening hours, borrowing "
    "rules, renewals, fines, inter-library loans, reading rooms, printing and the events calendar. "
    "Answer briefly and politely, in plain English, and never invent a rule: when you do not know, "
    "say so and suggest asking at the front desk. Opening hours: Monday to Friday 9 to 19, Saturday "
    "10 to 16, closed on Sunday. Books are lent for three weeks and can be renewed twice.\n"
)
_QUESTIONS = ("User: Can I renew a book twice?\nAssistant:", "User: Is the library open on Sunday?\nAssistant:")


@pytest.fixture(scope="module")
def llm() -> Iterator[Any]:
    from llama_cache import Llama, default_model_path

    model = Llama(
        model_path=str(default_model_path()), n_ctx=1024, n_threads=1, n_threads_batch=1, seed=0, verbose=False
    )
    yield model
    model.close()


def _complete(llm: Any, prompt: str | list[int]) -> str:
    llm.reset()
    return str(llm.create_completion(prompt, max_tokens=6, temperature=0)["choices"][0]["text"])


@pytest.mark.model
def test_conversations_sharing_a_system_prompt_store_it_once(llm: Any, tmp_path: Path) -> None:
    from llama_cache.state.chunks import default_chunk_tokens

    cache = LlamaDiskCache(tmp_path / "cache", fingerprint=llm.fingerprint)
    llm.set_cache(cache)
    try:
        for question in _QUESTIONS:
            _complete(llm, _SYSTEM + question)
    finally:
        llm.set_cache(None)
    first, second = (llm.tokenize((_SYSTEM + question).encode()) for question in _QUESTIONS)
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    size = default_chunk_tokens(cache[first].layout)
    assert shared >= 6 * size
    report = cache.storage()
    files = data_files(cache)
    assert report.entries == len(cache) >= 2 and len(files) == len(cache) + report.chunks
    assert report.unique_bytes == sum(files.values()) and cache.cache_size == sum(map(on_disk, files.values()))
    # The system prompt's full chunks, once each, whichever conversations and entries link them.
    full = shared // size * size
    assert [row[0] for row in sql(cache, "SELECT start FROM chunks WHERE start < ? ORDER BY start", full)] == list(
        range(0, full, size)
    )
    assert sql(cache, "SELECT COUNT(DISTINCT entry_id) FROM links WHERE pos = 0") == [(len(cache),)]
    # Stored whole, every entry would hold the system prompt's chunks again.
    bytes_per_token = cache[first].layout.bytes_per_token
    assert report.logical_bytes - report.unique_bytes >= (len(cache) - 1) * full * bytes_per_token
    assert cache.check(deep=True).ok
    cache.close()


@pytest.mark.model
def test_a_prompt_diverging_mid_chunk_restores_exactly_the_shared_prefix(
    llm: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from llama_cache.state.chunks import default_chunk_tokens

    stored = llm.tokenize((_SYSTEM + _QUESTIONS[0]).encode())
    diverge = 87  # inside a chunk, where no entry ends
    asked = stored[:diverge] + llm.tokenize(b" Also, what about the printing prices?\nAssistant:", add_bos=False)
    assert asked[diverge] != stored[diverge]
    cold = _complete(llm, asked)
    assert llm.last_prompt_tokens_evaluated == len(asked)

    directory = tmp_path / "cache"
    cache = LlamaDiskCache(directory, fingerprint=llm.fingerprint)
    llm.set_cache(cache)
    try:
        _complete(llm, stored)
        live = llm.save_state()  # the context's own KV for the stored prompt and what followed
        cache.close()
        size = default_chunk_tokens(live.layout)
        assert diverge % size and sorted(len(key) for key in cache.keys())[0] > diverge

        # The chunks past the divergence are not read: a copy of the directory without them answers.
        copy = tmp_path / "copy"
        shutil.copytree(directory, copy)
        needed = -(-diverge // size) * size
        for (file,) in sql(cache, "SELECT file FROM chunks WHERE start >= ?", needed):
            (copy / disk.DATA_DIR / file).unlink()
        partial = LlamaDiskCache(copy, fingerprint=llm.fingerprint, write_behind=False)
        with caplog.at_level(logging.WARNING, logger="llama_cache"):
            state = partial.lookup_prefix(asked)
            assert not caplog.records
            assert state.tokens.tolist() == asked[:diverge] and state.logits is None
            assert np.array_equal(np.asarray(state.seq_bytes()), np.asarray(live.prefix(diverge, None).seq_bytes()))
            with pytest.raises(KeyError):
                partial[asked]  # whole entries do need them: their chains are broken there
            assert any("damaged chunk" in r.message for r in caplog.records)
        partial.close()

        # Llama restores the shared prefix and evaluates only the rest, to the cold run's text.
        warm = _complete(llm, asked)
        assert llm.last_prompt_tokens_evaluated == len(asked) - diverge
        assert warm == cold
    finally:
        llm.set_cache(None)
        cache.close()


def test_a_chunk_across_two_segments_encodes_as_from_one_segment() -> None:
    """Chunks inside one segment take a fast path; across segments they are concatenated: same bytes."""
    from llama_cache.state.kv_layout import serialize_segments
    from llama_cache.state.llama_state import LlamaState
    from llama_cache.testing.states import synthetic_state

    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 1000, 90).astype(np.int32)
    base = synthetic_state(tokens[:50], 6, rng)
    whole = synthetic_state(tokens, 6, rng)
    extended = base.extended(50, tokens, None, 0, whole.seq_bytes())
    assert len(extended.segments) >= 2  # the base's 50 positions, then the new ones
    flat = LlamaState.from_seq_bytes(tokens, None, 0, "test",
                                     np.frombuffer(bytes(serialize_segments(extended.layout, list(extended.segments))),
                                                   dtype=np.uint8))
    assert len(flat.segments) == 1
    chain = pieces("test", tokens, 16)
    assert any(piece.start < 50 < piece.start + piece.n_tokens for piece in chain)
    for piece in chain:
        ours = encode_chunk("test", piece, extended.layout, extended.segments)[0]
        reference = encode_chunk("test", piece, flat.layout, flat.segments)[0]
        assert bytes(ours) == bytes(reference)
