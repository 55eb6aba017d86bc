"""What a disk store costs in SQLite statements, and that the shortcuts keeping it at that stay exact.

A whole-state store that replaces and evicts nothing is one transaction of at most six statements
(``writes._commit``): the view takes the new entry in memory instead of replaying the log, the log
row's seq is given to the entry up front, folder rows are written only when a size changes and, far
from the budget, the index's pages are bounded instead of counted. These tests count the statements
on the real SQLite connection (``set_trace_callback``) and check, against a second instance reading
the same directory and against ``check()``, that the shortcuts leave the index and the view as a full
replay would: after stores, replacements, evictions, another process's writes, a failed commit and a
lowered ``sqlite_sequence``. No timing here (the rates live in ``benchmarks/disk_io.py``).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llama_cache.caches.disk import INDEX_FILE, LlamaDiskCache, writes
from llama_cache.state.llama_state import LlamaState

STATEMENTS_PER_STORE = 6


def make_state(tokens: list[int], nbytes: int = 2_000, logits: bool = False) -> LlamaState:
    """A state whose bytes derive from its tokens; one with ``logits`` replaces one without (a state
    equal to the stored one is only touched)."""
    fill = (sum(tokens) * 31 + len(tokens)) % 251
    row = np.full(16, fill, dtype=np.float32) if logits else None
    return LlamaState(np.array(tokens, dtype=np.int32), row, 0, "model-a",
                      opaque=np.full(nbytes, fill, dtype=np.uint8))


def holds(state: Any, tokens: list[int], nbytes: int = 2_000) -> bool:
    expected = make_state(tokens, nbytes)
    return bool(np.array_equal(state.tokens, expected.tokens)
                and np.array_equal(np.asarray(state.seq_bytes()), np.asarray(expected.seq_bytes())))


class Statements:
    """Counts the statements of every SQLite connection opened while installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sql: list[str] = []
        real = sqlite3.connect

        def connect(*args: Any, **kwargs: Any) -> Any:
            conn = real(*args, **kwargs)
            conn.set_trace_callback(self.sql.append)
            return conn

        monkeypatch.setattr(sqlite3, "connect", connect)

    def during(self, fn: Any) -> list[str]:
        start = len(self.sql)
        fn()
        return self.sql[start:]


@pytest.fixture
def statements(monkeypatch: pytest.MonkeyPatch) -> Iterator[Statements]:
    yield Statements(monkeypatch)


def test_a_whole_state_store_is_one_transaction_of_at_most_six_statements(
    tmp_path: Path, statements: Statements
) -> None:
    with LlamaDiskCache(tmp_path / "c", capacity_bytes=1 << 30, write_behind=False, chunk_tokens=0) as cache:
        cache[[0, 1]] = make_state([0, 1])  # the first store after opening counts the index's pages
        counts = []
        for i in range(1, 200):
            sql = statements.during(lambda i=i: cache.__setitem__([i, 1], make_state([i, 1])))
            counts.append(len(sql))
            assert sql[0] == "BEGIN IMMEDIATE" and sql[-1] == "COMMIT" and sql.count("BEGIN IMMEDIATE") == 1, sql
        assert max(counts) <= STATEMENTS_PER_STORE, max(counts)
        # As a completion does it: a hit (its touch), then stores; the touch keeps the figures.
        for i in range(200, 260):
            assert holds(cache[[i - 100, 1]], [i - 100, 1])
            sql = statements.during(lambda i=i: cache.__setitem__([i, 1], make_state([i, 1])))
            assert len(sql) <= STATEMENTS_PER_STORE, sql
        assert cache.stats().writes == 260 and len(cache) == 260
        for i in range(260):
            assert holds(cache[[i, 1]], [i, 1])
        assert cache.check().ok


def test_the_view_a_store_keeps_in_memory_equals_a_replay_of_the_index(tmp_path: Path) -> None:
    """A second instance rebuilds its view from the index; both must agree on every entry and on
    the LRU order, and the byte counts must equal what check() measures."""
    directory = tmp_path / "c"
    with LlamaDiskCache(directory, capacity_bytes=1 << 30, write_behind=False, chunk_tokens=0) as cache:
        for i in range(50):
            cache[[i, 2]] = make_state([i, 2], 1_000 + 37 * i)
        cache[[3, 2]] = make_state([3, 2], 5_000, logits=True)  # a replacement: the full path
        assert holds(cache[[7, 2]], [7, 2], 1_000 + 37 * 7)  # a touch
        for i in range(50, 60):
            cache[[i, 2]] = make_state([i, 2], 1_000 + 37 * i)
        mine = [(e.id, e.file, e.size) for e in cache.entries()]
        with LlamaDiskCache(directory, capacity_bytes=1 << 30, write_behind=False, chunk_tokens=0) as other:
            assert [(e.id, e.file, e.size) for e in other.entries()] == mine
            assert other.cache_size == cache.cache_size
        report = cache.check()
        assert report.ok and report.disk_usage == report.budgeted_bytes == cache.disk_usage


def test_stores_of_two_instances_interleaved_stay_in_step(tmp_path: Path) -> None:
    """Each commit first replays what the other instance committed (its data_version changed), so
    the in-memory shortcut never applies over a change it has not seen."""
    directory = tmp_path / "c"
    a = LlamaDiskCache(directory, capacity_bytes=1 << 30, write_behind=False, chunk_tokens=0)
    b = LlamaDiskCache(directory, capacity_bytes=1 << 30, write_behind=False, chunk_tokens=0)
    try:
        for i in range(40):
            (a if i % 3 else b)[[i, 3]] = make_state([i, 3])
        b[[5, 3]] = make_state([5, 3], 3_000, logits=True)  # replaces an entry a stored
        for cache in (a, b):
            assert len(cache) == 40
            assert holds(cache[[5, 3]], [5, 3], 3_000) and cache[[5, 3]].logits is not None
            assert all(holds(cache[[i, 3]], [i, 3]) for i in range(40) if i != 5)
        assert [(e.id, e.file) for e in a.entries()] == [(e.id, e.file) for e in b.entries()]
        assert a.check().ok and a.cache_size == b.cache_size
    finally:
        a.close()
        b.close()


def test_a_store_near_the_budget_counts_pages_and_evicts_exactly(tmp_path: Path, statements: Statements) -> None:
    """Close to the budget the page bound does not fit: the store counts pages and evicts as before."""
    budget = 600_000
    with LlamaDiskCache(tmp_path / "c", capacity_bytes=budget, write_behind=False, chunk_tokens=0) as cache:
        for i in range(120):
            cache[[i, 4]] = make_state([i, 4], 9_000)
            report = cache.check()
            assert report.ok and report.disk_usage <= budget and report.disk_usage == cache.disk_usage
        assert cache.stats().evictions > 0
        sql = statements.during(lambda: cache.__setitem__([999, 4], make_state([999, 4], 9_000)))
        assert "PRAGMA page_count" in sql  # near the budget: counted, not bounded
        assert holds(cache[[999, 4]], [999, 4], 9_000)


def test_lookups_in_a_full_cache_shed_the_change_log_before_any_entry(tmp_path: Path) -> None:
    """The rows hits add to the change log take a full cache's index a page over the budget now and
    then: the log is trimmed and gives its pages back, not the entries the lookups read next
    (a key listed by keys() stays loadable while only lookups run)."""
    budget = 300_000
    with LlamaDiskCache(tmp_path / "c", capacity_bytes=budget, write_behind=False, chunk_tokens=0) as cache:
        i = 0
        while cache.stats().evictions == 0:  # full: within an entry of the budget
            cache[[i, 6]] = make_state([i, 6], 3_000)
            i += 1
        evictions = cache.stats().evictions
        for _ in range(40):  # thousands of touch rows: several new pages of the log
            for key in list(cache.keys()):
                assert holds(cache[list(key)], list(key), 3_000)
        assert cache.stats().evictions == evictions
        report = cache.check()
        assert report.ok and report.disk_usage <= budget and report.disk_usage == cache.disk_usage


def test_a_failed_commit_leaves_the_view_to_a_replay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = tmp_path / "c"
    with LlamaDiskCache(directory, capacity_bytes=1 << 30, write_behind=False, chunk_tokens=0) as cache:
        cache[[1, 5]] = make_state([1, 5])
        real = writes.maybe_trim

        def fail(*args: Any) -> Any:
            raise sqlite3.OperationalError("disk I/O error (injected)")

        monkeypatch.setattr(writes, "maybe_trim", fail)
        cache[[2, 5]] = make_state([2, 5])  # rolled back after its rows were written: logged, not cached
        monkeypatch.setattr(writes, "maybe_trim", real)
        assert cache.stats().store_errors == 1 and [2, 5] not in cache and len(cache) == 1
        cache[[3, 5]] = make_state([3, 5])
        assert holds(cache[[1, 5]], [1, 5]) and holds(cache[[3, 5]], [3, 5]) and len(cache) == 2
        report = cache.check()
        assert report.ok and report.orphan_files == () and report.budgeted_bytes == report.disk_usage


def test_a_lowered_sqlite_sequence_does_not_reuse_a_seq(tmp_path: Path) -> None:
    """The entry's recency is the next seq as AUTOINCREMENT picks it (past the largest seq present
    too), so a tampered sequence cannot make a store's change-log row go backwards."""
    directory = tmp_path / "c"
    with LlamaDiskCache(directory, capacity_bytes=1 << 30, write_behind=False, chunk_tokens=0) as cache:
        for i in range(5):
            cache[[i, 6]] = make_state([i, 6])
        with sqlite3.connect(directory / INDEX_FILE) as conn:
            conn.execute("UPDATE sqlite_sequence SET seq = 1 WHERE name = 'changes'")
        with LlamaDiskCache(directory, capacity_bytes=1 << 30, write_behind=False, chunk_tokens=0) as other:
            cache[[10, 6]] = make_state([10, 6])
            assert holds(other[[10, 6]], [10, 6]) and len(other) == 6
        conn = sqlite3.connect(directory / INDEX_FILE)
        try:
            last = conn.execute("SELECT max(seq) FROM changes").fetchone()[0]
            newest = conn.execute("SELECT key, recency FROM entries ORDER BY recency DESC LIMIT 1").fetchone()
        finally:
            conn.close()
        assert np.frombuffer(newest[0], "<i4").tolist() == [10, 6] and newest[1] == last > 5
        assert cache.check().ok
