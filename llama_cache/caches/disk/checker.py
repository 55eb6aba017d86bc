"""Reconciling a disk cache's index with its payload files: :func:`_check` and the orphan sweep.

:func:`_check` backs :meth:`LlamaDiskCache.check <llama_cache.caches.disk.LlamaDiskCache.check>`: it
lists malformed rows, orphan files (named by no row), rows whose file is missing, is not a regular file
or has another length than recorded, and (``deep``) rows whose payload does not decode, and returns a
:class:`CheckReport`. With ``fix`` it deletes the bad entries and malformed rows through the change log
(so other processes follow) and unlinks orphans older than the grace period. :func:`_reclaim_orphans`
is the sweep a cache runs when it opens a directory. Both work through the cache's own lock, connection
and in-memory view, and never raise for what the directory holds.
"""

from __future__ import annotations

import logging
import math
import sqlite3
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llama_cache.caches.disk.payloads import _Unreadable
from llama_cache.caches.disk.rows import _BadRow, _Entry, _entry_from_row, _model_info_from_row
from llama_cache.caches.disk.schema import _DELETE, _ROW, _transaction

if TYPE_CHECKING:
    from llama_cache.caches.disk.cache import LlamaDiskCache

logger = logging.getLogger("llama_cache.caches.disk")  # one logger for the whole disk tier


@dataclass(frozen=True, slots=True)
class CheckReport:
    """What :meth:`LlamaDiskCache.check` found (and, with ``fix``, repaired).

    Attributes:
        entries: rows in the index (malformed ones included).
        files: payload files in the data directory.
        bytes_indexed: sum of the sizes the valid rows record.
        bytes_on_disk: sum of the payload files' real sizes (orphans included).
        orphan_files: files no entry names: left by a crash between writing and committing, or being
            written right now. Harmless (wasted space).
        missing_files: entries whose file is gone. Harmless to callers (a miss) but a defect.
        size_mismatches: entries whose file length differs from the index's (or that are not regular
            files).
        corrupt_files: entries whose payload fails to decode (``deep`` checks only).
        index_ok: SQLite's ``quick_check`` passed.
        removed_entries: entries deleted by ``fix`` (malformed rows included).
        removed_files: orphan files deleted by ``fix`` (those older than the grace period).
        malformed_rows: rows of the index that do not validate (``"table #id: reason"``); ignored by
            lookups, deleted by ``fix``.
    """

    entries: int
    files: int
    bytes_indexed: int
    bytes_on_disk: int
    orphan_files: tuple[str, ...]
    missing_files: tuple[str, ...]
    size_mismatches: tuple[str, ...]
    corrupt_files: tuple[str, ...]
    index_ok: bool
    removed_entries: int = 0
    removed_files: int = 0
    malformed_rows: tuple[str, ...] = ()

    @property
    def problems(self) -> tuple[str, ...]:
        """What could hurt: rows naming a missing, resized or corrupt payload, and malformed rows."""
        return self.missing_files + self.size_mismatches + self.corrupt_files + self.malformed_rows

    @property
    def ok(self) -> bool:
        """True when nothing at all is wrong (no orphan either)."""
        return self.index_ok and not self.problems and not self.orphan_files


def _check(cache: LlamaDiskCache, fix: bool, deep: bool, grace_seconds: float) -> CheckReport:
    """What :meth:`LlamaDiskCache.check` does (see there); a function of the cache."""
    if isinstance(grace_seconds, bool) or not isinstance(grace_seconds, (int, float)) or math.isnan(grace_seconds):
        raise TypeError("grace_seconds must be a number")
    cache._wait_for_writes()
    try:
        with cache._lock:
            conn = cache._connection()
            cache._sync_or_log()
            raw_rows = conn.execute(f"SELECT {_ROW} FROM entries").fetchall()
            model_rows = conn.execute("SELECT rowid, fingerprint, info FROM models").fetchall()
            index_ok = conn.execute("PRAGMA quick_check").fetchone()[0] == "ok"
    except sqlite3.Error as error:
        logger.warning("check: index unavailable: %s", error)
        return CheckReport(0, 0, 0, 0, (), (), (), (), False)
    rows: list[_Entry] = []
    malformed: list[tuple[str, int, str]] = []
    named: set[Any] = set()
    for row in raw_rows:
        named.add(row[7])
        try:
            rows.append(_entry_from_row(row)[0])
        except _BadRow as problem:
            malformed.append(("entries", row[0], str(problem)))
    for rowid, fingerprint, info in model_rows:
        try:
            _model_info_from_row(fingerprint, info)
        except _BadRow as problem:
            malformed.append(("models", rowid, str(problem)))
    # Rows are read before the directory is listed: a file committed in between is then an
    # orphan younger than the grace period, never a "missing" file of a good entry.
    files = cache._data.list()
    missing: list[tuple[int, str]] = []
    mismatched: list[tuple[int, str]] = []
    corrupt: list[tuple[int, str]] = []
    for entry in rows:
        found = files.get(entry.file)
        if found is None:
            missing.append((entry.id, entry.file))
        elif found[0] != entry.size:
            mismatched.append((entry.id, entry.file))
        elif deep:
            with cache._lock:
                live = cache._view.entries.get(entry.id)
            if live is not None:
                try:
                    cache._load(live, None)
                except _Unreadable:
                    corrupt.append((entry.id, entry.file))
    # Rows evicted by another process while we looked are not problems.
    suspects = missing + mismatched + corrupt
    if suspects:
        with cache._lock:
            cache._sync_or_log()
            alive = {i for i, _ in suspects if i in cache._view.entries}
        missing = [m for m in missing if m[0] in alive]
        mismatched = [m for m in mismatched if m[0] in alive]
        corrupt = [m for m in corrupt if m[0] in alive]
    orphans = sorted(file for file in files if file not in named)
    removed_entries = removed_files = 0
    if fix:
        bad = {i for i, _ in missing + mismatched + corrupt}
        with cache._lock:
            cache._sync_or_log()
            victims = [cache._view.entries[i] for i in bad if i in cache._view.entries]
            removed_entries = len(cache._delete(victims))
            removed_entries += _delete_malformed(cache, malformed)
        now = time.time()
        with cache._lock:
            cache._sync_or_log()
            still_named = {entry.file for entry in cache._view.entries.values()}
        for file in orphans:
            if file in still_named or now - files[file][1] < grace_seconds:
                continue
            if cache._data.unlink(file):
                removed_files += 1
    return CheckReport(
        entries=len(raw_rows),
        files=len(files),
        bytes_indexed=sum(entry.size for entry in rows),
        bytes_on_disk=sum(max(size, 0) for size, _ in files.values()),
        orphan_files=tuple(orphans),
        missing_files=tuple(file for _, file in missing),
        size_mismatches=tuple(file for _, file in mismatched),
        corrupt_files=tuple(file for _, file in corrupt),
        index_ok=index_ok,
        removed_entries=removed_entries,
        removed_files=removed_files,
        malformed_rows=tuple(f"{table} #{rowid}: {reason}" for table, rowid, reason in malformed),
    )


def _delete_malformed(cache: LlamaDiskCache, malformed: list[tuple[str, int, str]]) -> int:
    """Delete malformed rows (their files, not trusted, are left to the orphan sweep). Lock held."""
    if not malformed:
        return 0
    removed = 0
    try:
        conn = cache._connection()
        with _transaction(conn):
            for table, rowid, _ in malformed:
                if table == "entries":
                    conn.execute(
                        "INSERT INTO changes (op, entry_id) SELECT ?, id FROM entries WHERE id = ?", (_DELETE, rowid)
                    )
                    removed += conn.execute("DELETE FROM entries WHERE id = ?", (rowid,)).rowcount
                else:
                    conn.execute("DELETE FROM models WHERE rowid = ?", (rowid,))
    except sqlite3.Error as error:
        logger.warning("check: could not delete malformed rows: %s", error)
        return 0
    cache._sync_or_log(force=True)
    return removed


def _reclaim_orphans(cache: LlamaDiskCache, grace_seconds: float) -> None:
    """Remove payload files no row names and older than ``grace_seconds`` (a crash's leftovers)."""
    try:
        files = cache._data.list()
        if not files:
            return
        with cache._lock:
            named = {row[0] for row in cache._connection().execute("SELECT file FROM entries")}
    except (sqlite3.Error, OSError) as error:
        logger.warning("disk cache: could not look for orphan files: %s", error)
        return
    now = time.time()
    removed = 0
    for file, (size, mtime) in files.items():
        if file not in named and now - mtime >= grace_seconds and cache._data.unlink(file):
            removed += 1
    if removed:
        logger.info("disk cache: removed %d orphan payload files (left by interrupted writes)", removed)

# --------------------------------------------------------------------------- index in memory
