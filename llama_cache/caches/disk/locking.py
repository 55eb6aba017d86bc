"""The disk tier's lock: a reentrant lock for the threads of a process, and the directory's for processes.

SQLite's own locking could not be kept: its WAL mode shares the index through a memory-mapped ``-shm``
file, and a rollback-journal connection on the default VFS still opens one whenever the database
header or a ``-wal`` file says WAL, which anyone able to write the directory can arrange. A ``-shm``
truncated by another process while mapped ends this one with SIGBUS. So the index is opened with
SQLite's ``unix-none`` VFS (no locks, no shared memory: a WAL header is then an error, never a
mapping; see :mod:`.connection`), and the processes exclude each other here instead: ``flock`` on the
cache directory itself, held from the first use of the index in a locked section to its outermost
release. Readers are exclusive too; sections are short (a sync, a commit).

A directory replaced by another one (removed and made again) is noticed when the lock is taken: the
lock then moves to the new directory. Thread-safety: the lock is the thread-safety. After ``fork`` the
child resets it (:meth:`DirectoryLock.reset_after_fork`); the parent's lock is never released by the
child (an ``flock`` belongs to the open file, which the two processes share).
"""

from __future__ import annotations

import errno
import fcntl
import os
import sqlite3
import threading
import time
from pathlib import Path
from types import TracebackType

_O_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_FIRST_WAIT = 0.0005  # seconds between attempts, doubling...
_LAST_WAIT = 0.01  # ...up to this


class DirectoryLock:
    """A reentrant lock whose holder may also take the cache directory's ``flock``.

    ``with lock:`` excludes the process's other threads, as an :class:`threading.RLock`.
    :meth:`hold_directory`, called inside, also excludes other processes until the outermost release.

    Args:
        directory: the cache directory (it must exist when :meth:`hold_directory` is called).
        timeout: seconds to wait for another process before giving up.
    """

    def __init__(self, directory: Path, timeout: float) -> None:
        self._directory = directory
        self._timeout = timeout
        self._rlock = threading.RLock()
        self._depth = 0
        self._fd: int | None = None
        self._held = False

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self._rlock.acquire(blocking, timeout):
            return False
        self._depth += 1
        return True

    def release(self) -> None:
        self._depth -= 1
        if self._depth == 0 and self._held:
            self._held = False
            assert self._fd is not None
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._rlock.release()

    def __enter__(self) -> DirectoryLock:
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.release()

    def hold_directory(self) -> bool:
        """Take the directory's lock until the outermost release, if not held yet. Lock held.

        Returns:
            True when it was taken now (another process may have changed the index since the last
            time), False when this section already held it.

        Raises:
            sqlite3.OperationalError: another process held it for ``timeout`` seconds, or the directory
                cannot be locked (gone, or a file system without ``flock``). The callers treat it as
                any unavailable index.
        """
        assert self._depth > 0, "hold_directory() needs the lock"
        if self._held:
            return False
        deadline = time.monotonic() + self._timeout
        wait = _FIRST_WAIT
        while True:
            try:
                fd = self._descriptor()
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise sqlite3.OperationalError(
                        f"the cache directory {str(self._directory)!r} is locked by another process"
                    ) from None
                time.sleep(wait)
                wait = min(wait * 2, _LAST_WAIT)
                continue
            except OSError as error:
                raise sqlite3.OperationalError(
                    f"cannot lock the cache directory {str(self._directory)!r}: {error.strerror or error}"
                ) from None
            if self._same_directory(fd):
                self._held = True
                return True
            fcntl.flock(fd, fcntl.LOCK_UN)  # a directory no longer at the path: lock the new one
            self._close()

    def _descriptor(self) -> int:
        if self._fd is None:
            self._fd = os.open(self._directory, _O_DIR)
        return self._fd

    def _same_directory(self, fd: int) -> bool:
        try:
            found = os.stat(self._directory)
        except OSError as error:
            if error.errno in (errno.ENOENT, errno.ENOTDIR):
                return True  # removed: whoever opens the index next makes it again, then locks it
            raise
        held = os.fstat(fd)
        return (found.st_dev, found.st_ino) == (held.st_dev, held.st_ino)

    def _close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def close(self) -> None:
        """Close the directory's descriptor (reopened when next needed). Lock held, directory not held."""
        if not self._held:
            self._close()

    def reset_after_fork(self) -> None:
        """In a forked child: start unlocked, on a descriptor of its own. The inherited one is closed,
        never unlocked: closing one of the descriptors sharing an ``flock`` does not release it for
        the parent."""
        self._close()
        self._rlock = threading.RLock()
        self._depth = 0
        self._held = False
