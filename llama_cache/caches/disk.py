"""LlamaDiskCache: a persistent prefix-state cache that several processes can share.

Layout of ``cache_dir``::

    index.sqlite3 (+ -wal, -shm)   the index (SQLite in WAL mode): entries, a change log, metadata,
                                    the models of the namespaces
    data/ab/ab12...ef.llst          one immutable payload file per entry, in the format of
                                    :mod:`llama_cache.state.format` (optionally zlib-compressed)

**Write protocol** (diskcache's, see STYLE.md): the payload goes to a new, uniquely named file first
(``O_EXCL``; ``fsync`` optional); then the metadata is committed in one ``BEGIN IMMEDIATE``
transaction that also deletes the rows of replaced and evicted entries; their files are unlinked only
after ``COMMIT``. A crash at any instant therefore leaves either the old index or the new one, both
naming complete files; at worst an uncommitted file is left behind: an orphan, which the next
:class:`LlamaDiskCache` opened on the directory removes once it is older than
``ORPHAN_GRACE_SECONDS`` (younger ones may be writes in progress), as ``check(fix=True)`` does. Without
``fsync`` a power loss can lose recent entries or leave a committed row naming a file whose bytes
never reached the disk; the checksum makes that a miss, never a wrong state.

**Reads** take the best entry from an in-process :class:`~llama_cache.index.RadixIndex` (O(K) in the
query length, no scan over entries), memory-map its file and decode it in place (no copy), verifying
the checksum (XXH3-64) by default. The returned
state hands llama.cpp its bytes straight from the mapping. A missing, truncated or tampered payload is
a miss: logged at WARNING, the entry removed, the next best entry tried. Nothing is ever unpickled.
Payload files are never modified once written, so a mapping stays valid even after its entry is
evicted; a file truncated *in place* by something else while a state read from it is in use would
fault the process (SIGBUS), as with any memory-mapped file.

**The directory is untrusted input.** Whoever can write the index or the payload folder can spoil the
cache (lookups then miss) but nothing more:

- every row is validated before it is used (types, a key of whole int32 tokens, non-negative, a
  payload name matching ``ab/<32 hex>.llst`` exactly, sizes within what a state with that many tokens
  can be: ``_STATE_BASE_BYTES + _STATE_BYTES_PER_TOKEN`` per token, at most ``_MAX_STATE_BYTES``);
  a row that does not validate is ignored, logged once at WARNING, and deleted by ``check(fix=True)``;
- payloads are opened relative to the data folder's descriptor, each component with ``O_NOFOLLOW``
  (a symbolic link anywhere below ``data/`` is never followed) and ``O_NONBLOCK`` (a FIFO never
  blocks), and only regular files (``fstat``) are read; unlinks go through the same descriptors, so
  nothing outside ``data/`` is ever removed;
- decompression never produces more than the row's validated ``raw_size``;
- a decoded state must hold the tokens of its row's key, in the row's namespace, of the row's kind:
  a row pointed at another entry's payload is a miss, never a wrong state.

**Several processes**: every change to the set of entries or to their recency appends a row to the
``changes`` table, whose ``seq`` increases monotonically. Each process applies the rows newer than the
last it saw before answering (checked through ``PRAGMA data_version``, so an idle index costs one
pragma), which keeps its radix index, its LRU order and its byte count equal to the database's. Old
log rows are trimmed; a process that fell behind the trimmed part rebuilds its index from the entries
table, as it does at open. After ``fork`` the child opens its own SQLite connection (the inherited one
is abandoned, never used nor closed, as SQLite requires).

**Write-behind** (the default): ``cache[key] = state`` queues the state (it is immutable, so this costs
nothing beyond the copy ``save_state`` already made) and a background thread encodes, writes and
commits it. Lookups, ``len``, ``cache_size`` and ``stats`` first wait for the writes queued before them,
so a process always reads its own writes. The queue is bounded (``max_pending``): a caller producing
states faster than the disk takes them waits. Queues are drained by :meth:`LlamaDiskCache.flush`,
:meth:`LlamaDiskCache.close`, at interpreter exit and before ``fork``. A state already stored under
its key (same namespace, same tokens, logits if the new one has them) is not written again: the store
only makes it the most recently used.

**Namespaces**: an entry is filed under its state's ``fingerprint`` (the model and KV configuration
that made it). llama-cpp-python's own states carry no fingerprint unless ``llama_cache.Llama`` set one;
they are filed under the cache's bound fingerprint, or under ``UNBOUND_NAMESPACE`` when the cache is
unbound. A cache bound to a fingerprint (``fingerprint=`` or :meth:`LlamaDiskCache.bind`) answers only
from that namespace, so one directory serves several models without ever handing one another's
state. An unbound cache answers from every namespace (``llama_cache.Llama.load_state`` still refuses a
foreign state, which is then a miss); bind it when a directory is shared between models, including by
plain ``llama_cpp.Llama`` instances: ``cache.bind(llm)``.

**Cut or not**: transformer states (and llama-cpp-python's) can be cut back to a shorter prefix, so
such an entry answers any query sharing a first token (longest common prefix). Recurrent and hybrid
states cannot: such an entry answers only queries its whole key is a prefix of.
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import json
import logging
import math
import mmap
import os
import re
import secrets
import sqlite3
import stat
import threading
import time
import weakref
import zlib
from collections import OrderedDict, deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import numpy.typing as npt

from llama_cache.caches.base import DEFAULT_CAPACITY_BYTES, BaseLlamaCache, CacheStats
from llama_cache.index import Match, RadixIndex
from llama_cache.state.format import (
    KIND_LLAMA_CACHE,
    KIND_UPSTREAM,
    CorruptStateError,
    decode,
    decode_upstream,
    encode,
    encode_upstream,
    encoded_size,
    payload_kind,
)
from llama_cache.state.fingerprint import model_description, model_fingerprint
from llama_cache.state.llama_state import LlamaState
from llama_cache.state.values import can_be_cut, filing_key, state_tokens
from llama_cache.tokens import as_token_array

logger = logging.getLogger(__name__)

__all__ = [
    "INDEX_FILE",
    "UNBOUND_NAMESPACE",
    "CacheDirectoryError",
    "CheckReport",
    "DiskEntry",
    "LlamaDiskCache",
]

INDEX_FILE = "index.sqlite3"
DATA_DIR = "data"
SCHEMA_VERSION = 2
UNBOUND_NAMESPACE = "llama-cpp-python"
"""The namespace of llama-cpp-python states stored without a fingerprint into an unbound cache."""
ORPHAN_GRACE_SECONDS = 600.0
"""Orphan payload files older than this are removed when a cache opens the directory."""
_SUFFIX = ".llst"
_FILE_NAME = re.compile(r"[0-9a-f]{2}/[0-9a-f]{32}\.llst")
_SUBDIR_NAME = re.compile(r"[0-9a-f]{2}")
_CODECS = ("raw", "zlib")
_DEFAULT_ZLIB_LEVEL = 6

# Bounds on what the index may claim (everything read from it is untrusted).
_MAX_NAMESPACE = 256  # characters of a namespace (fingerprints are 32)
_MAX_KEY_TOKENS = 1 << 24
_STATE_BASE_BYTES = 256 << 20  # recurrent memory, a logits row, headers...
_STATE_BYTES_PER_TOKEN = 4 << 20  # KV per token of the largest models, or a scores row of a huge vocabulary
_MAX_STATE_BYTES = 64 << 30
_ZLIB_MAX_RATIO = 1032  # deflate cannot compress better than about 1032:1
_MAX_MODEL_INFO = 16  # fields of a model description
_MAX_MODEL_FIELD = 200  # characters of each

_ADD, _TOUCH, _DELETE = 1, 2, 3  # change-log operations
_TRIM_EVERY = 20_000  # log rows accumulated before a trim...
_TRIM_KEEP = 5_000  # ...which keeps this many (a process further behind rebuilds its index)
_LOAD_ATTEMPTS = 8  # entries tried by one lookup before it gives up (each failure removes one)
# Read-only shared mappings, pre-faulted where the platform can (the checksum reads every page anyway).
_MAP_FLAGS = getattr(mmap, "MAP_SHARED", 0) | getattr(mmap, "MAP_POPULATE", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_NOFOLLOW | _O_CLOEXEC
_O_READ = os.O_RDONLY | _O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | _O_CLOEXEC

_ENTRY_COLUMNS = (
    "id", "namespace", "key", "key_hash", "kind", "cut", "logits", "n_state", "file", "size", "raw_size",
    "codec", "created", "accessed", "recency", "hits",
)
_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS entries (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        namespace TEXT NOT NULL,     -- the state's model fingerprint
        key BLOB NOT NULL,           -- the tokens, int32 little-endian
        key_hash BLOB NOT NULL,      -- blake2b-128 of key, for uniqueness
        kind INTEGER NOT NULL,       -- 0 llama-cache LlamaState, 1 llama-cpp-python LlamaState
        cut INTEGER NOT NULL,        -- 1 when the state can be cut back to a shorter prefix
        logits INTEGER NOT NULL,     -- 1 when the state holds logits
        n_state INTEGER NOT NULL,    -- tokens the state holds (the key is a prefix of them)
        file TEXT NOT NULL,          -- payload path relative to data/
        size INTEGER NOT NULL,       -- bytes of the payload file
        raw_size INTEGER NOT NULL,   -- bytes of the encoded state (size unless compressed)
        codec TEXT NOT NULL,         -- 'raw' or 'zlib'
        created REAL NOT NULL,       -- unix time
        accessed REAL NOT NULL,      -- unix time of the last store or hit
        recency INTEGER NOT NULL,    -- seq of the last add/touch change: the LRU order
        hits INTEGER NOT NULL DEFAULT 0,
        UNIQUE (namespace, key_hash)
    )""",
    "CREATE INDEX IF NOT EXISTS entries_recency ON entries (recency)",
    """CREATE TABLE IF NOT EXISTS changes (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        op INTEGER NOT NULL,         -- 1 add, 2 touch, 3 delete
        entry_id INTEGER NOT NULL,
        namespace TEXT,              -- deletes only: the entry is gone from `entries`
        key BLOB                     -- deletes only
    )""",
    "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
    "INSERT OR IGNORE INTO meta (name, value) VALUES ('floor', 0)",
    """CREATE TABLE IF NOT EXISTS models (
        fingerprint TEXT PRIMARY KEY, -- a namespace
        info TEXT NOT NULL            -- JSON object of short strings: file, desc, n_params
    )""",
)
_TABLES = ("entries", "changes", "meta", "models")
_ROW = "id, namespace, key, kind, cut, logits, n_state, file, size, raw_size, codec, recency"

# Changes newer than a seq, with what replaying them needs. Adds and touches join their entry: an
# entry deleted since has no row, and its delete follows in the log.
_REPLAY = """
    SELECT c.seq, c.op, c.entry_id, c.key,
           e.id, e.namespace, e.key, e.kind, e.cut, e.logits, e.n_state, e.file, e.size, e.raw_size,
           e.codec, e.recency
    FROM changes AS c LEFT JOIN entries AS e ON c.op != 3 AND e.id = c.entry_id
    WHERE c.seq > ? ORDER BY c.seq
"""


class CacheDirectoryError(OSError):
    """The cache directory cannot be used (not a directory, read-only, not a cache index, full...).

    The message names the path. It subclasses :class:`OSError`.
    """


@dataclass(frozen=True, slots=True)
class DiskEntry:
    """One entry of a disk cache, as :meth:`LlamaDiskCache.entries` lists it.

    Attributes:
        id: the entry's row id (never reused).
        namespace: the fingerprint of the model that made the state.
        n_tokens: length of the key.
        size: bytes of the payload file.
        raw_size: bytes of the encoded state (differs from ``size`` when compressed).
        codec: ``"raw"`` or ``"zlib"``.
        file: payload path relative to the data directory.
        created: unix time it was stored.
        accessed: unix time of its last store or hit.
        hits: lookups it answered.
        kind: ``"llama_cache"`` or ``"llama_cpp"`` (llama-cpp-python's ``LlamaState``).
        can_be_cut: whether the state answers queries diverging from its key.
    """

    id: int
    namespace: str
    n_tokens: int
    size: int
    raw_size: int
    codec: str
    file: str
    created: float
    accessed: float
    hits: int
    kind: str = "llama_cache"
    can_be_cut: bool = True


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


class _Entry:
    """What a process keeps in memory per entry (the key lives in the radix index, not here)."""

    __slots__ = ("id", "namespace", "size", "raw_size", "file", "codec", "recency", "kind", "cut", "logits",
                 "n_state", "n_key")

    def __init__(
        self, id: int, namespace: str, size: int, raw_size: int, file: str, codec: str, recency: int,
        kind: int, cut: bool, logits: bool, n_state: int, n_key: int,
    ) -> None:
        self.id = id
        self.namespace = namespace
        self.size = size
        self.raw_size = raw_size
        self.file = file
        self.codec = codec
        self.recency = recency
        self.kind = kind
        self.cut = cut
        self.logits = logits
        self.n_state = n_state
        self.n_key = n_key


class _Unreadable(Exception):
    """A payload could not be loaded; ``missing`` when its file does not exist."""

    def __init__(self, reason: str, missing: bool = False) -> None:
        super().__init__(reason)
        self.missing = missing


class _BadRow(Exception):
    """A row of the index that does not validate."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _state_cap(n_key: int) -> int:
    """The most bytes an encoded state filed under a key of ``n_key`` tokens may take."""
    return min(_MAX_STATE_BYTES, _STATE_BASE_BYTES + n_key * _STATE_BYTES_PER_TOKEN)


def _entry_from_row(row: Sequence[Any]) -> tuple[_Entry, npt.NDArray[np.int32]]:
    """Validate one ``entries`` row (columns of ``_ROW``) and return its entry and key.

    Raises:
        _BadRow: anything about the row is wrong.
    """
    if len(row) != 12:
        raise _BadRow("wrong number of columns")
    entry_id, namespace, key, kind, cut, logits, n_state, file, size, raw_size, codec, recency = row
    if not _is_int(entry_id):
        raise _BadRow("id is not an integer")
    if not isinstance(namespace, str) or not 0 < len(namespace) <= _MAX_NAMESPACE:
        raise _BadRow("namespace is not a short non-empty text")
    if not isinstance(key, bytes) or len(key) % 4 or len(key) > 4 * _MAX_KEY_TOKENS:
        raise _BadRow("key is not a blob of int32 tokens")
    tokens = _tokens(key)
    if len(tokens) and int(tokens.min()) < 0:
        raise _BadRow("key holds a negative token")
    if kind not in (KIND_LLAMA_CACHE, KIND_UPSTREAM) or not _is_int(kind):
        raise _BadRow("unknown kind")
    if cut not in (0, 1) or logits not in (0, 1) or not _is_int(cut) or not _is_int(logits):
        raise _BadRow("cut/logits are not 0 or 1")
    if kind == KIND_UPSTREAM and not cut:
        raise _BadRow("a llama-cpp-python state is always cut")
    if not _is_int(n_state) or not len(tokens) <= n_state <= _MAX_KEY_TOKENS:
        raise _BadRow("n_state is not a token count at least the key's")
    if not isinstance(file, str) or not _FILE_NAME.fullmatch(file):
        raise _BadRow("file is not a payload name")
    cap = _state_cap(len(tokens))
    if not _is_int(size) or not 0 < size <= cap:
        raise _BadRow("size out of bounds")
    if codec not in _CODECS or not isinstance(codec, str):
        raise _BadRow("unknown codec")
    if not _is_int(raw_size) or not 0 < raw_size <= cap:
        raise _BadRow("raw_size out of bounds")
    if codec == "raw" and raw_size != size:
        raise _BadRow("raw payload whose raw_size differs from its size")
    if codec == "zlib" and raw_size > size * _ZLIB_MAX_RATIO + 1024:
        raise _BadRow("raw_size beyond what the compressed size can hold")
    if not _is_int(recency):
        raise _BadRow("recency is not an integer")
    entry = _Entry(entry_id, namespace, size, raw_size, file, codec, recency, kind, bool(cut), bool(logits),
                   n_state, len(tokens))
    return entry, tokens


def _model_info_from_row(fingerprint: Any, info: Any) -> dict[str, str]:
    """Validate one ``models`` row. Raises _BadRow."""
    if not isinstance(fingerprint, str) or not 0 < len(fingerprint) <= _MAX_NAMESPACE:
        raise _BadRow("fingerprint is not a short non-empty text")
    if not isinstance(info, str) or len(info) > 8 * _MAX_MODEL_INFO * _MAX_MODEL_FIELD:
        raise _BadRow("info is not a short text")
    try:
        parsed = json.loads(info)
    except ValueError:
        raise _BadRow("info is not JSON") from None
    try:
        return _check_model_info(parsed)
    except (TypeError, ValueError) as error:
        raise _BadRow(str(error)) from None


def _check_model_info(info: object) -> dict[str, str]:
    """A model description: a mapping of at most 16 short strings to short strings.

    Raises:
        TypeError, ValueError: it is not one.
    """
    if not isinstance(info, Mapping):
        raise TypeError(f"model_info must be a mapping of str to str, got {type(info).__name__}")
    if len(info) > _MAX_MODEL_INFO:
        raise ValueError(f"model_info has more than {_MAX_MODEL_INFO} fields")
    out: dict[str, str] = {}
    for name, value in info.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError("model_info must map str to str")
        if not name or len(name) > _MAX_MODEL_FIELD or len(value) > _MAX_MODEL_FIELD:
            raise ValueError(f"model_info field {name[:40]!r} is empty or too long")
        out[name] = value
    return out


def _write_all(fd: int, data: Any) -> None:
    """Write a whole bytes-like object to ``fd`` (``os.write`` may write less than asked)."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        written = os.write(fd, view)
        view = view[written:]


def _map_read_only(fd: int, size: int) -> mmap.mmap:
    if hasattr(mmap, "PROT_READ"):  # POSIX
        return mmap.mmap(fd, size, flags=_MAP_FLAGS, prot=mmap.PROT_READ)
    return mmap.mmap(fd, size, access=mmap.ACCESS_READ)  # pragma: no cover - Windows


def _read_all(fd: int, size: int) -> bytes:
    chunks = []
    while size > 0:
        chunk = os.read(fd, size)
        if not chunk:
            break
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _key_blob(tokens: npt.NDArray[np.int32]) -> bytes:
    return np.ascontiguousarray(tokens, dtype="<i4").tobytes()


def _key_hash(blob: bytes) -> bytes:
    return hashlib.blake2b(blob, digest_size=16).digest()


def _tokens(blob: bytes) -> npt.NDArray[np.int32]:
    return np.frombuffer(blob, dtype="<i4")


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


class LlamaDiskCache(BaseLlamaCache):
    """A persistent LRU cache of model states in a directory, shared safely by several processes.

    ``cache[query]`` returns the state of the best stored entry for ``query``, ties going to the most
    recently used entry: among entries whose state can be cut back (transformer KV, llama-cpp-python's
    states), the key sharing the longest non-empty common prefix with ``query`` (even if it diverges
    afterwards or runs past the query's end); among the others (recurrent and hybrid states), the
    longest key that is a prefix of ``query``. It raises ``KeyError`` when none qualifies. ``key in
    cache`` asks the same without touching recency. The lookup costs O(K) in the query length per
    namespace searched, whatever the number of entries, plus mapping and checksumming the payload.

    Capacity is real bytes on disk (the payload files; the SQLite index is not charged):
    ``cache_size`` never exceeds ``capacity_bytes``. Storing evicts least recently used entries until
    the new one fits; a state larger than the whole capacity is not stored (``stats().rejected``). The
    LRU order and the capacity are shared by every process using the directory (each evicts with the
    ``capacity_bytes`` it was given). ``len``, ``cache_size`` and ``stats().entries`` cover every
    namespace in the directory; hits, misses, evictions, rejections, writes and store errors are this
    instance's.

    Values are llama-cache :class:`~llama_cache.state.llama_state.LlamaState`\\ s (what
    ``llama_cache.Llama.save_state`` returns) or llama-cpp-python's ``llama_cpp.llama.LlamaState`` (what
    a plain ``llama_cpp.Llama`` saves; restored as that type). A state is filed under
    :func:`~llama_cache.state.values.filing_key`. Storing never raises for the value: anything that
    cannot be stored (another type, a state without a fingerprint, I/O errors, a full disk) is logged
    and counted in ``stats().store_errors``; only a bad key raises.

    All methods are thread-safe; nothing is printed. See the module docstring for the on-disk
    protocol, write-behind, namespaces and what a hostile writer of the directory can (not) do.

    Args:
        cache_dir: the directory (created if missing).
        capacity_bytes: the byte budget for payload files (default 2 GiB).
        verbose: accepted for compatibility with llama-cpp-python; diagnostics go to the
            ``llama_cache`` logger.
        fingerprint: answer lookups only from entries of this model fingerprint (see :meth:`bind`).
        write_behind: store in a background thread (default) rather than in the caller's.
        max_pending: states queued for the writer before ``cache[key] = state`` waits.
        fsync: ``fsync`` each payload file and its directory before committing, and commit the index
            with ``synchronous=FULL``: entries then survive a power loss, not only a crash.
        compress: ``"zlib"`` (level 6) or a zlib level 1..9 to compress payloads with, or None
            (default: model states barely compress and decompression defeats zero-copy reads; see
            ``benchmarks/disk.py``).
        verify: check each payload's checksum when it is read (default). Turning it off saves one pass
            over the bytes but lets a damaged payload reach llama.cpp.
        timeout: seconds (finite, > 0) to wait for another process's index transaction.

    Raises:
        TypeError, ValueError: a bad argument.
        CacheDirectoryError: ``cache_dir`` cannot hold a cache (not a directory, read-only, an index
            that is not an SQLite database or of a newer schema); an :class:`OSError` naming the path.
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike[str] = ".cache/llama_cache",
        capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
        verbose: bool = False,
        *,
        fingerprint: str | None = None,
        write_behind: bool = True,
        max_pending: int = 8,
        fsync: bool = False,
        compress: int | str | None = None,
        verify: bool = True,
        timeout: float = 30.0,
    ) -> None:
        super().__init__(capacity_bytes)
        if not isinstance(cache_dir, (str, os.PathLike)):
            raise TypeError(f"cache_dir must be a str or a path, got {type(cache_dir).__name__}")
        directory = os.fspath(cache_dir)
        if not isinstance(directory, str):
            raise TypeError("cache_dir must be a text path, not bytes")
        if not directory:
            raise ValueError("cache_dir must not be empty (use '.' for the working directory)")
        if not isinstance(max_pending, int) or isinstance(max_pending, bool):
            raise TypeError(f"max_pending must be an int, got {type(max_pending).__name__}")
        if max_pending < 1:
            raise ValueError(f"max_pending must be positive, got {max_pending}")
        for name, flag in (("write_behind", write_behind), ("fsync", fsync), ("verify", verify)):
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        level = _compress_level(compress)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(f"timeout must be a number of seconds, got {type(timeout).__name__}")
        if not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(f"timeout must be finite and positive, got {timeout!r}")
        _check_fingerprint(fingerprint)
        self.cache_dir = Path(directory)
        self.verbose = verbose
        self.write_behind = bool(write_behind)
        self.max_pending = max_pending
        self.fsync = bool(fsync)
        self.compress = level
        self.verify = bool(verify)
        self.timeout = float(timeout)
        self._namespace = fingerprint
        self._data_dir = self.cache_dir / DATA_DIR
        self._data = _DataDir(self._data_dir)
        self._db_path = self.cache_dir / INDEX_FILE
        # Per-process state (rebuilt after fork): the connection and what it has replayed.
        self._pid = os.getpid()
        self._conn: sqlite3.Connection | None = None
        self._data_version = -1
        self._last_seq = 0
        self._indexes: dict[tuple[str, bool], RadixIndex[_Entry]] = {}
        self._entries: dict[int, _Entry] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # entry ids, least recently used first
        self._bytes = 0
        self._bad_rows: set[tuple[str, int]] = set()  # malformed rows already logged
        # This instance's counters.
        self._hits = self._misses = self._evictions = self._rejected = self._write_errors = 0
        self._writes = self._store_errors = 0
        # Write-behind queue: (key, value, namespace, kind).
        self._cond = threading.Condition()
        self._queue: deque[tuple[npt.NDArray[np.int32], Any, str, int]] = deque()
        self._submitted = 0
        self._completed = 0
        self._writer: threading.Thread | None = None
        self._fork_locked = False
        with self._lock:
            self._connection()  # fail early on an unusable directory
        self._reclaim_orphans(ORPHAN_GRACE_SECONDS)
        _LIVE.add(self)

    # ---------------------------------------------------------------------------------- namespaces

    @property
    def fingerprint(self) -> str | None:
        """The namespace lookups are answered from, or None for every namespace."""
        return self._namespace

    def bind(self, fingerprint: str | llama_cpp.Llama | None, *, model_info: Mapping[str, str] | None = None) -> None:
        """Answer lookups only from entries made by the model with this fingerprint (None: any).

        Stores of llama-cache states are unaffected (a state is filed under its own fingerprint);
        llama-cpp-python states without a fingerprint are filed under the bound one.

        Args:
            fingerprint: a model fingerprint, or a loaded ``llama_cpp.Llama`` (its
                :func:`~llama_cache.state.fingerprint.model_fingerprint` is used, and its file name,
                description and parameter count are recorded unless ``model_info`` is given), or None.
            model_info: a short description of the model (str to str, e.g. ``file``, ``desc``,
                ``n_params``), recorded in the index for ``llama-cache inspect``.

        Raises:
            TypeError, ValueError: a bad fingerprint or model description.
        """
        if isinstance(fingerprint, llama_cpp.Llama):
            llm = fingerprint
            own = getattr(llm, "fingerprint", None)
            if isinstance(own, str) and own:
                fingerprint = own
            else:
                fingerprint = model_fingerprint(llm)
            if model_info is None:
                model_info = model_description(llm)
        _check_fingerprint(fingerprint)
        info = _check_model_info(model_info) if model_info is not None else None
        if info is not None and fingerprint is None:
            raise ValueError("model_info needs a fingerprint")
        with self._lock:
            self._namespace = fingerprint
            if info is not None and fingerprint is not None:
                self._record_model(fingerprint, info)

    def _record_model(self, fingerprint: str, info: dict[str, str]) -> None:
        """Record a namespace's model description. Lock held; errors are logged."""
        text = json.dumps(info, sort_keys=True)
        try:
            conn = self._connection()
            row = conn.execute("SELECT info FROM models WHERE fingerprint = ?", (fingerprint,)).fetchone()
            if row is not None and row[0] == text:
                return
            with _transaction(conn):
                conn.execute("INSERT OR REPLACE INTO models (fingerprint, info) VALUES (?, ?)", (fingerprint, text))
        except sqlite3.Error as error:
            logger.warning("disk cache: could not record the model of %s: %s", fingerprint, error)

    def models(self) -> dict[str, dict[str, str]]:
        """The model descriptions recorded by :meth:`bind`: fingerprint -> {file, desc, n_params...}.

        Rows that do not validate are left out (logged once).
        """
        out: dict[str, dict[str, str]] = {}
        try:
            with self._lock:
                rows = self._connection().execute("SELECT rowid, fingerprint, info FROM models").fetchall()
        except sqlite3.Error as error:
            logger.warning("disk cache: index unavailable (%s)", error)
            return out
        for rowid, fingerprint, info in rows:
            try:
                out[fingerprint] = _model_info_from_row(fingerprint, info)
            except _BadRow as problem:
                self._log_bad_row("models", rowid, str(problem))
        return out

    # --------------------------------------------------------------------------------- the mapping

    @property
    def cache_size(self) -> int:
        """Bytes of the payload files of every entry in the directory (after pending writes)."""
        self._wait_for_writes()
        with self._lock:
            self._sync_or_log()
            return self._bytes

    def __len__(self) -> int:
        self._wait_for_writes()
        with self._lock:
            self._sync_or_log()
            return len(self._entries)

    def __contains__(self, key: Sequence[int]) -> bool:  # type: ignore[override]
        """Whether an entry would answer ``key``; touches neither recency nor counters.

        The payload is not read: ``cache[key]`` can still miss if it turns out to be damaged.
        """
        query = as_token_array(key)
        self._wait_for_writes()
        try:
            with self._lock:
                self._sync()
                return self._best(query) is not None
        except Exception as error:  # noqa: BLE001 - a damaged index is a "no", never an error
            logger.warning("disk cache: index unavailable (%s); answering no", error)
            return False

    def __getitem__(self, key: Sequence[int]) -> Any:
        """Return the state of the best entry for ``key`` and make that entry the most recently used.

        A llama-cache state's arrays are read-only views of the memory-mapped payload file (no copy);
        a llama-cpp-python state is rebuilt as its own ``LlamaState`` type.

        Raises:
            KeyError: no entry answers ``key``, or every candidate's payload was damaged (each such
                entry is logged and removed), or the index is unavailable or damaged (logged).
            TypeError, ValueError: ``key`` is not a sequence of token ids.
        """
        query = as_token_array(key)
        self._wait_for_writes()
        try:
            state = self._lookup(query)
        except Exception as error:  # noqa: BLE001 - whatever the directory holds, a lookup only misses
            logger.warning("disk cache: index unavailable or damaged (%s: %s); a miss", type(error).__name__, error)
            state = None
        if state is None:
            with self._lock:
                self._misses += 1
            raise KeyError("no cached prefix for this key")
        return state

    def _lookup(self, query: npt.NDArray[np.int32]) -> Any:
        for _ in range(_LOAD_ATTEMPTS):
            with self._lock:
                self._sync()
                match = self._best(query)
            if match is None:
                return None
            entry = match.value
            try:
                state = self._load(entry, np.asarray(match.key, dtype=np.int32))
            except _Unreadable as problem:
                self._forget_unreadable(entry, problem)
                continue
            with self._lock:
                self._touch(entry.id)
                self._hits += 1
            return state
        return None

    def __setitem__(self, key: Sequence[int], value: Any) -> None:
        """Store ``value`` under ``key`` (filed under :func:`~llama_cache.state.values.filing_key`).

        With write-behind the call only queues the state (waiting if ``max_pending`` are queued).
        An entry holding the same tokens under that key (with logits if ``value`` has them) is only
        made the most recently used. Otherwise least recently used entries are evicted until the
        state fits; a state larger than the capacity is not stored (``stats().rejected``) and the
        entry it would replace is dropped. A value that cannot be stored is logged and counted in
        ``stats().store_errors``, never raised.

        Raises:
            TypeError, ValueError: ``key`` is not a sequence of token ids.
        """
        tokens = as_token_array(key)
        try:
            kind, namespace, filed = self._classify(tokens, value)
        except (TypeError, ValueError, AttributeError) as error:
            with self._lock:
                self._store_errors += 1
            logger.warning("disk cache: not caching a %s: %s", type(value).__name__, error)
            return
        if self.write_behind:
            self._enqueue(filed, value, namespace, kind)
        else:
            self._store(filed, value, namespace, kind)

    def _classify(self, tokens: npt.NDArray[np.int32], value: Any) -> tuple[int, str, npt.NDArray[np.int32]]:
        """The kind, namespace and filing key of a value to store.

        Raises:
            TypeError, ValueError: the value cannot be stored.
        """
        if isinstance(value, LlamaState):
            kind = KIND_LLAMA_CACHE
            namespace = value.fingerprint
            if not isinstance(namespace, str) or not 0 < len(namespace) <= _MAX_NAMESPACE:
                raise ValueError("the state has no fingerprint")
        elif isinstance(value, llama_cpp.llama.LlamaState):
            kind = KIND_UPSTREAM
            own = getattr(value, "fingerprint", None)
            if isinstance(own, str) and own:
                namespace = own
            else:
                namespace = self._namespace if self._namespace is not None else UNBOUND_NAMESPACE
            if len(namespace) > _MAX_NAMESPACE:
                raise ValueError("fingerprint too long")
        else:
            raise TypeError("not a llama_cache or llama_cpp LlamaState")
        held = state_tokens(value)
        if held is None:
            raise ValueError("the state does not say which tokens it holds")
        held = np.asarray(held)
        if held.dtype.kind not in "iu" or (len(held) and (int(held.min()) < 0 or int(held.max()) >= 2**31)):
            raise ValueError("the state holds token ids outside [0, 2**31)")
        filed = filing_key(tokens, value)
        if len(held) < len(filed) or not np.array_equal(held[: len(filed)], filed):
            raise ValueError("the state does not hold the tokens of its key")
        if len(held) > _MAX_KEY_TOKENS:
            raise ValueError("the state holds too many tokens")
        return kind, namespace, np.array(filed, dtype=np.int32)

    def __delitem__(self, key: Sequence[int]) -> None:
        """Remove the entries stored under exactly ``key`` (in the bound namespace, or in all).

        Raises:
            KeyError: nothing is stored under exactly ``key``.
        """
        tokens = as_token_array(key)
        self._wait_for_writes()
        with self._lock:
            self._sync()
            victims = [
                entry
                for (namespace, _), index in self._indexes.items()
                if self._namespace in (None, namespace) and (entry := index.get(tokens)) is not None
            ]
            if not victims:
                raise KeyError("no state stored under exactly this key")
            self._delete(victims)

    def _valid_rows(self, order: str = "recency") -> list[tuple[_Entry, npt.NDArray[np.int32], tuple[Any, ...]]]:
        """Every valid row of the entries table with its extra columns (created, accessed, hits). Lock held."""
        out = []
        for row in self._connection().execute(f"SELECT {_ROW}, created, accessed, hits FROM entries ORDER BY {order}"):
            try:
                entry, tokens = _entry_from_row(row[:12])
            except _BadRow as problem:
                self._log_bad_row("entries", row[0], str(problem))
                continue
            out.append((entry, tokens, row[12:]))
        return out

    def keys(self) -> Iterator[tuple[int, ...]]:
        """Stored keys of the bound namespace (all when unbound), least recently used first (a snapshot)."""
        self._wait_for_writes()
        with self._lock:
            rows = self._valid_rows()
        return iter([tuple(tokens.tolist()) for entry, tokens, _ in rows if self._namespace in (None, entry.namespace)])

    def entries(self) -> list[DiskEntry]:
        """Every valid entry of the directory (all namespaces), least recently used first."""
        self._wait_for_writes()
        with self._lock:
            rows = self._valid_rows()
        out = []
        for entry, _, (created, accessed, hits) in rows:
            out.append(
                DiskEntry(
                    entry.id, entry.namespace, entry.n_key, entry.size, entry.raw_size, entry.codec, entry.file,
                    _as_float(created), _as_float(accessed), hits if _is_int(hits) else 0,
                    "llama_cpp" if entry.kind == KIND_UPSTREAM else "llama_cache", entry.cut,
                )
            )
        return out

    def clear(self) -> None:
        """Remove every entry of the directory (all namespaces). Counters are kept."""
        self._wait_for_writes()
        with self._lock:
            self._sync()
            self._delete([self._entries[i] for i in self._lru])

    def stats(self) -> CacheStats:
        """This instance's counters; the directory's entries and bytes."""
        self._wait_for_writes()
        with self._lock:
            self._sync_or_log()
            return CacheStats(
                hits=self._hits,
                misses=self._misses,
                entries=len(self._entries),
                bytes=self._bytes,
                capacity_bytes=self.capacity_bytes,
                evictions=self._evictions,
                rejected=self._rejected,
                writes=self._writes,
                store_errors=self._store_errors,
            )

    @property
    def write_errors(self) -> int:
        """States this instance failed to store because of an I/O or index error (logged)."""
        return self._write_errors

    # ------------------------------------------------------------------------------- maintenance

    def flush(self) -> None:
        """Wait until every state queued before this call is written and committed (or dropped)."""
        self._wait_for_writes()

    def close(self) -> None:
        """Flush pending writes, stop the writer thread and close the index connection.

        The cache stays usable: the next operation reopens it. Idempotent.
        """
        self._wait_for_writes()
        with self._cond:
            writer = self._writer
            self._writer = None
            self._cond.notify_all()
        if writer is not None and writer is not threading.current_thread():
            writer.join(timeout=self.timeout)
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None and self._pid == os.getpid():
                conn.close()

    def __enter__(self) -> LlamaDiskCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def check(self, fix: bool = False, *, deep: bool = False, grace_seconds: float = 60.0) -> CheckReport:
        """Reconcile the index with the payload files.

        Finds malformed rows (see the module docstring), orphan files (named by no entry), entries whose
        file is missing, is not a regular file or has another length than recorded, and with ``deep``
        entries whose payload does not decode (reads every file). With ``fix`` the bad entries and
        malformed rows are deleted (through the change log, so other processes follow) and orphan files
        older than ``grace_seconds`` are unlinked: younger ones may belong to a write in progress in
        another process. Never raises for what the directory holds; an unavailable index is logged and
        reported as ``index_ok=False``.

        Returns:
            A :class:`CheckReport` of what was found (and removed).
        """
        if isinstance(grace_seconds, bool) or not isinstance(grace_seconds, (int, float)) or math.isnan(grace_seconds):
            raise TypeError("grace_seconds must be a number")
        self._wait_for_writes()
        try:
            with self._lock:
                conn = self._connection()
                self._sync_or_log()
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
        files = self._data.list()
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
                with self._lock:
                    live = self._entries.get(entry.id)
                if live is not None:
                    try:
                        self._load(live, None)
                    except _Unreadable:
                        corrupt.append((entry.id, entry.file))
        # Rows evicted by another process while we looked are not problems.
        suspects = missing + mismatched + corrupt
        if suspects:
            with self._lock:
                self._sync_or_log()
                alive = {i for i, _ in suspects if i in self._entries}
            missing = [m for m in missing if m[0] in alive]
            mismatched = [m for m in mismatched if m[0] in alive]
            corrupt = [m for m in corrupt if m[0] in alive]
        orphans = sorted(file for file in files if file not in named)
        removed_entries = removed_files = 0
        if fix:
            bad = {i for i, _ in missing + mismatched + corrupt}
            with self._lock:
                self._sync_or_log()
                victims = [self._entries[i] for i in bad if i in self._entries]
                removed_entries = len(self._delete(victims))
                removed_entries += self._delete_malformed(malformed)
            now = time.time()
            with self._lock:
                self._sync_or_log()
                still_named = {entry.file for entry in self._entries.values()}
            for file in orphans:
                if file in still_named or now - files[file][1] < grace_seconds:
                    continue
                if self._data.unlink(file):
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

    def _delete_malformed(self, malformed: list[tuple[str, int, str]]) -> int:
        """Delete malformed rows (their files, not trusted, are left to the orphan sweep). Lock held."""
        if not malformed:
            return 0
        removed = 0
        try:
            conn = self._connection()
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
        self._sync_or_log(force=True)
        return removed

    def _reclaim_orphans(self, grace_seconds: float) -> None:
        """Remove payload files no row names and older than ``grace_seconds`` (a crash's leftovers)."""
        try:
            files = self._data.list()
            if not files:
                return
            with self._lock:
                named = {row[0] for row in self._connection().execute("SELECT file FROM entries")}
        except (sqlite3.Error, OSError) as error:
            logger.warning("disk cache: could not look for orphan files: %s", error)
            return
        now = time.time()
        removed = 0
        for file, (size, mtime) in files.items():
            if file not in named and now - mtime >= grace_seconds and self._data.unlink(file):
                removed += 1
        if removed:
            logger.info("disk cache: removed %d orphan payload files (left by interrupted writes)", removed)

    # --------------------------------------------------------------------------- index in memory

    def _best(self, query: npt.NDArray[np.int32]) -> Match[_Entry] | None:
        """The match answering ``query`` (see the class docstring), most recent on ties. Lock held."""
        best: Match[_Entry] | None = None
        rank = (-1, 0)
        for (namespace, cut), index in self._indexes.items():
            if self._namespace is not None and namespace != self._namespace:
                continue
            match = index.longest_common_prefix(query) if cut else index.longest_prefix(query)
            if match is not None and (match.common, match.value.recency) > rank:
                best, rank = match, (match.common, match.value.recency)
        return best

    def _exact(self, namespace: str, tokens: npt.NDArray[np.int32]) -> _Entry | None:
        """The entry stored under exactly ``tokens`` in ``namespace``. Lock held."""
        for cut in (True, False):
            index = self._indexes.get((namespace, cut))
            entry = index.get(tokens) if index is not None else None
            if entry is not None:
                return entry
        return None

    def _log_bad_row(self, table: str, rowid: Any, reason: str) -> None:
        marker = (table, rowid if _is_int(rowid) else -1)
        if marker not in self._bad_rows:
            self._bad_rows.add(marker)
            logger.warning("disk cache: ignoring malformed %s row #%s in %s: %s", table, rowid, self._db_path, reason)

    def _sync_or_log(self, force: bool = False) -> None:
        """:meth:`_sync`, logging an unavailable index instead of raising (the last view stays). Lock held."""
        try:
            self._sync(force)
        except sqlite3.Error as error:
            logger.warning("disk cache: index unavailable (%s)", error)

    def _sync(self, force: bool = False) -> None:
        """Apply the changes other connections committed since the last sync. Lock held.

        Cheap when nothing changed: one ``PRAGMA data_version``.
        """
        conn = self._connection()
        version = conn.execute("PRAGMA data_version").fetchone()[0]
        if version == self._data_version and not force:
            return
        self._data_version = version
        if conn.in_transaction:
            self._replay(conn)
            return
        conn.execute("BEGIN")
        try:
            self._replay(conn)
        finally:
            conn.execute("COMMIT")

    def _replay(self, conn: sqlite3.Connection) -> None:
        floor = _floor(conn)
        if floor is None or self._last_seq < floor:
            self._rebuild(conn)
            return
        try:
            self._replay_rows(conn)
        except (_BadRow, ValueError, TypeError, KeyError, IndexError) as error:
            logger.warning("disk cache: change log out of step with the entries (%s); rebuilding", error)
            self._rebuild(conn)

    def _replay_rows(self, conn: sqlite3.Connection) -> None:
        for row in conn.execute(_REPLAY, (self._last_seq,)):
            seq, op, entry_id, del_key = row[:4]
            if not _is_int(seq) or not _is_int(entry_id) or op not in (_ADD, _TOUCH, _DELETE):
                self._log_bad_row("changes", seq, "unknown operation or entry")
                if _is_int(seq):
                    self._last_seq = seq
                continue
            if op == _ADD:
                if row[4] is not None and entry_id not in self._entries:
                    try:
                        entry, tokens = _entry_from_row(row[4:])
                    except _BadRow as problem:
                        self._log_bad_row("entries", entry_id, str(problem))
                    else:
                        entry.recency = seq
                        self._add_local(entry, tokens)
            elif op == _TOUCH:
                entry = self._entries.get(entry_id)
                if entry is not None and row[4] is not None:
                    key = row[6]
                    if not isinstance(key, bytes) or len(key) != 4 * entry.n_key:
                        raise _BadRow(f"entry {entry_id} changed its key")
                    entry.recency = seq
                    self._lru.move_to_end(entry_id)
                    self._indexes[(entry.namespace, entry.cut)].touch(_tokens(key))
            else:
                entry = self._entries.get(entry_id)
                if entry is not None:
                    if not isinstance(del_key, bytes) or len(del_key) != 4 * entry.n_key:
                        raise _BadRow(f"the delete of entry {entry_id} names another key")
                    tokens = _tokens(del_key)
                    index = self._indexes[(entry.namespace, entry.cut)]
                    if index.get(tokens) is not entry:
                        raise _BadRow(f"the delete of entry {entry_id} names another key")
                    self._entries.pop(entry_id)
                    del self._lru[entry_id]
                    self._bytes -= entry.size
                    index.remove(tokens)
                    if not len(index):
                        del self._indexes[(entry.namespace, entry.cut)]
            self._last_seq = seq

    def _add_local(self, entry: _Entry, tokens: npt.NDArray[np.int32]) -> None:
        # One key per namespace (the UNIQUE constraint): an entry of the other cut kind under the same
        # key can only be a stale or forged row; the newer one wins.
        other = self._indexes.get((entry.namespace, not entry.cut))
        stale = other.get(tokens) if other is not None else None
        if stale is not None:
            self._drop_local(stale, tokens)
        index = self._indexes.get((entry.namespace, entry.cut))
        if index is None:
            index = self._indexes[(entry.namespace, entry.cut)] = RadixIndex()
        old = index.insert(tokens, entry)
        if old is not None and old is not entry:  # deletes precede re-adds, unless rows were forged
            self._entries.pop(old.id, None)
            self._lru.pop(old.id, None)
            self._bytes -= old.size
        self._entries[entry.id] = entry
        self._lru[entry.id] = None
        self._bytes += entry.size

    def _drop_local(self, entry: _Entry, tokens: npt.NDArray[np.int32]) -> None:
        index = self._indexes[(entry.namespace, entry.cut)]
        index.remove(tokens)
        if not len(index):
            del self._indexes[(entry.namespace, entry.cut)]
        self._entries.pop(entry.id, None)
        self._lru.pop(entry.id, None)
        self._bytes -= entry.size

    def _rebuild(self, conn: sqlite3.Connection) -> None:
        """Rebuild the in-memory index from the entries table (in the caller's read transaction)."""
        self._indexes = {}
        self._entries = {}
        self._lru = OrderedDict()
        self._bytes = 0
        row = conn.execute("SELECT max(seq) FROM changes").fetchone()
        self._last_seq = row[0] if row and _is_int(row[0]) else 0
        floor = _floor(conn)
        if floor is not None and floor > self._last_seq:
            self._last_seq = floor
        for row in conn.execute(f"SELECT {_ROW} FROM entries ORDER BY recency"):
            try:
                entry, tokens = _entry_from_row(row)
            except _BadRow as problem:
                self._log_bad_row("entries", row[0], str(problem))
                continue
            self._add_local(entry, tokens)

    # ------------------------------------------------------------------------------- connection

    def _connection(self) -> sqlite3.Connection:
        """This process's connection, (re)opened as needed. Lock held."""
        if self._pid != os.getpid():
            self._reset_after_fork()
        if self._conn is None:
            self._open()
        assert self._conn is not None
        return self._conn

    def _open(self) -> None:
        """Open (creating if needed) the directory and its index.

        Raises:
            CacheDirectoryError: the directory or its index cannot be used.
        """
        try:
            os.makedirs(self._data_dir, exist_ok=True)
            if not self.cache_dir.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "not a directory")
        except OSError as error:
            raise CacheDirectoryError(
                error.errno, f"cannot use {str(self.cache_dir)!r} as a disk cache directory: {error.strerror or error}"
            ) from None
        try:
            conn = sqlite3.connect(self._db_path, timeout=self.timeout, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as error:
            raise CacheDirectoryError(f"cannot open the disk cache index {str(self._db_path)!r}: {error}") from None
        try:
            self._prepare(conn)
        except sqlite3.Error as error:
            conn.close()
            raise CacheDirectoryError(f"cannot use the disk cache index {str(self._db_path)!r}: {error}") from None
        except BaseException:
            conn.close()
            raise
        self._conn = conn

    def _prepare(self, conn: sqlite3.Connection) -> None:
        deadline = time.monotonic() + self.timeout
        while True:  # switching to WAL needs a moment without other writers
            try:
                mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                break
            except sqlite3.OperationalError as error:
                if "locked" not in str(error) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        if str(mode).lower() != "wal":
            raise sqlite3.OperationalError(f"cannot use WAL mode (got {mode})")
        conn.execute(f"PRAGMA synchronous = {'FULL' if self.fsync else 'NORMAL'}")
        with _transaction(conn):
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if _is_int(version) and version > SCHEMA_VERSION:
                raise CacheDirectoryError(
                    f"{str(self._db_path)!r} has index schema version {version}; this llama-cache reads "
                    f"{SCHEMA_VERSION} (use another directory, or upgrade llama-cache)"
                )
            if version not in (0, SCHEMA_VERSION) or not self._schema_ok(conn):
                # An older or damaged schema: it is a cache, so start it again (the old payloads become
                # orphans, removed by the sweep once older than the grace period).
                logger.warning(
                    "disk cache: %s has index schema version %s or unexpected tables; rebuilding it empty",
                    self._db_path, version,
                )
                for table in _TABLES:
                    conn.execute(f"DROP TABLE IF EXISTS {table}")
            for statement in _SCHEMA:
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("BEGIN")
        try:
            self._rebuild(conn)
        finally:
            conn.execute("COMMIT")
        self._data_version = conn.execute("PRAGMA data_version").fetchone()[0]

    @staticmethod
    def _schema_ok(conn: sqlite3.Connection) -> bool:
        """Whether existing tables have the columns this version expects (absent tables are created)."""
        expected = {
            "entries": list(_ENTRY_COLUMNS),
            "changes": ["seq", "op", "entry_id", "namespace", "key"],
            "meta": ["name", "value"],
            "models": ["fingerprint", "info"],
        }
        for table, columns in expected.items():
            found = [row[1] for row in conn.execute(f"PRAGMA table_info({table})")]
            if found and found != columns:
                return False
        return True

    def _reset_after_fork(self) -> None:
        """In a forked child: drop everything tied to the parent's process (never touch its SQLite)."""
        if self._conn is not None:
            _ABANDONED.append(self._conn)  # closing it could disturb the parent's locks and WAL
            self._conn = None
        self._pid = os.getpid()
        self._lock = threading.RLock()
        self._cond = threading.Condition()
        self._queue.clear()
        self._completed = self._submitted
        self._writer = None
        self._fork_locked = False
        self._data_version = -1  # the in-memory index stays valid; the next sync catches up

    # ----------------------------------------------------------------------------------- reading

    def _load(self, entry: _Entry, key: npt.NDArray[np.int32] | None) -> Any:
        """Read, decode and check an entry's payload. No lock needed: payload files never change.

        Args:
            entry: a validated entry.
            key: its key (None: do not compare the state's tokens with it).

        Raises:
            _Unreadable: the file is missing, not a regular file, has the wrong length, does not
                decode, or does not hold what its row says.
        """
        try:
            fd, size = self._data.open_regular(entry.file)
        except FileNotFoundError:
            raise _Unreadable("payload file is missing", missing=True) from None
        except (OSError, ValueError) as error:
            raise _Unreadable(f"cannot open payload: {error}") from None
        try:
            if size != entry.size:
                raise _Unreadable(f"payload is {size} bytes, the index says {entry.size}")
            if entry.codec == "raw":
                buffer: Any = _map_read_only(fd, size)
            else:
                buffer = _inflate(_read_all(fd, size), entry.raw_size)
        except (OSError, ValueError, OverflowError, MemoryError) as error:  # ValueError: mmap of an empty file
            raise _Unreadable(f"cannot read payload: {error}") from None
        finally:
            os.close(fd)
        try:
            kind = payload_kind(buffer)
            if kind != entry.kind:
                raise _Unreadable(f"payload of kind {kind}, the index says {entry.kind}")
            if kind == KIND_UPSTREAM:
                state, namespace = decode_upstream(buffer, verify=self.verify)
                fingerprint = getattr(state, "fingerprint", None)
                cut, logits = True, bool(np.any(state.scores))
                held: npt.NDArray[Any] = state.input_ids[: state.n_tokens]
                if fingerprint is not None and fingerprint != namespace:
                    raise _Unreadable("payload's fingerprint differs from its namespace")
            else:
                state = decode(buffer, verify=self.verify)
                namespace, cut, logits, held = state.fingerprint, can_be_cut(state), state.logits is not None, state.tokens
        except _Unreadable:
            raise
        except CorruptStateError as error:
            raise _Unreadable(f"corrupt payload: {error}") from None
        except Exception as error:  # noqa: BLE001 - odd bytes past the checksum must stay a miss
            raise _Unreadable(f"undecodable payload: {type(error).__name__}: {error}") from None
        if namespace != entry.namespace:
            raise _Unreadable("payload belongs to another model than its index entry")
        if cut != entry.cut or logits != entry.logits or len(held) != entry.n_state:
            raise _Unreadable("payload does not hold what its index entry says")
        if key is not None and (len(key) != entry.n_key or not np.array_equal(held[: len(key)], key)):
            raise _Unreadable("payload does not hold the tokens of its key")
        return state

    def _forget_unreadable(self, entry: _Entry, problem: _Unreadable) -> None:
        """Remove an entry whose payload could not be loaded, unless another process already did."""
        with self._lock:
            self._sync()
            if entry.id not in self._entries:
                return  # evicted or replaced meanwhile: not damage
            logger.warning("disk cache: dropping entry %s (%s): %s", entry.id, entry.file, problem)
            self._delete([entry])

    def _touch(self, entry_id: int, hit: bool = True) -> None:
        """Make an entry the most recently used, for every process. Lock held; errors are logged."""
        conn = self._connection()
        try:
            with _transaction(conn):
                cursor = conn.execute(
                    "INSERT INTO changes (op, entry_id) SELECT ?, id FROM entries WHERE id = ?",
                    (_TOUCH, entry_id),
                )
                if cursor.rowcount:
                    conn.execute(
                        "UPDATE entries SET recency = ?, accessed = ?, hits = hits + ? WHERE id = ?",
                        (cursor.lastrowid, time.time(), 1 if hit else 0, entry_id),
                    )
        except sqlite3.Error as error:
            logger.warning("disk cache: could not record a hit: %s", error)
            return
        self._sync_or_log(force=True)

    # ----------------------------------------------------------------------------------- writing

    def _enqueue(self, tokens: npt.NDArray[np.int32], value: Any, namespace: str, kind: int) -> None:
        with self._cond:
            while len(self._queue) >= self.max_pending:
                self._cond.wait()
            self._queue.append((tokens, value, namespace, kind))
            self._submitted += 1
            if self._writer is None or not self._writer.is_alive():
                self._writer = threading.Thread(
                    target=self._write_loop, name="llama-cache-disk-writer", daemon=True
                )
                self._writer.start()
            self._cond.notify_all()

    def _write_loop(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                if not self._queue and self._writer is me:
                    self._cond.wait(timeout=5.0)  # woken by a store or by close()
                if not self._queue or self._writer is not me:
                    # Idle for a while, or closed: exit (the next store starts a new writer).
                    if self._writer is me:
                        self._writer = None
                    self._cond.notify_all()
                    return
                item = self._queue.popleft()
                self._cond.notify_all()
            try:
                self._store(*item)
            except Exception:  # noqa: BLE001 - the writer must outlive one bad state; logged
                with self._lock:
                    self._write_errors += 1
                    self._store_errors += 1
                logger.exception("disk cache: unexpected error while storing a state")
            finally:
                with self._cond:
                    self._completed += 1
                    self._cond.notify_all()

    def _wait_for_writes(self) -> None:
        if not self.write_behind and not self._queue:
            return
        with self._cond:
            target = self._submitted
            while self._completed < target:
                writer = self._writer
                if writer is threading.current_thread():
                    return  # never wait for ourselves
                if writer is None or not writer.is_alive():
                    # No writer (it died, or this is a forked child): drain here.
                    if not self._queue:
                        self._completed = self._submitted
                        break
                    item = self._queue.popleft()
                    self._cond.release()
                    try:
                        self._store(*item)
                    except Exception:  # noqa: BLE001 - as in the writer thread
                        with self._lock:
                            self._write_errors += 1
                            self._store_errors += 1
                        logger.exception("disk cache: unexpected error while storing a state")
                    finally:
                        self._cond.acquire()
                        self._completed += 1
                        self._cond.notify_all()
                    continue
                self._cond.wait(timeout=1.0)

    def _store(self, tokens: npt.NDArray[np.int32], value: Any, namespace: str, kind: int) -> None:
        """Write one state's payload, then commit it. Runs in the writer thread or the caller's."""
        n_state = int(value.n_tokens)

        def has_logits() -> bool:  # a scan of the scores for llama-cpp-python's states: only when needed
            if kind == KIND_UPSTREAM:
                return bool(np.any(np.asarray(value.scores)))
            return value.logits is not None

        # A store that would only rewrite what is there touches the entry instead (decided in memory).
        try:
            with self._lock:
                self._sync()
                old = self._exact(namespace, tokens)
                if old is not None and old.kind == kind and old.n_state == n_state and (old.logits or not has_logits()):
                    self._touch(old.id, hit=False)
                    return
        except sqlite3.Error as error:
            with self._lock:
                self._write_errors += 1
                self._store_errors += 1
            logger.warning("disk cache: index unavailable (%s); state not cached", error)
            return
        try:
            parts = encode_upstream(value, namespace) if kind == KIND_UPSTREAM else encode(value)
        except (TypeError, ValueError, AttributeError) as error:
            with self._lock:
                self._store_errors += 1
            logger.warning("disk cache: not caching a %s: %s", type(value).__name__, error)
            return
        raw_size = encoded_size(parts)
        cut = kind == KIND_UPSTREAM or can_be_cut(value)
        if raw_size > _state_cap(len(tokens)):
            with self._lock:
                self._store_errors += 1
            logger.warning(
                "disk cache: not caching a %d-byte state for %d tokens: above the %d bytes any reader accepts",
                raw_size, len(tokens), _state_cap(len(tokens)),
            )
            return
        if self.compress is None and raw_size > self.capacity_bytes:
            self._reject(namespace, tokens, raw_size)
            return
        name = f"{secrets.token_hex(1)}/{secrets.token_hex(16)}{_SUFFIX}"
        try:
            size = self._write_payload(name, parts)
        except OSError as error:
            with self._lock:
                self._write_errors += 1
                self._store_errors += 1
            level = logging.WARNING
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                logger.log(level, "disk cache: no space left for a %d-byte state; not cached", raw_size)
            else:
                logger.log(level, "disk cache: could not write a state (%s); not cached", error)
            return
        if size > self.capacity_bytes:
            self._data.unlink(name)
            self._reject(namespace, tokens, size)
            return
        row = (kind, int(cut), int(has_logits()), n_state)
        self._commit(namespace, tokens, name, size, raw_size, row)

    def _write_payload(self, name: str, parts: list[memoryview]) -> int:
        """Create the payload ``name`` (which must not exist) holding ``parts``; remove it on any failure."""
        with self._data.create(name) as (fd, dir_fd):
            if self.compress is None:
                for part in parts:
                    _write_all(fd, part)
                size = encoded_size(parts)
            else:
                compressor = zlib.compressobj(self.compress)
                size = 0
                for part in parts:
                    chunk = compressor.compress(part)
                    _write_all(fd, chunk)
                    size += len(chunk)
                tail = compressor.flush()
                _write_all(fd, tail)
                size += len(tail)
            if self.fsync:
                os.fsync(fd)
                os.fsync(dir_fd)
        return size

    def _commit(
        self, namespace: str, tokens: npt.NDArray[np.int32], name: str, size: int, raw_size: int,
        row: tuple[int, int, int, int],
    ) -> None:
        """Commit a written payload: replace the same key, evict LRU entries, then unlink their files."""
        blob = _key_blob(tokens)
        now = time.time()
        with self._lock:
            try:
                conn = self._connection()
                with _transaction(conn):
                    self._sync(force=True)  # under the write lock: the local view equals the index
                    old = self._exact(namespace, tokens)
                    victims = [old] if old is not None else []
                    total = self._bytes - (old.size if old is not None else 0)
                    evicted = 0
                    for entry_id in self._lru:
                        if total + size <= self.capacity_bytes:
                            break
                        entry = self._entries[entry_id]
                        if entry is not old:
                            victims.append(entry)
                            total -= entry.size
                            evicted += 1
                    # A replaced entry's hit count carries over: the same prompt is re-stored after
                    # each completion that hit it.
                    hits = 0
                    if old is not None:
                        found = conn.execute("SELECT hits FROM entries WHERE id = ?", (old.id,)).fetchone()
                        hits = found[0] if found is not None and _is_int(found[0]) and found[0] >= 0 else 0
                    self._delete_rows(conn, victims)
                    # A malformed row holding this key (not in memory) would break UNIQUE: it goes too.
                    key_hash = _key_hash(blob)
                    conn.execute(
                        "INSERT INTO changes (op, entry_id) SELECT ?, id FROM entries WHERE namespace = ? AND key_hash = ?",
                        (_DELETE, namespace, key_hash),
                    )
                    conn.execute("DELETE FROM entries WHERE namespace = ? AND key_hash = ?", (namespace, key_hash))
                    cursor = conn.execute(
                        "INSERT INTO entries (namespace, key, key_hash, kind, cut, logits, n_state, file, size, "
                        "raw_size, codec, created, accessed, recency, hits) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?)",
                        (namespace, blob, key_hash, *row, name, size, raw_size,
                         "raw" if self.compress is None else "zlib", now, now, hits),
                    )
                    entry_id = cursor.lastrowid
                    seq = conn.execute(
                        "INSERT INTO changes (op, entry_id) VALUES (?, ?)", (_ADD, entry_id)
                    ).lastrowid
                    assert entry_id is not None and seq is not None  # set by every INSERT
                    conn.execute("UPDATE entries SET recency = ? WHERE id = ?", (seq, entry_id))
                    self._maybe_trim(conn, seq)
            except sqlite3.Error as error:
                self._write_errors += 1
                self._store_errors += 1
                logger.warning("disk cache: could not commit a state (%s); not cached", error)
                self._data.unlink(name)
                return
            self._evictions += evicted
            self._writes += 1
            self._sync_or_log(force=True)  # committed; on failure the next operation catches up
        for victim in victims:  # only now that no committed row names them
            self._data.unlink(victim.file)

    def _reject(self, namespace: str, tokens: npt.NDArray[np.int32], size: int) -> None:
        logger.info(
            "disk cache: not caching a %d-byte state: larger than the whole capacity (%d bytes)",
            size,
            self.capacity_bytes,
        )
        with self._lock:
            self._rejected += 1
            try:
                self._sync()
            except sqlite3.Error as error:
                logger.warning("disk cache: index unavailable (%s)", error)
                return
            old = self._exact(namespace, tokens)
            if old is not None:
                self._delete([old])

    def _delete(self, victims: list[_Entry]) -> list[_Entry]:
        """Delete entries in one transaction, then unlink their files. Lock held; errors are logged.

        Returns:
            The entries deleted.
        """
        if not victims:
            return []
        try:
            conn = self._connection()
            with _transaction(conn):
                deleted = self._delete_rows(conn, victims)
        except sqlite3.Error as error:
            logger.warning("disk cache: could not delete %d entries: %s", len(victims), error)
            return []
        self._sync_or_log(force=True)
        for victim in deleted:
            self._data.unlink(victim.file)
        return deleted

    @staticmethod
    def _delete_rows(conn: sqlite3.Connection, victims: list[_Entry]) -> list[_Entry]:
        deleted = []
        for victim in victims:
            cursor = conn.execute(
                "INSERT INTO changes (op, entry_id, namespace, key) "
                "SELECT ?, id, namespace, key FROM entries WHERE id = ?",
                (_DELETE, victim.id),
            )
            if cursor.rowcount:
                conn.execute("DELETE FROM entries WHERE id = ?", (victim.id,))
                deleted.append(victim)
        return deleted

    @staticmethod
    def _maybe_trim(conn: sqlite3.Connection, seq: int) -> None:
        floor = _floor(conn)
        if floor is None:  # damaged: every process rebuilds once, then the log continues from here
            conn.execute("INSERT OR REPLACE INTO meta (name, value) VALUES ('floor', ?)", (seq,))
        elif seq - floor >= _TRIM_EVERY:
            floor = seq - _TRIM_KEEP
            conn.execute("DELETE FROM changes WHERE seq <= ?", (floor,))
            conn.execute("UPDATE meta SET value = ? WHERE name = 'floor'", (floor,))

    # ---------------------------------------------------------------------------------- fork hooks

    def _before_fork(self) -> None:
        self._wait_for_writes()
        self._lock.acquire()
        self._fork_locked = True

    def _after_fork_in_parent(self) -> None:
        if self._fork_locked:
            self._fork_locked = False
            self._lock.release()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.cache_dir)!r}, capacity_bytes={self.capacity_bytes})"


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


def _check_fingerprint(fingerprint: object) -> None:
    if fingerprint is None:
        return
    if not isinstance(fingerprint, str):
        raise TypeError(f"fingerprint must be a str or None, got {type(fingerprint).__name__}")
    if not 0 < len(fingerprint) <= _MAX_NAMESPACE:
        raise ValueError(f"fingerprint must be 1..{_MAX_NAMESPACE} characters")


def _floor(conn: sqlite3.Connection) -> int | None:
    """The change-log trim point, or None when the meta row is missing or damaged."""
    row = conn.execute("SELECT value FROM meta WHERE name = 'floor'").fetchone()
    if row is None or not _is_int(row[0]) or row[0] < 0:
        return None
    return int(row[0])


def _as_float(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) else 0.0


@contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """A write transaction: ``BEGIN IMMEDIATE`` takes the index's write lock up front."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:  # pragma: no cover - the original error matters more
                pass
        raise


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


# Every live cache, for the exit and fork hooks.
_LIVE: weakref.WeakSet[LlamaDiskCache] = weakref.WeakSet()
# Connections inherited across fork: kept referenced so that their finalizer never runs in the child.
_ABANDONED: list[sqlite3.Connection] = []


def _flush_all() -> None:
    for cache in list(_LIVE):
        try:
            cache.flush()
        except Exception:  # noqa: BLE001 - at exit, one cache's failure must not stop the others
            logger.exception("disk cache: flush at exit failed")


def _before_fork() -> None:
    for cache in list(_LIVE):
        cache._before_fork()


def _after_fork_in_parent() -> None:
    for cache in list(_LIVE):
        cache._after_fork_in_parent()


def _after_fork_in_child() -> None:
    for cache in list(_LIVE):
        cache._reset_after_fork()


atexit.register(_flush_all)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
    )
