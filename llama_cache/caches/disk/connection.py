"""Opening the disk tier's index so that nothing another process does to its files can fault this one.

The index is an SQLite database in a rollback journal (``journal_mode=TRUNCATE``; ``auto_vacuum=INCREMENTAL``
so that it can shrink: :mod:`.budget`), opened through the ``unix-none`` VFS with memory mapping off
(``mmap_size=0``): SQLite then reads and writes the files with plain system calls and has no shared
memory to map, so a file truncated or rewritten by another
process gives errors (``SQLITE_CORRUPT``, ``SQLITE_NOTADB``, ``SQLITE_CANTOPEN`` for a header that says
WAL), never SIGBUS. ``unix-none`` takes no locks: the processes exclude each other through
:class:`~.locking.DirectoryLock`, which every caller holds around its use of the connection.

An index left in WAL mode (by an earlier llama-cache, or by anyone) is converted when opened: in
``locking_mode=EXCLUSIVE`` SQLite keeps a WAL's index in private memory, so the conversion maps nothing
either. A damaged index is moved aside (:func:`move_aside`) and started again empty by the caller.

Functions here hold no state; the caller owns the connection and holds the directory's lock.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path
from typing import Any

# Errors that mean the index's bytes are not a usable database (as opposed to a busy, full or
# read-only one): the index is then moved aside and started again.
_DAMAGE = ("SQLITE_CORRUPT", "SQLITE_NOTADB")
# Errors that mean this connection no longer fits the file (its header now says WAL, the file was
# moved, or emptied or stripped of a table in place): the index is reopened, which converts it back
# from WAL and creates missing tables.
_STALE = ("SQLITE_CANTOPEN", "SQLITE_READONLY_DBMOVED")
_STALE_MESSAGES = ("no such table", "no such column")
# Files SQLite keeps beside the index; moved aside or removed with a damaged one.
_SIDE_FILES = ("-journal", "-wal", "-shm")


class IndexConnection(sqlite3.Connection):
    """An SQLite connection that remembers the first damage it saw (``damaged``) and its file.

    Attributes:
        damaged: the first error saying the database's bytes are damaged, or None.
        stale: an error said the connection must be reopened (the file changed under it).
        identity: (device, inode) of the index file when it was opened.
    """

    damaged: sqlite3.DatabaseError | None = None
    stale = False
    identity: tuple[int, int] = (-1, -1)

    def execute(self, sql: str, parameters: Any = (), /) -> sqlite3.Cursor:
        try:
            return self.cursor(_IndexCursor).execute(sql, parameters)
        except sqlite3.DatabaseError as error:
            self.note(error)
            raise

    def note(self, error: sqlite3.DatabaseError) -> None:
        """Remember what ``error`` says about the file (damaged, or to be reopened)."""
        if self.damaged is None and is_damage(error):
            self.damaged = error
        elif (getattr(error, "sqlite_errorname", "") or "").startswith(_STALE) or str(error).startswith(_STALE_MESSAGES):
            self.stale = True


class _IndexCursor(sqlite3.Cursor):
    """A cursor noting damage found while stepping through rows too (SQLite reads pages lazily)."""

    def __next__(self) -> Any:
        try:
            return super().__next__()
        except sqlite3.DatabaseError as error:
            self._note(error)
            raise

    def fetchone(self) -> Any:
        try:
            return super().fetchone()
        except sqlite3.DatabaseError as error:
            self._note(error)
            raise

    def fetchall(self) -> list[Any]:
        try:
            return super().fetchall()
        except sqlite3.DatabaseError as error:
            self._note(error)
            raise

    def _note(self, error: sqlite3.DatabaseError) -> None:
        conn = self.connection
        if isinstance(conn, IndexConnection):
            conn.note(error)


def is_damage(error: sqlite3.Error) -> bool:
    """Whether ``error`` says the index's bytes are not a database (rather than busy, full, read-only)."""
    name = getattr(error, "sqlite_errorname", "") or ""
    return name.startswith(_DAMAGE)


def file_identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the file at ``path``, or None when there is none."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino


def connect(db_path: Path, timeout: float, fsync: bool) -> IndexConnection:
    """Open the index (creating it if needed) in the safe mode this module describes. Directory lock held.

    Raises:
        sqlite3.Error: the index cannot be opened or is damaged (see :func:`is_damage`).
    """
    uri = "file:" + _quote(os.path.abspath(db_path)) + "?vfs=unix-none"
    conn = sqlite3.connect(uri, uri=True, timeout=timeout, isolation_level=None, check_same_thread=False,
                           factory=IndexConnection)
    assert isinstance(conn, IndexConnection)
    try:
        conn.identity = file_identity(db_path) or (-1, -1)
        conn.execute("PRAGMA mmap_size = 0")
        # EXCLUSIVE first: a database in WAL mode is then read with the WAL index in private memory,
        # and converted by the journal_mode switch. NORMAL again afterwards (``unix-none`` takes no
        # locks either way; NORMAL makes SQLite check for other processes' changes at each transaction).
        conn.execute("PRAGMA locking_mode = EXCLUSIVE")
        mode = conn.execute("PRAGMA journal_mode = TRUNCATE").fetchone()[0]
        if str(mode).lower() != "truncate":
            raise sqlite3.OperationalError(f"cannot use a rollback journal (got {mode})")
        conn.execute("PRAGMA locking_mode = NORMAL")
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()  # ends the exclusive hold
        # Takes effect when a new index gets its first table (an existing one is converted by the
        # store: budget.make_shrinkable): free pages can then be given back to keep the byte budget.
        conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
        # Without fsync a rollback journal needs no sync at all to survive a crash of the process;
        # a power loss may then damage the index, which is moved aside (it is a cache).
        conn.execute(f"PRAGMA synchronous = {'FULL' if fsync else 'OFF'}")
    except BaseException:
        conn.close()
        raise
    return conn


def _quote(path: str) -> str:
    """A path as a URI path: ``%``, ``?`` and ``#`` escaped."""
    return path.replace("%", "%25").replace("?", "%3f").replace("#", "%23")


def move_aside(db_path: Path) -> Path | None:
    """Rename a damaged index to ``<name>.damaged-<unix time>`` and remove its side files.

    Returns:
        The new name, or None when there was nothing to move (another process moved it first).

    Raises:
        OSError: it could not be renamed.
    """
    aside = db_path.with_name(f"{db_path.name}.damaged-{time.time():.6f}")
    try:
        os.rename(db_path, aside)
    except FileNotFoundError:
        return None
    for suffix in _SIDE_FILES:  # a journal or WAL of the damaged file must not be replayed into the new one
        try:
            os.unlink(f"{db_path}{suffix}")
        except FileNotFoundError:
            pass
    return aside
