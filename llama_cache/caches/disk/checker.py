"""Reconciling a disk cache's index with its payload files: :func:`check` and the orphan sweep.

:func:`check` backs :meth:`LlamaDiskCache.check <llama_cache.caches.disk.LlamaDiskCache.check>`: it
lists malformed rows, orphan files (named by no row), rows whose file is missing, is not a regular file
or has another length than recorded, and (``deep``) rows whose payload does not decode; for chunks,
chunks no entry links (leaked) and entries linking a chunk that is not stored or whose file is bad. It
returns a :class:`CheckReport`, with what the directory takes as ``du`` counts it next to what the
byte budget counts (:mod:`.budget`). With ``fix`` it deletes the bad entries, leaked chunks and
malformed rows through the change log (so other processes follow), unlinks orphans older than the
grace period, removes empty shard folders and measures the folders' sizes again. :func:`storage`
counts unique and logical bytes. :func:`reclaim_orphans` is the sweep a cache runs when it opens a
directory (orphans, empty folders, the folders' sizes). They work through the cache's
:class:`~.store.DiskStore` (its lock, connection and in-memory view), and never raise for what the
directory holds.
"""

from __future__ import annotations

import logging
import math
import sqlite3
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llama_cache.caches.disk import budget, chunkstore
from llama_cache.caches.disk import reads
from llama_cache.caches.disk.chunkstore import BrokenChain
from llama_cache.caches.disk.payloads import Unreadable
from llama_cache.caches.disk.rows import BadRow, Entry, entry_from_row, is_int, model_info_from_row
from llama_cache.caches.disk.schema import DELETE, ENTRY_ROW

if TYPE_CHECKING:
    from llama_cache.caches.disk.store import DiskStore

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
        chunks: chunk rows in the index.
        leaked_chunks: chunks no entry links (ids in hex): harmless wasted space, freed by ``fix``.
        broken_chains: entries linking a chunk that is not stored, or whose file is missing or of
            another length (``deep``: or does not decode); misses for callers, deleted by ``fix``.
        empty_folders: shard folders of ``data/`` holding nothing (left by a killed process or an
            older version; a writer may be about to fill one): removed by ``fix``.
        disk_usage: what the directory takes on disk as ``du -s`` counts it (``st_blocks * 512`` of
            the directory and of everything below it, orphans and moved-aside indexes included),
            measured when the check ended.
        budgeted_bytes: what the byte budget counts at the same moment (``LlamaDiskCache.disk_usage``):
            at most ``capacity_bytes``, and equal to ``disk_usage`` but for what the budget cannot see
            (see :mod:`.budget`).
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
    chunks: int = 0
    leaked_chunks: tuple[str, ...] = ()
    broken_chains: tuple[str, ...] = ()
    empty_folders: tuple[str, ...] = ()
    disk_usage: int = 0
    budgeted_bytes: int = 0

    @property
    def problems(self) -> tuple[str, ...]:
        """What could hurt: rows naming a missing, resized or corrupt payload or chunk, malformed rows."""
        return self.missing_files + self.size_mismatches + self.corrupt_files + self.malformed_rows + self.broken_chains

    @property
    def ok(self) -> bool:
        """True when nothing at all is wrong (no orphan either)."""
        return self.index_ok and not self.problems and not self.orphan_files and not self.leaked_chunks


@dataclass(frozen=True, slots=True)
class StorageReport:
    """How much sharing chunks saves: :meth:`LlamaDiskCache.storage`.

    Attributes:
        entries: entries in the index.
        chunks: chunk files.
        unique_bytes: bytes of every payload, head and chunk file, each once (what the disk holds).
        logical_bytes: what the entries would take stored whole: each entry's payload or head plus
            every chunk it links, counted once per entry linking it.
    """

    entries: int
    chunks: int
    unique_bytes: int
    logical_bytes: int

    @property
    def dedup_ratio(self) -> float:
        """``logical_bytes / unique_bytes`` (1.0 for an empty cache)."""
        return self.logical_bytes / self.unique_bytes if self.unique_bytes else 1.0


def storage(store: DiskStore) -> StorageReport:
    """What :meth:`LlamaDiskCache.storage` does (after the façade's pending writes); a function of the store."""
    with store.lock:
        store.sync()
        conn = store.connection()
        chunks = conn.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]
        linked = conn.execute(
            "SELECT COALESCE(SUM(c.size), 0) FROM links AS l JOIN chunks AS c ON c.id = l.chunk "
            "WHERE typeof(c.size) = 'integer' AND c.size > 0"
        ).fetchone()[0]
        entry_bytes = store.view.bytes
        unique = entry_bytes + store.chunk_bytes
    return StorageReport(
        len(store.view.entries), int(chunks) if is_int(chunks) else 0, unique,
        entry_bytes + (int(linked) if is_int(linked) else 0),
    )


def check(store: DiskStore, fix: bool, deep: bool, grace_seconds: float) -> CheckReport:
    """What :meth:`LlamaDiskCache.check` does (see there; after the façade's pending writes); a function of
    the store."""
    if isinstance(grace_seconds, bool) or not isinstance(grace_seconds, (int, float)) or math.isnan(grace_seconds):
        raise TypeError("grace_seconds must be a number")
    try:
        with store.lock:
            conn = store.connection()
            store.sync_or_log()
            raw_rows = conn.execute(f"SELECT {ENTRY_ROW} FROM entries").fetchall()
            model_rows = conn.execute("SELECT rowid, fingerprint, info FROM models").fetchall()
            chunk_rows = conn.execute(f"SELECT {chunkstore.CHUNK_COLUMNS} FROM chunks").fetchall()
            links = conn.execute("SELECT entry_id, chunk FROM links").fetchall()
            index_ok = conn.execute("PRAGMA quick_check").fetchone()[0] == "ok"
    except sqlite3.Error as error:
        logger.warning("check: index unavailable: %s", error)
        return CheckReport(0, 0, 0, 0, (), (), (), (), False)
    rows: list[Entry] = []
    malformed: list[tuple[str, Any, str]] = []
    named: set[Any] = set()
    for row in raw_rows:
        named.add(row[7])
        try:
            rows.append(entry_from_row(row)[0])
        except BadRow as problem:
            malformed.append(("entries", row[0], str(problem)))
    chunks: dict[bytes, chunkstore.ChunkRow] = {}
    for row in chunk_rows:
        named.add(row[5])
        try:
            chunk = chunkstore.chunk_from_row(row)
        except BadRow as problem:
            malformed.append(("chunks", row[0], str(problem)))
            continue
        chunks[chunk.id] = chunk
    for rowid, fingerprint, info in model_rows:
        try:
            model_info_from_row(fingerprint, info)
        except BadRow as problem:
            malformed.append(("models", rowid, str(problem)))
    # Rows are read before the directory is listed: a file committed in between is then an
    # orphan younger than the grace period, never a "missing" file of a good entry.
    files = store.data.list()
    missing: list[tuple[int, str]] = []
    mismatched: list[tuple[int, str]] = []
    corrupt: list[tuple[int, str]] = []
    broken: list[tuple[int, str]] = []  # chunked entries whose chain is not whole
    for entry in rows:
        found = files.get(entry.file)
        if found is None:
            missing.append((entry.id, entry.file))
        elif found[0] != entry.size:
            mismatched.append((entry.id, entry.file))
        elif deep:
            with store.lock:
                live = store.view.entries.get(entry.id)
            if live is not None:
                try:
                    reads.load(store, live, None)
                except Unreadable:
                    corrupt.append((entry.id, entry.file))
                except BrokenChain as problem:
                    broken.append((entry.id, f"entry {entry.id}: {problem}"))
    # Chunks: every link must name a stored chunk whose file is there with its length.
    linked: dict[bytes, list[int]] = {}
    for entry_id, ident in links:
        linked.setdefault(ident, []).append(entry_id)
    for ident, users in linked.items():
        chunk = chunks.get(ident)
        found = files.get(chunk.file) if chunk is not None else None
        if chunk is None or found is None or found[0] != chunk.size:
            what = "not stored" if chunk is None else "file missing" if found is None else "file of another length"
            broken += [(user, f"entry {user}: chunk {ident.hex() if isinstance(ident, bytes) else ident!r} {what}")
                       for user in users]
    leaked = sorted(ident for ident in chunks if ident not in linked)
    # Rows evicted by another process while we looked are not problems.
    suspects = missing + mismatched + corrupt + broken
    if suspects:
        with store.lock:
            store.sync_or_log()
            alive = {i for i, _ in suspects if i in store.view.entries}
        missing = [m for m in missing if m[0] in alive]
        mismatched = [m for m in mismatched if m[0] in alive]
        corrupt = [m for m in corrupt if m[0] in alive]
        broken = [m for m in broken if m[0] in alive]
    orphans = sorted(file for file in files if file not in named)
    empty = store.data.empty_folders()
    removed_entries = removed_files = 0
    if fix:
        bad = {i for i, _ in missing + mismatched + corrupt + broken}
        with store.lock:
            store.sync_or_log()
            victims = [store.view.entries[i] for i in bad if i in store.view.entries]
            removed_entries = len(store.delete(victims))
            removed_entries += _delete_malformed(store, malformed)
            _release_leaked(store, leaked)
        now = time.time()
        with store.lock:
            store.sync_or_log()
            still_named = {entry.file for entry in store.view.entries.values()}
            try:
                still_named |= {row[0] for row in store.connection().execute("SELECT file FROM chunks")}
            except sqlite3.Error:
                still_named |= set(files)  # unknown: remove nothing
        removed_files = store.remove_files(
            [file for file in orphans if file not in still_named and now - files[file][1] >= grace_seconds]
        )
        store.data.remove_folders(empty)
        store.measure_folders()
    try:
        with store.lock:
            budgeted = store.usage()
    except sqlite3.Error as error:
        logger.warning("check: index unavailable: %s", error)
        budgeted = 0
    return CheckReport(
        entries=len(raw_rows),
        files=len(files),
        bytes_indexed=sum(entry.size for entry in rows),
        bytes_on_disk=sum(max(size, 0) for size, _ in files.values()),
        orphan_files=tuple(orphans),
        missing_files=tuple(file for _, file in missing),
        size_mismatches=tuple(file for _, file in mismatched),
        corrupt_files=tuple(file for _, file in corrupt),
        chunks=len(chunk_rows),
        leaked_chunks=tuple(ident.hex() for ident in leaked),
        broken_chains=tuple(reason for _, reason in broken),
        empty_folders=tuple(empty),
        disk_usage=budget.measure(store.cache_dir),
        budgeted_bytes=budgeted,
        index_ok=index_ok,
        removed_entries=removed_entries,
        removed_files=removed_files,
        malformed_rows=tuple(
            f"{table} #{rowid.hex() if isinstance(rowid, bytes) else rowid}: {reason}" for table, rowid, reason in malformed
        ),
    )


def _release_leaked(store: DiskStore, leaked: list[bytes]) -> None:
    """Free chunks no entry links (rechecked in the transaction), then unlink their files. Lock held."""
    if not leaked:
        return
    try:
        with store.transaction() as conn:
            freed = chunkstore.release(conn, leaked)
    except sqlite3.Error as error:
        logger.warning("check: could not free leaked chunks: %s", error)
        return
    store.sync_or_log(force=True)
    store.remove_files([file for file, _ in freed])


def _delete_malformed(store: DiskStore, malformed: list[tuple[str, Any, str]]) -> int:
    """Delete malformed rows (their files, not trusted, are left to the orphan sweep). Lock held."""
    if not malformed:
        return 0
    removed = 0
    try:
        with store.transaction() as conn:
            for table, rowid, _ in malformed:
                if table == "entries":
                    conn.execute(
                        "INSERT INTO changes (op, entry_id) SELECT ?, id FROM entries WHERE id = ?", (DELETE, rowid)
                    )
                    removed += conn.execute("DELETE FROM entries WHERE id = ?", (rowid,)).rowcount
                    conn.execute("DELETE FROM links WHERE entry_id = ?", (rowid,))
                elif table == "chunks":
                    conn.execute("DELETE FROM chunks WHERE id = ?", (rowid,))
                else:
                    conn.execute("DELETE FROM models WHERE rowid = ?", (rowid,))
    except sqlite3.Error as error:
        logger.warning("check: could not delete malformed rows: %s", error)
        return 0
    store.sync_or_log(force=True)
    return removed


def reclaim_orphans(store: DiskStore, grace_seconds: float) -> None:
    """Remove payload files no row names and older than ``grace_seconds`` (a crash's leftovers), then
    the shard folders that are empty, and measure the others' sizes for the byte budget."""
    try:
        files = store.data.list()
        with store.lock:
            conn = store.connection()
            named = {row[0] for row in conn.execute("SELECT file FROM entries UNION ALL SELECT file FROM chunks")}
    except (sqlite3.Error, OSError) as error:
        logger.warning("disk cache: could not look for orphan files: %s", error)
        return
    now = time.time()
    removed = store.remove_files(
        [file for file, (_, mtime) in files.items() if file not in named and now - mtime >= grace_seconds]
    )
    if removed:
        logger.info("disk cache: removed %d orphan payload files (left by interrupted writes)", removed)
    holding = {file.partition("/")[0] for file in files if file in named or now - files[file][1] < grace_seconds}
    store.data.remove_folders(set(store.data.folder_sizes()) - holding)  # rmdir: only empty ones go
    store.measure_folders()

# --------------------------------------------------------------------------- index in memory
