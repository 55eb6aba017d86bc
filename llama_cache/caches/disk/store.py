"""The disk tier's store: the directory's lock, this process's index connection and view, the counters.

:class:`DiskStore` is what :class:`~.cache.LlamaDiskCache` and its helpers (:mod:`.chunked`,
:mod:`.checker`, :mod:`.reads`, :mod:`.writes`) share, so that none of them reaches into the façade: the lock (the
process's threads and, while the index is used, the directory's other processes: :mod:`.locking`), the
SQLite connection (opened without shared memory by :mod:`.connection`, reopened after ``fork``, when
another process replaced or removed the index, and after moving a damaged index aside), the in-memory
:class:`~.view.IndexView` kept in step with the change log (:meth:`DiskStore.sync`), the data folder
(:class:`~.payloads.DataDir`; reading entries back is :mod:`.reads`), touches and deletes through the change
log, removing files (and the shard folders that leaves empty: :meth:`DiskStore.remove_files`), the
instance's counters and the storage settings (``compress``, ``fsync``, ``verify``, ``chunk_tokens``,
which the façade's attributes of the same names read and set) and its byte budget (:mod:`.budget`).

Thread-safety: methods marked "Lock held" need ``with store.lock``; the others take it themselves.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from llama_cache.caches.disk import budget, chunkstore
from llama_cache.caches.disk.chunkstore import BrokenChain
from llama_cache.caches.disk.connection import IndexConnection, connect, file_identity, is_damage, move_aside
from llama_cache.caches.disk.locking import DirectoryLock
from llama_cache.caches.disk.payloads import DATA_DIR, DataDir, Unreadable
from llama_cache.caches.disk.rows import BadRow, Entry, entry_from_row, is_int
from llama_cache.caches.disk.schema import (
    ENTRY_ROW,
    TOUCH,
    INDEX_FILE,
    CacheDirectoryError,
    create_schema,
    delete_rows,
    shed_log,
    transaction,
)
from llama_cache.caches.disk.view import IndexView

logger = logging.getLogger("llama_cache.caches.disk")  # one logger for the whole disk tier

# Connections inherited across fork: kept referenced so that their finalizer never runs in the child.
_ABANDONED: list[IndexConnection] = []


@dataclass(slots=True)
class Counters:
    """One cache instance's counters (see :class:`~llama_cache.caches.base.CacheStats`). Lock held to change."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    rejected: int = 0
    write_errors: int = 0
    writes: int = 0
    store_errors: int = 0
    index_resets: int = 0


class DiskStore:
    """A cache directory as one process uses it (see the module docstring).

    Args:
        cache_dir: the directory (created when opened).
        timeout: seconds to wait for another process's use of the index.
        fsync, compress, verify, chunk_tokens: the storage settings (validated by the façade).
        capacity: the byte budget (validated by the façade), which lookups that grow the index keep too.
        block: the file system's block (:func:`.budget.block_size`).
    """

    def __init__(
        self, cache_dir: Path, *, timeout: float, fsync: bool, compress: int | None, verify: bool,
        chunk_tokens: int | None, capacity: int, block: int,
    ) -> None:
        self.cache_dir = cache_dir
        self.timeout = timeout
        self.fsync = fsync
        self.compress = compress
        self.verify = verify
        self.chunk_tokens = chunk_tokens
        self.capacity = capacity
        self.block = block
        self.shards = budget.shard_count(capacity, block)  # folders new files are spread over
        self.data_dir = cache_dir / DATA_DIR
        self.data = DataDir(self.data_dir)
        self.db_path = cache_dir / INDEX_FILE
        self.lock = DirectoryLock(cache_dir, timeout)
        self.view = IndexView(self.log_bad_row, block)
        # The chunk files, as of the last sync: their bytes, and in whole blocks.
        self.chunk_bytes = self.chunk_charged = 0
        # Figures of the index kept between statements while no other connection commits (see
        # sync): the folders table's valid rows and the page size. None: read them at the next use.
        self._folders: dict[str, int] | None = None
        self._page_size: int | None = None
        # An upper bound of the index's pages as of now (None: unknown): measured, then grown by the
        # most a store's rows can add (budget.growth_bound), so that stores far from the budget need
        # no page count. Dropped by every write transaction but the stores' and by mark_stale.
        self._pages_bound: int | None = None
        # The cache folder's and data/'s own bytes, and data.folder_changes when they were measured.
        self._top: tuple[int, int] | None = None
        self.counters = Counters()
        # Per-process state (reset after fork): the connection and what it has replayed.
        self._pid = os.getpid()
        self._conn: IndexConnection | None = None
        self._data_version = -1
        self._bad_rows: set[tuple[str, int]] = set()  # malformed rows already logged

    def close(self) -> None:
        """Close the connection (reopened when next needed). Lock held."""
        conn, self._conn = self._conn, None
        if conn is not None and self._pid == os.getpid():
            conn.close()
        self.lock.close()

    def reset_after_fork(self) -> None:
        """In a forked child (the fork hook, before any other use): drop everything tied to the
        parent's process, the lock included."""
        self._forget_parent()
        self.lock.reset_after_fork()

    def _forget_parent(self) -> None:
        """Drop the parent's connection (never touching its SQLite) and catch up at the next sync."""
        if self._conn is not None:
            _ABANDONED.append(self._conn)  # closing it could disturb the parent's transaction
            self._conn = None
        self._pid = os.getpid()
        self.mark_stale()  # the in-memory index stays valid; the next sync catches up

    # ----------------------------------------------------------------------------- keeping in step

    def log_bad_row(self, table: str, rowid: Any, reason: str) -> None:
        """Log a malformed row once per (table, row)."""
        marker = (table, rowid if is_int(rowid) else -1)
        if marker not in self._bad_rows:
            self._bad_rows.add(marker)
            logger.warning("disk cache: ignoring malformed %s row #%s in %s: %s", table, rowid, self.db_path, reason)

    def sync_or_log(self, force: bool = False) -> None:
        """:meth:`sync`, logging an unavailable index instead of raising (the last view stays). Lock held."""
        try:
            self.sync(force)
        except sqlite3.Error as error:
            logger.warning("disk cache: index unavailable (%s)", error)

    def sync(self, force: bool = False) -> None:
        """Apply the changes other connections committed since the last sync (with ``force``, this
        connection's too: after a write it did not take into the view itself). Lock held.

        Cheap when nothing changed: one ``PRAGMA data_version`` (which changes exactly when another
        connection commits; this connection's own writes keep the view in step themselves: see
        :meth:`added` and the callers of ``sync(force=True)``). A replay that fails leaves the view
        marked out of step, so that the next sync replays again.
        """
        conn = self.connection()
        version = conn.execute("PRAGMA data_version").fetchone()[0]
        if version == self._data_version and not force:
            return
        if version != self._data_version:
            self.mark_stale()  # another connection committed: every figure is read again
        else:
            self._data_version = -1  # only this connection wrote: its figures stay; the view replays
        if conn.in_transaction:
            self.view.replay(conn)
            self.chunk_bytes, self.chunk_charged = chunkstore.stored_bytes(conn, self.block)
        else:
            conn.execute("BEGIN")
            try:
                self.view.replay(conn)
                self.chunk_bytes, self.chunk_charged = chunkstore.stored_bytes(conn, self.block)
            finally:
                conn.execute("COMMIT")
        self._data_version = version

    def mark_stale(self) -> None:
        """Forget what this process knows of the index beyond its view, and mark the view for a replay
        at the next :meth:`sync` (after a write that failed half-way, or before replaying). Lock held."""
        self._data_version = -1
        self._folders = None
        self._page_size = None
        self._pages_bound = None
        self._top = None

    def added(self, entry: Entry, tokens: npt.NDArray[np.int32]) -> None:
        """Take into the view an entry this connection has just committed, with the only change-log row
        its transaction wrote (its add, ``entry.recency``), the view having been in step when the
        transaction began: what replaying that row would do, without the queries. Lock held."""
        self.view.add(entry, tokens)
        self.view.last_seq = entry.recency

    # ------------------------------------------------------------------------------ index figures

    def folder_sizes(self, conn: sqlite3.Connection) -> dict[str, int]:
        """The recorded sizes of the shard folders (valid rows of the ``folders`` table), read once
        and then kept in step by :meth:`record_folders` until another connection commits. Lock held;
        in the caller's transaction. Do not modify the returned mapping."""
        if self._folders is None:
            self._folders = budget.read_folders(conn)
        return self._folders

    def record_folders(self, conn: sqlite3.Connection, sizes: dict[str, int], gone: set[str]) -> None:
        """Record measured folder sizes and forget folders found missing, writing only the rows that
        change (most stores change none). Lock held; in the caller's write transaction (whose
        failure must be followed by :meth:`mark_stale`)."""
        known = self.folder_sizes(conn)
        changed = {name: nbytes for name, nbytes in sizes.items() if known.get(name) != nbytes}
        missing = set(gone)
        if changed or missing:
            budget.record_folders(conn, changed, gone=missing)
            known.update(changed)
            for name in missing:
                known.pop(name, None)

    def top_bytes(self) -> int:
        """The cache folder's and ``data/``'s own bytes (:func:`.budget.top_bytes`), measured again only
        when this process made or removed a shard folder or another one committed since (two ``lstat``
        calls then): other changes to those two folders' sizes are what the budget cannot see. Lock held."""
        changes = self.data.folder_changes
        if self._top is None or self._top[0] != changes:
            self._top = (changes, budget.top_bytes(self))
        return self._top[1]

    def page_size(self, conn: sqlite3.Connection) -> int:
        """The index's page size, read once per connection (and again after another one committed)."""
        if self._page_size is None:
            self._page_size = int(conn.execute("PRAGMA page_size").fetchone()[0])
        return self._page_size

    def index_bytes(self, conn: sqlite3.Connection) -> int:
        """Bytes of the index file as of the caller's transaction (:func:`.budget.index_bytes`): one
        ``PRAGMA page_count`` and a ``stat``. Lock held; the last statement of a store's transaction
        that changes the index (the page count it measures is then this connection's bound)."""
        pages, nbytes = budget.index_size(conn, self.block, self.db_path, self.page_size(conn))
        self._pages_bound = pages
        return nbytes

    def index_bound(self, conn: sqlite3.Connection, grown: int) -> int | None:
        """An upper bound of the index's bytes once a store's rows, which can add at most ``grown``
        pages (:func:`.budget.growth_bound`), are written, without counting pages; None when no bound
        is known. Taking it makes it this connection's bound. Lock held, in a store's transaction."""
        if self._pages_bound is None:
            return None
        self._pages_bound += grown
        return budget.index_bytes_of(self._pages_bound, self.page_size(conn), self.block, self.db_path)

    @contextmanager
    def transaction(self, keeps_bound: bool = False) -> Iterator[IndexConnection]:
        """A write transaction (``BEGIN IMMEDIATE`` ... ``COMMIT``) on this process's connection. Lock held.

        Args:
            keeps_bound: the transaction keeps the bound of the index's pages up to date itself
                (a store's, a touch's, a delete's: they end by counting or bounding the pages); any
                other drops it.

        On failure (rolled back) the view and figures are marked for a replay (:meth:`mark_stale`).

        Raises:
            sqlite3.Error: the index is unavailable, or a statement failed.
        """
        conn = self.connection()
        if not keeps_bound:
            self._pages_bound = None
        try:
            with transaction(conn):
                yield conn
        except BaseException:
            self.mark_stale()
            raise

    # ------------------------------------------------------------------------------- connection

    def connection(self) -> IndexConnection:
        """This process's connection, (re)opened as needed, with the directory's lock held. Lock held.

        At the start of a locked section the index is reopened if another process replaced or removed
        its file, and moved aside and started again if this connection found it damaged.

        Raises:
            sqlite3.Error: the directory cannot be locked or the index cannot be opened (for callers,
                an unavailable index like any other).
        """
        if self._pid != os.getpid():
            self._forget_parent()
        fresh = self.lock.hold_directory()
        conn = self._conn
        if conn is not None and fresh and (
            conn.damaged is not None or conn.stale or file_identity(self.db_path) != conn.identity
        ):
            self._conn = None
            conn.close()
            if conn.damaged is not None and file_identity(self.db_path) == conn.identity:
                try:
                    self._set_aside(conn.damaged)
                except CacheDirectoryError as error:
                    raise sqlite3.OperationalError(str(error)) from None
            else:
                logger.info("disk cache: %s was replaced or removed by another process; reopening it", self.db_path)
        if self._conn is None:
            try:
                self.open()
            except CacheDirectoryError as error:
                raise sqlite3.OperationalError(str(error)) from None
        assert self._conn is not None
        return self._conn

    def open(self) -> None:
        """Open (creating if needed) the directory and its index; a damaged index is moved aside. Lock held.

        Raises:
            CacheDirectoryError: the directory or its index cannot be used.
        """
        try:
            os.makedirs(self.data_dir, exist_ok=True)
            if not self.cache_dir.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "not a directory")
        except OSError as error:
            raise CacheDirectoryError(
                error.errno, f"cannot use {str(self.cache_dir)!r} as a disk cache directory: {error.strerror or error}"
            ) from None
        try:
            self.lock.hold_directory()
        except sqlite3.Error as error:
            raise CacheDirectoryError(str(error)) from None
        for attempt in range(2):
            try:
                conn = connect(self.db_path, self.timeout, self.fsync)
            except sqlite3.Error as error:
                if attempt or not is_damage(error):
                    message = f"cannot open the disk cache index {str(self.db_path)!r}: {error}"
                    raise CacheDirectoryError(message) from None
                self._set_aside(error)
                continue
            try:
                self._prepare(conn)
            except sqlite3.Error as error:
                conn.close()
                if attempt or not is_damage(error):
                    message = f"cannot use the disk cache index {str(self.db_path)!r}: {error}"
                    raise CacheDirectoryError(message) from None
                self._set_aside(error)
                continue
            except BaseException:
                conn.close()
                raise
            self._conn = conn
            return

    def _set_aside(self, damage: sqlite3.Error) -> None:
        """Move a damaged index aside and count it; the next open starts an empty one. Lock held.

        Raises:
            CacheDirectoryError: it cannot be moved.
        """
        try:
            aside = move_aside(self.db_path)
        except OSError as error:
            raise CacheDirectoryError(
                error.errno, f"cannot move the damaged disk cache index {str(self.db_path)!r} aside: {error.strerror}"
            ) from None
        self.mark_stale()
        if aside is None:
            return  # another process moved it first
        self.counters.index_resets += 1
        logger.warning(
            "disk cache: the index %s is damaged (%s); moved it aside to %s and started again empty",
            self.db_path, damage, aside.name,
        )

    def _prepare(self, conn: IndexConnection) -> None:
        with transaction(conn):
            create_schema(conn, self.db_path)
        try:
            if budget.make_shrinkable(conn):
                logger.info("disk cache: converted %s to incremental auto-vacuum (it can shrink now)", self.db_path)
        except sqlite3.Error as error:
            if is_damage(error):
                raise
            logger.warning("disk cache: could not convert %s to incremental auto-vacuum: %s", self.db_path, error)
        conn.execute("BEGIN")
        try:
            self.view.rebuild(conn)
            self.chunk_bytes, self.chunk_charged = chunkstore.stored_bytes(conn, self.block)
        finally:
            conn.execute("COMMIT")
        self.mark_stale()  # a new connection: its figures are read again when needed
        self._data_version = conn.execute("PRAGMA data_version").fetchone()[0]

    # ----------------------------------------------------------------------------------- entries

    def forget_unreadable(self, entry: Entry, problem: Unreadable) -> None:
        """Remove an entry whose payload could not be loaded, unless another process already did."""
        with self.lock:
            self.sync()
            if entry.id not in self.view.entries:
                return  # evicted or replaced meanwhile: not damage
            logger.warning("disk cache: dropping entry %s (%s): %s", entry.id, entry.file, problem)
            self.delete([entry])

    def forget_broken_chunk(self, entry: Entry, broken: BrokenChain) -> None:
        """Remove a damaged chunk and every entry linking it, unless the chain changed meanwhile.

        A chunk freed or absorbed by another process between reading the links and opening the file
        is not damage: the entry's links have moved on, and the next attempt reads the new ones.
        """
        with self.lock:
            try:
                self.sync()
                if entry.id not in self.view.entries:
                    return
                conn = self.connection()
                linked = [row[0] for row in conn.execute("SELECT chunk FROM links WHERE entry_id = ?", (entry.id,))]
                if broken.chunk is not None and broken.chunk not in linked:
                    return
                if broken.chunk is None:
                    users = [entry.id]
                else:
                    users = [row[0] for row in conn.execute("SELECT entry_id FROM links WHERE chunk = ?", (broken.chunk,))]
            except sqlite3.Error as error:
                logger.warning("disk cache: index unavailable (%s)", error)
                return
            victims = [self.view.entries[i] for i in users if i in self.view.entries]
            logger.warning(
                "disk cache: dropping %d entries using a damaged chunk %s: %s",
                len(victims), broken.chunk.hex() if broken.chunk else "(links)", broken.reason,
            )
            self.delete(victims)

    def touch(self, entry_id: int, hit: bool = True) -> bool:
        """Make an entry the most recently used, for every process. Lock held; errors are logged.

        Should the change log's row take the index over the budget (a new page), the log is trimmed
        to that row in the same transaction, and least recently used entries are evicted only if the
        directory still does not fit (see :meth:`_fit_grown_index`).

        Returns:
            Whether the entry was there to touch (False also when the index is unavailable).
        """
        try:
            with self.transaction(keeps_bound=True) as conn:
                before = budget.index_pages(conn)
                cursor = conn.execute(
                    "INSERT INTO changes (op, entry_id) SELECT ?, id FROM entries WHERE id = ?",
                    (TOUCH, entry_id),
                )
                if cursor.rowcount:
                    conn.execute(
                        "UPDATE entries SET recency = ?, accessed = ?, hits = hits + ? WHERE id = ?",
                        (cursor.lastrowid, time.time(), 1 if hit else 0, entry_id),
                    )
                evicted, freed = self._fit_grown_index(conn, before, {entry_id})
        except sqlite3.Error as error:
            logger.warning("disk cache: could not record a hit: %s", error)
            return False
        self.sync_or_log(force=True)
        self.remove_files([victim.file for victim in evicted] + [file for file, _ in freed])
        return cursor.rowcount > 0

    def delete(self, victims: list[Entry]) -> list[Entry]:
        """Delete entries in one transaction, then unlink their files. Lock held; errors are logged.

        Should logging the deletes take the index over the budget, the log is trimmed to its last row,
        then least recently used entries are evicted if need be (not returned; counted as evictions).

        Returns:
            The entries deleted.
        """
        if not victims:
            return []
        try:
            with self.transaction(keeps_bound=True) as conn:
                before = budget.index_pages(conn)
                deleted, linked = delete_rows(conn, victims)
                freed = chunkstore.release(conn, linked)
                evicted, also_freed = self._fit_grown_index(conn, before, {victim.id for victim in victims})
        except sqlite3.Error as error:
            logger.warning("disk cache: could not delete %d entries: %s", len(victims), error)
            return []
        self.sync_or_log(force=True)
        self.remove_files([entry.file for entry in deleted + evicted] + [file for file, _ in freed + also_freed])
        return deleted

    def _fit_grown_index(
        self, conn: sqlite3.Connection, before: int, keep: set[int]
    ) -> tuple[list[Entry], list[tuple[str, int]]]:
        """In a write transaction that may have grown the index past ``before`` pages: should that take
        the directory over the budget, shed the change log but its last row (its rows are what grew),
        then evict least recently used entries (not in ``keep``) only if the directory still does not
        fit. Lock held.

        Costs one pragma when the index did not grow.
        """
        pages = budget.index_pages(conn)
        if pages <= before:
            self._pages_bound = pages  # exact: the transaction writes nothing after this
            return [], []
        self.sync(force=True)  # in the transaction: the view is the index as this transaction leaves it
        files = budget.files_bytes(self, conn)
        fixed = self.top_bytes() + sum(self.folder_sizes(conn).values())
        if files + fixed + self.index_bytes(conn) > self.capacity:
            # A hit or a delete frees nothing an entry holds: the log gives its pages back first
            # (evict_to_fit reclaims them), so that a full cache's lookups do not evict its entries.
            self.view.floor = shed_log(conn, self.view.last_seq, self.view.floor)
        evicted, freed, _ = budget.evict_to_fit(self, conn, self.capacity, files, keep)
        self.counters.evictions += len(evicted)
        return evicted, freed

    # ------------------------------------------------------------------------------------ files

    def remove_files(self, names: list[str]) -> int:
        """Unlink files no committed row names, remove the shard folders this leaves empty and drop
        their recorded sizes. Errors are logged. The lock is taken only when a folder went.

        Returns:
            How many files were removed.
        """
        if not names:
            return 0
        removed, folders = self.data.unlink(names)
        if folders:
            self.forget_folders(folders)
        return removed

    def forget_folders(self, folders: set[str]) -> None:
        """Drop the recorded sizes of removed shard folders (one made again since is measured
        instead). Takes the lock; errors are logged."""
        with self.lock:
            try:
                with self.transaction() as conn:
                    still = self.data.folder_sizes(folders)
                    self.record_folders(conn, still, gone=folders - still.keys())
            except sqlite3.Error as error:
                logger.warning("disk cache: could not record removed folders: %s", error)

    def measure_folders(self) -> None:
        """Measure every shard folder again and record exactly those sizes (at open, ``check(fix=True)``):
        what removals by killed processes or older versions left unrecorded. Should the folders have
        grown behind the index's back (a killed writer's files, on ext4, leave a folder larger for
        good), least recently used entries are evicted until the directory fits its budget again, in
        the same transaction. Takes the lock; one ``stat`` per folder; errors are logged."""
        with self.lock:
            try:
                with self.transaction() as conn:
                    self._folders = self._top = None
                    budget.replace_folders(conn, self.data.folder_sizes())
                    self.sync(force=True)  # in the transaction: the view is the index it evicts from
                    evicted, freed, _ = budget.evict_to_fit(self, conn, self.capacity, budget.files_bytes(self, conn), ())
            except sqlite3.Error as error:
                logger.warning("disk cache: could not measure the folders: %s", error)
                return
            self.counters.evictions += len(evicted)
            if evicted or freed:
                self.sync_or_log(force=True)
        self.remove_files([entry.file for entry in evicted] + [file for file, _ in freed])

    def usage(self) -> int:
        """What the directory takes as the budget counts it (:mod:`.budget`), after a sync. Lock held.

        Raises:
            sqlite3.Error: the index is unavailable.
        """
        self.sync()
        conn = self.connection()
        return (
            self.view.charged + self.chunk_charged + self.index_bytes(conn)
            + budget.top_bytes(self) + sum(self.folder_sizes(conn).values())
        )

    def valid_rows(self, order: str = "recency") -> list[tuple[Entry, npt.NDArray[np.int32], tuple[Any, ...]]]:
        """Every valid row of the entries table with its extra columns (created, accessed, hits). Lock held."""
        out = []
        for row in self.connection().execute(f"SELECT {ENTRY_ROW}, created, accessed, hits FROM entries ORDER BY {order}"):
            try:
                entry, tokens = entry_from_row(row[:12])
            except BadRow as problem:
                self.log_bad_row("entries", row[0], str(problem))
                continue
            out.append((entry, tokens, row[12:]))
        return out
