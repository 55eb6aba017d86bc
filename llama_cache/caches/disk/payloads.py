"""Payload files of the disk tier: one immutable file per entry under ``data/``, handled safely.

A payload is named ``ab/<32 hex>.llst`` (two random hex digits for the folder, 32 for the file) and
holds an encoded state (:mod:`llama_cache.state.format`), raw or zlib-compressed. The folder is
untrusted: :class:`DataDir` reaches it only through directory descriptors opened with ``O_NOFOLLOW``
(no symbolic link below ``data/`` is ever followed), opens payloads with ``O_NONBLOCK`` (a FIFO never
blocks) and reads only regular files (``fstat``); unlinks go through the same descriptors, so nothing
outside ``data/`` is ever removed. Raw payloads are read into a new private buffer, never memory-mapped:
another process may truncate a file at any instant, and a mapped page past the new end of a file
faults the reader (SIGBUS) when llama.cpp or the checksum touches it; a read only comes back short.
Compressed payloads are inflated to exactly their recorded size, never more. New payloads are created
with ``O_EXCL`` and removed again if writing them fails. POSIX only (``dir_fd``).

**Shard folders come and go.** A folder is made by the first write into it and removed (``rmdir``,
which only ever removes an empty folder) when a removal takes its last file away, so none is left
behind empty. Another process may remove a folder between this one making or opening it and creating
a file in it: the kernel then refuses the creation (``ENOENT``) and :meth:`DataDir.create` makes the
folder again and retries, so a writer never loses a race with a remover.

A payload that cannot be read as its row says raises :class:`Unreadable`, which callers turn into a
miss. Thread-safe: nothing here holds state beyond the folder's path.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import stat
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from llama_cache.state.format import encoded_size

logger = logging.getLogger("llama_cache.caches.disk")  # one logger for the whole disk tier

DATA_DIR = "data"
SUFFIX = ".llst"  # of every payload, chain head and chunk file
FILE_NAME = re.compile(r"[0-9a-f]{2}/[0-9a-f]{32}\.llst")  # a valid payload name (rows naming anything else are malformed)
_SUBDIR_NAME = re.compile(r"[0-9a-f]{2}")
CODECS = ("raw", "zlib")  # the codec column's values
_DEFAULT_ZLIB_LEVEL = 6
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_NOFOLLOW | _O_CLOEXEC
_O_READ = os.O_RDONLY | _O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | _O_CLOEXEC
_O_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC
_CREATE_ATTEMPTS = 8  # folders removed under a writer before it gives up (each retry needs a new race)
# rmdir failures that mean "not removable now": not empty, gone, or not a folder (a link put there).
_KEEP_FOLDER = (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT, errno.ENOTDIR, errno.EBUSY)


def new_name(shards: int = 256) -> str:
    """A fresh payload name (random: two writers never pick the same file) in one of the first
    ``shards`` folders (1..256: :func:`.budget.shard_count`)."""
    return f"{secrets.randbelow(shards):02x}/{secrets.token_hex(16)}{SUFFIX}"


class Unreadable(Exception):
    """A payload could not be loaded; ``missing`` when its file does not exist."""

    def __init__(self, reason: str, missing: bool = False) -> None:
        super().__init__(reason)
        self.missing = missing


def write_all(fd: int, data: Any) -> None:
    """Write a whole bytes-like object to ``fd`` (``os.write`` may write less than asked)."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        written = os.write(fd, view)
        view = view[written:]


def _read_exactly(fd: int, size: int) -> npt.NDArray[np.uint8]:
    """Read ``size`` bytes from the start of ``fd`` into a new read-only array (one copy, no zeroing).

    Raises:
        Unreadable: the file ended first (truncated since it was opened).
    """
    buffer = np.empty(size, dtype=np.uint8)
    view = memoryview(buffer)
    done = 0
    while done < size:
        count = os.preadv(fd, [view[done:]], done)
        if count == 0:
            raise Unreadable(f"payload shrank to {done} bytes while being read")
        done += count
    buffer.flags.writeable = False
    return buffer


def _read_all(fd: int, size: int) -> bytes:
    chunks = []
    while size > 0:
        chunk = os.read(fd, size)
        if not chunk:
            break
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


class DataDir:
    """The payload folder, reached only through directory descriptors opened with ``O_NOFOLLOW``.

    No path under it is ever resolved by the kernel across a symbolic link, names are checked against
    the payload pattern, and reads open only regular files, without blocking. POSIX only (``dir_fd``).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        # Shard folders this process made or removed, ever: ``data/`` itself can only have changed
        # size through this process when this count changed (see DiskStore.top_bytes).
        self.folder_changes = 0

    def _open_subdir(self, subdir: str, create: bool = False) -> int:
        """A descriptor of a shard folder (with ``create``, made if it does not exist, and ``data/``
        too); the caller closes it. Two ``open`` calls when the folder exists (no ``mkdir``).

        Raises:
            ValueError: not a shard folder name.
            FileNotFoundError: it does not exist (or was removed right after being made).
            OSError: it cannot be opened (a link, a file...).
        """
        if not _SUBDIR_NAME.fullmatch(subdir):
            raise ValueError(f"not a payload folder name: {subdir!r}")
        try:
            data_fd = os.open(self.path, _O_DIR)
        except FileNotFoundError:
            if not create:
                raise
            os.makedirs(self.path, exist_ok=True)  # removed under the cache: made again
            data_fd = os.open(self.path, _O_DIR)
        try:
            try:
                return os.open(subdir, _O_DIR, dir_fd=data_fd)
            except FileNotFoundError:
                if not create:
                    raise
            try:
                os.mkdir(subdir, 0o755, dir_fd=data_fd)
                self.folder_changes += 1
            except FileExistsError:  # made meanwhile by another writer
                pass
            return os.open(subdir, _O_DIR, dir_fd=data_fd)
        finally:
            os.close(data_fd)

    @contextmanager
    def _subdir(self, subdir: str) -> Iterator[int]:
        fd = self._open_subdir(subdir)
        try:
            yield fd
        finally:
            os.close(fd)

    @staticmethod
    def _split(name: str) -> tuple[str, str]:
        if not isinstance(name, str) or not FILE_NAME.fullmatch(name):
            raise ValueError(f"not a payload name: {name!r}")
        subdir, base = name.split("/")
        return subdir, base

    def open_regular(self, name: str) -> tuple[int, int]:
        """Open a payload for reading; return its descriptor and size.

        Raises:
            FileNotFoundError: it does not exist.
            Unreadable: it is not a regular file (or a link, a FIFO, a folder...).
            OSError: it cannot be opened.
        """
        subdir, base = self._split(name)
        with self._subdir(subdir) as dir_fd:
            try:
                fd = os.open(base, _O_READ, dir_fd=dir_fd)
            except OSError as error:
                if error.errno == errno.ELOOP:
                    raise Unreadable("payload is a symbolic link") from None
                raise
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise Unreadable("payload is not a regular file")
        except BaseException:
            os.close(fd)
            raise
        return fd, info.st_size

    @contextmanager
    def create(self, name: str) -> Iterator[tuple[int, int]]:
        """Create a new payload (it must not exist); yield its descriptor and its folder's.

        Its folder is made if needed, again if another process removes it meanwhile (see the module
        docstring). On an exception the file is removed, and its folder too if that left it empty.
        """
        subdir, base = self._split(name)
        dir_fd, fd = self._create_in(subdir, base)
        try:
            try:
                yield fd, dir_fd
            except BaseException:
                os.close(fd)
                fd = -1
                _unlink_at(dir_fd, base, name)
                self.remove_folders([subdir])
                raise
        finally:
            if fd >= 0:
                os.close(fd)
            os.close(dir_fd)

    def _create_in(self, subdir: str, base: str) -> tuple[int, int]:
        """Make ``subdir`` if needed and create ``base`` in it; return the folder's and the file's descriptors."""
        for attempt in range(_CREATE_ATTEMPTS):
            try:
                dir_fd = self._open_subdir(subdir, create=True)
            except FileNotFoundError:  # removed between the mkdir and the open
                if attempt == _CREATE_ATTEMPTS - 1:
                    raise
                continue
            try:
                return dir_fd, os.open(base, _O_CREATE, 0o644, dir_fd=dir_fd)
            except FileNotFoundError:  # the folder was removed once open: make it again
                os.close(dir_fd)
                if attempt == _CREATE_ATTEMPTS - 1:
                    raise
            except BaseException:
                os.close(dir_fd)
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def read(self, name: str, size: int, codec: str, raw_size: int) -> Any:
        """Read a payload as its row describes it: copied when raw, inflated when compressed.

        Args:
            name: the payload name.
            size: the file's length the row records.
            codec: ``"raw"`` or ``"zlib"``.
            raw_size: the length of the encoded state (``size`` unless compressed).

        Returns:
            The encoded state: a read-only array of bytes owned by the caller (never a mapping).

        Raises:
            Unreadable: the file is missing (``missing``), not a regular file, of another length, or
                cannot be read or inflated.
        """
        try:
            fd, found = self.open_regular(name)
        except FileNotFoundError:
            raise Unreadable("payload file is missing", missing=True) from None
        except (OSError, ValueError) as error:
            raise Unreadable(f"cannot open payload: {error}") from None
        try:
            if found != size:
                raise Unreadable(f"payload is {found} bytes, the index says {size}")
            if codec == "raw":
                return _read_exactly(fd, found)
            return _inflate(_read_all(fd, found), raw_size)
        except (OSError, ValueError, OverflowError, MemoryError) as error:
            raise Unreadable(f"cannot read payload: {error}") from None
        finally:
            os.close(fd)

    def write(self, name: str, parts: list[memoryview], compress: int | None, fsync: bool) -> int:
        """Create the payload ``name`` (which must not exist) holding ``parts``; remove it on any failure.

        Args:
            name: a new payload name.
            parts: the encoded state, in pieces.
            compress: a zlib level, or None to write the parts as they are.
            fsync: ``fsync`` the file and its folder before returning.

        Returns:
            The file's length.

        Raises:
            OSError: the file cannot be created or written (it is then removed).
        """
        with self.create(name) as (fd, dir_fd):
            if compress is None:
                for part in parts:
                    write_all(fd, part)
                size = encoded_size(parts)
            else:
                compressor = zlib.compressobj(compress)
                size = 0
                for part in parts:
                    chunk = compressor.compress(part)
                    write_all(fd, chunk)
                    size += len(chunk)
                tail = compressor.flush()
                write_all(fd, tail)
                size += len(tail)
            if fsync:
                os.fsync(fd)
                os.fsync(dir_fd)
        return size

    def unlink(self, names: Iterable[str]) -> tuple[int, set[str]]:
        """Remove payloads (never following a link, never outside the folder), then each folder that
        this left empty. Errors are logged. Costs a system call per file and one per folder.

        Returns:
            How many files were removed, and the names of the folders removed.
        """
        by_folder: dict[str, list[str]] = {}
        for name in names:
            try:
                subdir, base = self._split(name)
            except ValueError as error:
                logger.warning("disk cache: could not remove %s: %s", name, error)
                continue
            by_folder.setdefault(subdir, []).append(base)
        removed = 0
        for subdir, bases in by_folder.items():
            try:
                with self._subdir(subdir) as dir_fd:
                    removed += sum(_unlink_at(dir_fd, base, f"{subdir}/{base}") for base in bases)
            except FileNotFoundError:
                continue
            except OSError as error:
                logger.warning("disk cache: could not remove files of %s: %s", subdir, error)
                continue
        return removed, self.remove_folders(by_folder)

    def remove_folders(self, subdirs: Iterable[str]) -> set[str]:
        """Remove those of these shard folders that are empty (``rmdir``: never a folder holding
        anything, never through a link). Errors other than "not empty" or "gone" are logged.

        Returns:
            The names of the folders removed.
        """
        gone: set[str] = set()
        wanted = [subdir for subdir in subdirs if _SUBDIR_NAME.fullmatch(subdir)]
        if not wanted:
            return gone
        try:
            data_fd = os.open(self.path, _O_DIR)
        except OSError:
            return gone
        try:
            for subdir in wanted:
                try:
                    os.rmdir(subdir, dir_fd=data_fd)
                    self.folder_changes += 1
                except OSError as error:
                    if error.errno not in _KEEP_FOLDER:
                        logger.warning("disk cache: could not remove the folder %s: %s", subdir, error)
                    continue
                gone.add(subdir)
        finally:
            os.close(data_fd)
        return gone

    def empty_folders(self) -> list[str]:
        """The shard folders holding nothing at all (a listing of each folder: for ``check``)."""
        empty = []
        for subdir in sorted(self.folder_sizes()):
            try:
                with self._subdir(subdir) as dir_fd, os.scandir(dir_fd) as children:
                    if next(children, None) is None:
                        empty.append(subdir)
            except OSError:  # gone meanwhile, or not a folder any more
                continue
        return empty

    def folder_sizes(self, subdirs: Iterable[str] | None = None) -> dict[str, int]:
        """Bytes on disk (``st_blocks * 512``, as ``du`` counts) of shard folders: those named, or all.

        A name that is not a folder (missing, a link, a file) is left out. One system call per folder
        (plus a listing of ``data/`` when ``subdirs`` is None); nothing is followed.
        """
        found: dict[str, int] = {}
        try:
            data_fd = os.open(self.path, _O_DIR)
        except OSError:
            return found
        try:
            if subdirs is None:
                try:
                    subdirs = [entry.name for entry in os.scandir(data_fd)]
                except OSError as error:
                    logger.warning("disk cache: cannot list %s: %s", self.path, error)
                    return found
            for subdir in subdirs:
                if not _SUBDIR_NAME.fullmatch(subdir):
                    continue
                try:
                    info = os.stat(subdir, dir_fd=data_fd, follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISDIR(info.st_mode):
                    found[subdir] = info.st_blocks * 512
        finally:
            os.close(data_fd)
        return found

    def list(self) -> dict[str, tuple[int, float]]:
        """Payload-named entries under the folder: name -> (size, mtime). Links and folders included
        (as size -1), so that they are reported and removable; nothing is followed."""
        found: dict[str, tuple[int, float]] = {}
        try:
            data_fd = os.open(self.path, _O_DIR)
        except (FileNotFoundError, NotADirectoryError):
            return found
        except OSError as error:
            logger.warning("disk cache: cannot list %s: %s", self.path, error)
            return found
        try:
            subdirs = [e.name for e in os.scandir(data_fd) if _SUBDIR_NAME.fullmatch(e.name)]
        except OSError as error:
            logger.warning("disk cache: cannot list %s: %s", self.path, error)
            return found
        finally:
            os.close(data_fd)
        for subdir in subdirs:
            try:
                with self._subdir(subdir) as dir_fd:
                    for child in os.scandir(dir_fd):
                        name = f"{subdir}/{child.name}"
                        if not FILE_NAME.fullmatch(name):
                            continue
                        try:
                            info = child.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        size = info.st_size if stat.S_ISREG(info.st_mode) else -1
                        found[name] = (size, info.st_mtime)
            except OSError:  # a link or a file where a folder should be, or gone meanwhile
                continue
        return found


def _unlink_at(dir_fd: int, base: str, name: str) -> bool:
    try:
        os.unlink(base, dir_fd=dir_fd)
        return True
    except FileNotFoundError:
        return False
    except OSError as error:
        logger.warning("disk cache: could not remove %s: %s", name, error)
        return False


def compress_level(compress: object) -> int | None:
    """Validate ``compress``: None, ``"zlib"`` (level 6) or a zlib level 1..9.

    Raises:
        TypeError, ValueError: anything else (``True`` included: say which level).
    """
    if compress is None:
        return None
    if compress == "zlib" and isinstance(compress, str):
        return _DEFAULT_ZLIB_LEVEL
    if isinstance(compress, bool) or not isinstance(compress, (int, str)):
        raise TypeError(f"compress must be None, 'zlib' or a zlib level 1..9, got {compress!r}")
    if isinstance(compress, str) or not 1 <= compress <= 9:
        raise ValueError(f"compress must be None, 'zlib' or a zlib level 1..9, got {compress!r}")
    return compress



def _inflate(data: bytes, raw_size: int) -> bytes:
    """Decompress a zlib payload of exactly ``raw_size`` bytes (never more: no decompression bomb)."""
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(data, raw_size + 1)
    except zlib.error as error:
        raise Unreadable(f"corrupt compressed payload: {error}") from None
    if len(out) != raw_size or not inflater.eof or inflater.unconsumed_tail or inflater.unused_data:
        raise Unreadable("compressed payload does not match its recorded size")
    return out

