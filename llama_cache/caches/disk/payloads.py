"""Payload files of the disk tier: one immutable file per entry under ``data/``, handled safely.

A payload is named ``ab/<32 hex>.llst`` (two random hex digits for the folder, 32 for the file) and
holds an encoded state (:mod:`llama_cache.state.format`), raw or zlib-compressed. The folder is
untrusted: :class:`_DataDir` reaches it only through directory descriptors opened with ``O_NOFOLLOW``
(no symbolic link below ``data/`` is ever followed), opens payloads with ``O_NONBLOCK`` (a FIFO never
blocks) and reads only regular files (``fstat``); unlinks go through the same descriptors, so nothing
outside ``data/`` is ever removed. Raw payloads are read into a new private buffer, never memory-mapped:
another process may truncate a file at any instant, and a mapped page past the new end of a file
faults the reader (SIGBUS) when llama.cpp or the checksum touches it; a read only comes back short.
Compressed payloads are inflated to exactly their recorded size, never more. New payloads are created
with ``O_EXCL`` and removed again if writing them fails. POSIX only (``dir_fd``).

A payload that cannot be read as its row says raises :class:`_Unreadable`, which callers turn into a
miss. Thread-safe: nothing here holds state beyond the folder's path.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from llama_cache.state.format import encoded_size

logger = logging.getLogger("llama_cache.caches.disk")  # one logger for the whole disk tier

DATA_DIR = "data"
_SUFFIX = ".llst"
_FILE_NAME = re.compile(r"[0-9a-f]{2}/[0-9a-f]{32}\.llst")
_SUBDIR_NAME = re.compile(r"[0-9a-f]{2}")
_CODECS = ("raw", "zlib")
_DEFAULT_ZLIB_LEVEL = 6
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_NOFOLLOW | _O_CLOEXEC
_O_READ = os.O_RDONLY | _O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | _O_CLOEXEC


class _Unreadable(Exception):
    """A payload could not be loaded; ``missing`` when its file does not exist."""

    def __init__(self, reason: str, missing: bool = False) -> None:
        super().__init__(reason)
        self.missing = missing


def _write_all(fd: int, data: Any) -> None:
    """Write a whole bytes-like object to ``fd`` (``os.write`` may write less than asked)."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        written = os.write(fd, view)
        view = view[written:]


def _read_exactly(fd: int, size: int) -> npt.NDArray[np.uint8]:
    """Read ``size`` bytes from the start of ``fd`` into a new read-only array (one copy, no zeroing).

    Raises:
        _Unreadable: the file ended first (truncated since it was opened).
    """
    buffer = np.empty(size, dtype=np.uint8)
    view = memoryview(buffer)
    done = 0
    while done < size:
        count = os.preadv(fd, [view[done:]], done)
        if count == 0:
            raise _Unreadable(f"payload shrank to {done} bytes while being read")
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


class _DataDir:
    """The payload folder, reached only through directory descriptors opened with ``O_NOFOLLOW``.

    No path under it is ever resolved by the kernel across a symbolic link, names are checked against
    the payload pattern, and reads open only regular files, without blocking. POSIX only (``dir_fd``).
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    @contextmanager
    def _subdir(self, subdir: str, create: bool = False) -> Iterator[int]:
        if not _SUBDIR_NAME.fullmatch(subdir):
            raise ValueError(f"not a payload folder name: {subdir!r}")
        data_fd = os.open(self.path, _O_DIR)
        try:
            if create:
                try:
                    os.mkdir(subdir, 0o755, dir_fd=data_fd)
                except FileExistsError:
                    pass
            fd = os.open(subdir, _O_DIR, dir_fd=data_fd)
        finally:
            os.close(data_fd)
        try:
            yield fd
        finally:
            os.close(fd)

    @staticmethod
    def _split(name: str) -> tuple[str, str]:
        if not isinstance(name, str) or not _FILE_NAME.fullmatch(name):
            raise ValueError(f"not a payload name: {name!r}")
        subdir, base = name.split("/")
        return subdir, base

    def open_regular(self, name: str) -> tuple[int, int]:
        """Open a payload for reading; return its descriptor and size.

        Raises:
            FileNotFoundError: it does not exist.
            _Unreadable: it is not a regular file (or a link, a FIFO, a folder...).
            OSError: it cannot be opened.
        """
        subdir, base = self._split(name)
        with self._subdir(subdir) as dir_fd:
            try:
                fd = os.open(base, _O_READ, dir_fd=dir_fd)
            except OSError as error:
                if error.errno == errno.ELOOP:
                    raise _Unreadable("payload is a symbolic link") from None
                raise
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise _Unreadable("payload is not a regular file")
        except BaseException:
            os.close(fd)
            raise
        return fd, info.st_size

    @contextmanager
    def create(self, name: str) -> Iterator[tuple[int, int]]:
        """Create a new payload (it must not exist); yield its descriptor and its folder's."""
        subdir, base = self._split(name)
        os.makedirs(self.path, exist_ok=True)
        with self._subdir(subdir, create=True) as dir_fd:
            fd = os.open(base, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, 0o644,
                         dir_fd=dir_fd)
            try:
                yield fd, dir_fd
            except BaseException:
                os.close(fd)
                _unlink_at(dir_fd, base, name)
                raise
            os.close(fd)

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
            _Unreadable: the file is missing (``missing``), not a regular file, of another length, or
                cannot be read or inflated.
        """
        try:
            fd, found = self.open_regular(name)
        except FileNotFoundError:
            raise _Unreadable("payload file is missing", missing=True) from None
        except (OSError, ValueError) as error:
            raise _Unreadable(f"cannot open payload: {error}") from None
        try:
            if found != size:
                raise _Unreadable(f"payload is {found} bytes, the index says {size}")
            if codec == "raw":
                return _read_exactly(fd, found)
            return _inflate(_read_all(fd, found), raw_size)
        except (OSError, ValueError, OverflowError, MemoryError) as error:
            raise _Unreadable(f"cannot read payload: {error}") from None
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
                    _write_all(fd, part)
                size = encoded_size(parts)
            else:
                compressor = zlib.compressobj(compress)
                size = 0
                for part in parts:
                    chunk = compressor.compress(part)
                    _write_all(fd, chunk)
                    size += len(chunk)
                tail = compressor.flush()
                _write_all(fd, tail)
                size += len(tail)
            if fsync:
                os.fsync(fd)
                os.fsync(dir_fd)
        return size

    def unlink(self, name: str) -> bool:
        """Remove a payload (never following a link, never outside the folder). Errors are logged."""
        try:
            subdir, base = self._split(name)
            with self._subdir(subdir) as dir_fd:
                return _unlink_at(dir_fd, base, name)
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as error:
            logger.warning("disk cache: could not remove %s: %s", name, error)
            return False

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
                        if not _FILE_NAME.fullmatch(name):
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


def _compress_level(compress: object) -> int | None:
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
        raise _Unreadable(f"corrupt compressed payload: {error}") from None
    if len(out) != raw_size or not inflater.eof or inflater.unconsumed_tail or inflater.unused_data:
        raise _Unreadable("compressed payload does not match its recorded size")
    return out

