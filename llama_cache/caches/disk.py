"""LlamaDiskCache: a persistent prefix-state cache that several processes can share.

Layout of ``cache_dir``::

    index.sqlite3 (+ -wal, -shm)   the index (SQLite in WAL mode): entries, a change log, metadata
    data/ab/ab12...ef.llst          one immutable payload file per entry, in the format of
                                    :mod:`llama_cache.state.format` (optionally zlib-compressed)

**Write protocol** (diskcache's, see STYLE.md): the payload goes to a new, uniquely named file first
(``O_EXCL``; ``fsync`` optional); then the metadata is committed in one ``BEGIN IMMEDIATE``
transaction that also deletes the rows of replaced and evicted entries; their files are unlinked only
after ``COMMIT``. A crash at any instant therefore leaves either the old index or the new one, both
naming complete files; at worst an uncommitted file is left behind, which :meth:`LlamaDiskCache.check`
reports as an orphan and ``check(fix=True)`` removes. Without ``fsync`` a power loss can lose recent
entries or leave a committed row naming a file whose bytes never reached the disk; the checksum makes
that a miss, never a wrong state.

**Reads** take the best entry from an in-process :class:`~llama_cache.index.RadixIndex` (O(K) in the
query length, no scan over entries), memory-map its file and decode it in place (no copy), verifying
the checksum (XXH3-64) by default. The returned
state hands llama.cpp its bytes straight from the mapping. A missing, truncated or tampered payload is
a miss: logged at WARNING, the entry removed, the next best entry tried. Nothing is ever unpickled.
Payload files are never modified once written, so a mapping stays valid even after its entry is
evicted; a file truncated *in place* by something else while a state read from it is in use would
fault the process (SIGBUS), as with any memory-mapped file.

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
:meth:`LlamaDiskCache.close`, at interpreter exit and before ``fork``.

**Namespaces**: an entry is filed under its state's ``fingerprint`` (the model and KV configuration
that made it). A cache bound to a fingerprint (``fingerprint=`` or :meth:`LlamaDiskCache.bind`) answers
only from that namespace, so one directory serves several models without ever handing one another's
state. An unbound cache answers from every namespace (``llama_cache.Llama.load_state`` still refuses a
foreign state, which is then a miss); bind it when a directory is shared between models.
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import logging
import mmap
import os
import re
import secrets
import sqlite3
import threading
import time
import weakref
import zlib
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from llama_cache.caches.base import DEFAULT_CAPACITY_BYTES, BaseLlamaCache, CacheStats
from llama_cache.index import RadixIndex
from llama_cache.tokens import as_token_array
from llama_cache.state.format import CorruptStateError, decode, encode, encoded_size
from llama_cache.state.llama_state import LlamaState

logger = logging.getLogger(__name__)

__all__ = ["INDEX_FILE", "CheckReport", "DiskEntry", "LlamaDiskCache"]

INDEX_FILE = "index.sqlite3"
DATA_DIR = "data"
SCHEMA_VERSION = 1
_SUFFIX = ".llst"
_FILE_NAME = re.compile(r"^[0-9a-f]{2}/[0-9a-f]{32}\.llst$")

_ADD, _TOUCH, _DELETE = 1, 2, 3  # change-log operations
_TRIM_EVERY = 20_000  # log rows accumulated before a trim...
_TRIM_KEEP = 5_000  # ...which keeps this many (a process further behind rebuilds its index)
_LOAD_ATTEMPTS = 8  # entries tried by one lookup before it gives up (each failure removes one)
# Read-only shared mappings, pre-faulted where the platform can (the checksum reads every page anyway).
_MAP_FLAGS = getattr(mmap, "MAP_SHARED", 0) | getattr(mmap, "MAP_POPULATE", 0)

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS entries (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        namespace TEXT NOT NULL,     -- the state's model fingerprint
        key BLOB NOT NULL,           -- the tokens, int32 little-endian
        key_hash BLOB NOT NULL,      -- blake2b-128 of key, for uniqueness
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
)

# Changes newer than a seq, with what replaying them needs. Adds and touches join their entry: an
# entry deleted since has no row, and its delete follows in the log.
_REPLAY = """
    SELECT c.seq, c.op, c.entry_id, c.namespace, c.key,
           e.namespace, e.key, e.size, e.raw_size, e.file, e.codec
    FROM changes AS c LEFT JOIN entries AS e ON c.op != 3 AND e.id = c.entry_id
    WHERE c.seq > ? ORDER BY c.seq
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


@dataclass(frozen=True, slots=True)
class CheckReport:
    """What :meth:`LlamaDiskCache.check` found (and, with ``fix``, repaired).

    Attributes:
        entries: rows in the index.
        files: payload files in the data directory.
        bytes_indexed: sum of the sizes the index records.
        bytes_on_disk: sum of the payload files' real sizes (orphans included).
        orphan_files: files no entry names: left by a crash between writing and committing, or being
            written right now. Harmless (wasted space).
        missing_files: entries whose file is gone. Harmless to callers (a miss) but a defect.
        size_mismatches: entries whose file length differs from the index's.
        corrupt_files: entries whose payload fails to decode (``deep`` checks only).
        index_ok: SQLite's ``quick_check`` passed.
        removed_entries: entries deleted by ``fix``.
        removed_files: orphan files deleted by ``fix`` (those older than the grace period).
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

    @property
    def problems(self) -> tuple[str, ...]:
        """Entries that could hurt: rows naming a missing, resized or corrupt payload."""
        return self.missing_files + self.size_mismatches + self.corrupt_files

    @property
    def ok(self) -> bool:
        """True when nothing at all is wrong (no orphan either)."""
        return self.index_ok and not self.problems and not self.orphan_files


class _Entry:
    """What a process keeps in memory per entry (the key lives in the radix index, not here)."""

    __slots__ = ("id", "namespace", "size", "raw_size", "file", "codec", "recency")

    def __init__(
        self, id: int, namespace: str, size: int, raw_size: int, file: str, codec: str, recency: int
    ) -> None:
        self.id = id
        self.namespace = namespace
        self.size = size
        self.raw_size = raw_size
        self.file = file
        self.codec = codec
        self.recency = recency


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


class LlamaDiskCache(BaseLlamaCache):
    """A persistent LRU cache of model states in a directory, shared safely by several processes.

    ``cache[query]`` returns the state of the stored key sharing the longest non-empty common prefix
    with ``query`` (even if it diverges afterwards or runs past the query's end), ties going to the
    most recently used entry; it raises ``KeyError`` when no key shares a first token. ``key in
    cache`` asks the same without touching recency. The lookup costs O(K) in the query length,
    whatever the number of entries, plus mapping and checksumming the payload on a hit.

    Capacity is real bytes on disk (the payload files; the SQLite index is not charged):
    ``cache_size`` never exceeds ``capacity_bytes``. Storing evicts least recently used entries until
    the new one fits; a state larger than the whole capacity is not stored (``stats().rejected``). The
    LRU order and the capacity are shared by every process using the directory (each evicts with the
    ``capacity_bytes`` it was given). ``len``, ``cache_size`` and ``stats().entries`` cover every
    namespace in the directory; hits, misses, evictions and rejections are this instance's.

    Values must be llama-cache :class:`~llama_cache.state.llama_state.LlamaState`\\ s (what
    ``llama_cache.Llama.save_state`` returns). I/O failures while storing (a full disk, a locked
    index) are logged and the state is simply not cached: the caller never sees them.

    All methods are thread-safe; nothing is printed. See the module docstring for the on-disk
    protocol, write-behind and namespaces.

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
        compress: a zlib level (1-9) to compress payloads with, or None (default: model states barely
            compress and decompression defeats zero-copy reads; see ``benchmarks/disk.py``).
        verify: check each payload's checksum when it is read (default). Turning it off saves one pass
            over the bytes but lets a damaged payload reach llama.cpp.
        timeout: seconds to wait for another process's index transaction before giving up.

    Raises:
        TypeError, ValueError: a bad ``capacity_bytes``, ``max_pending`` or ``compress``.
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
        compress: int | None = None,
        verify: bool = True,
        timeout: float = 30.0,
    ) -> None:
        super().__init__(capacity_bytes)
        if not isinstance(max_pending, int) or isinstance(max_pending, bool) or max_pending < 1:
            raise ValueError(f"max_pending must be a positive int, got {max_pending!r}")
        if compress is not None and (not isinstance(compress, int) or not 1 <= compress <= 9):
            raise ValueError(f"compress must be None or a zlib level 1..9, got {compress!r}")
        if fingerprint is not None and not isinstance(fingerprint, str):
            raise TypeError(f"fingerprint must be a str or None, got {type(fingerprint).__name__}")
        self.cache_dir = Path(cache_dir)
        self.verbose = verbose
        self.write_behind = bool(write_behind)
        self.max_pending = max_pending
        self.fsync = bool(fsync)
        self.compress = compress
        self.verify = bool(verify)
        self.timeout = float(timeout)
        self._namespace = fingerprint
        self._data_dir = self.cache_dir / DATA_DIR
        self._db_path = self.cache_dir / INDEX_FILE
        # Per-process state (rebuilt after fork): the connection and what it has replayed.
        self._pid = os.getpid()
        self._conn: sqlite3.Connection | None = None
        self._data_version = -1
        self._last_seq = 0
        self._indexes: dict[str, RadixIndex[_Entry]] = {}
        self._entries: dict[int, _Entry] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # entry ids, least recently used first
        self._bytes = 0
        # This instance's counters.
        self._hits = self._misses = self._evictions = self._rejected = self._write_errors = 0
        # Write-behind queue.
        self._cond = threading.Condition()
        self._queue: deque[tuple[npt.NDArray[np.int32], LlamaState]] = deque()
        self._submitted = 0
        self._completed = 0
        self._writer: threading.Thread | None = None
        self._fork_locked = False
        with self._lock:
            self._connection()  # fail early on an unusable directory
        _LIVE.add(self)

    # ---------------------------------------------------------------------------------- namespaces

    @property
    def fingerprint(self) -> str | None:
        """The namespace lookups are answered from, or None for every namespace."""
        return self._namespace

    def bind(self, fingerprint: str | None) -> None:
        """Answer lookups only from entries made by the model with this fingerprint (None: any).

        Stores are unaffected: a state is always filed under its own fingerprint.
        """
        if fingerprint is not None and not isinstance(fingerprint, str):
            raise TypeError(f"fingerprint must be a str or None, got {type(fingerprint).__name__}")
        with self._lock:
            self._namespace = fingerprint

    # --------------------------------------------------------------------------------- the mapping

    @property
    def cache_size(self) -> int:
        """Bytes of the payload files of every entry in the directory (after pending writes)."""
        self._wait_for_writes()
        with self._lock:
            self._sync()
            return self._bytes

    def __len__(self) -> int:
        self._wait_for_writes()
        with self._lock:
            self._sync()
            return len(self._entries)

    def __contains__(self, key: Sequence[int]) -> bool:  # type: ignore[override]
        """Whether a stored key shares a first token with ``key``; touches neither recency nor counters.

        The payload is not read: ``cache[key]`` can still miss if it turns out to be damaged.
        """
        query = as_token_array(key)
        self._wait_for_writes()
        try:
            with self._lock:
                self._sync()
                return self._best(query) is not None
        except sqlite3.Error as error:
            logger.warning("disk cache: index unavailable (%s); answering no", error)
            return False

    def __getitem__(self, key: Sequence[int]) -> LlamaState:
        """Return the state of the best entry for ``key`` and make that entry the most recently used.

        The state's arrays are read-only views of the memory-mapped payload file (no copy).

        Raises:
            KeyError: no stored key shares a first token with ``key``, or every candidate's payload
                was damaged (each such entry is logged and removed), or the index is unavailable
                (logged).
            TypeError, ValueError: ``key`` is not a sequence of token ids.
        """
        query = as_token_array(key)
        self._wait_for_writes()
        try:
            state = self._lookup(query)
        except sqlite3.Error as error:
            logger.warning("disk cache: index unavailable (%s); a miss", error)
            state = None
        if state is None:
            with self._lock:
                self._misses += 1
            raise KeyError("no cached prefix for this key")
        return state

    def _lookup(self, query: npt.NDArray[np.int32]) -> LlamaState | None:
        for _ in range(_LOAD_ATTEMPTS):
            with self._lock:
                self._sync()
                entry = self._best(query)
            if entry is None:
                return None
            try:
                state = self._load(entry)
            except _Unreadable as problem:
                self._forget_unreadable(entry, problem)
                continue
            with self._lock:
                self._touch(entry.id)
                self._hits += 1
            return state
        return None

    def __setitem__(self, key: Sequence[int], value: LlamaState) -> None:
        """Store ``value`` under ``key`` (in its fingerprint's namespace), replacing any entry there.

        With write-behind the call only queues the state (waiting if ``max_pending`` are queued).
        Least recently used entries are evicted until it fits; a state larger than the capacity is not
        stored and the entry it would replace is dropped. I/O errors are logged, never raised.

        Raises:
            TypeError: ``value`` is not a llama-cache ``LlamaState``, or ``key`` not token ids.
            ValueError: a token id is out of range.
        """
        tokens = as_token_array(key).copy()
        if not isinstance(value, LlamaState):
            raise TypeError(
                f"LlamaDiskCache stores llama_cache LlamaState values (from llama_cache.Llama), "
                f"not {type(value).__name__}"
            )
        if self.write_behind:
            self._enqueue(tokens, value)
        else:
            self._store(tokens, value)

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
                for namespace, index in self._indexes.items()
                if self._namespace in (None, namespace) and (entry := index.get(tokens)) is not None
            ]
            if not victims:
                raise KeyError("no state stored under exactly this key")
            self._delete(victims)

    def keys(self) -> Iterator[tuple[int, ...]]:
        """Stored keys of the bound namespace (all when unbound), least recently used first (a snapshot)."""
        self._wait_for_writes()
        with self._lock:
            conn = self._connection()
            rows = conn.execute("SELECT namespace, key FROM entries ORDER BY recency").fetchall()
        return iter([tuple(_tokens(blob).tolist()) for ns, blob in rows if self._namespace in (None, ns)])

    def entries(self) -> list[DiskEntry]:
        """Every entry of the directory (all namespaces), least recently used first."""
        self._wait_for_writes()
        with self._lock:
            rows = self._connection().execute(
                "SELECT id, namespace, length(key) / 4, size, raw_size, codec, file, created, accessed, hits "
                "FROM entries ORDER BY recency"
            ).fetchall()
        return [DiskEntry(*row) for row in rows]

    def clear(self) -> None:
        """Remove every entry of the directory (all namespaces). Counters are kept."""
        self._wait_for_writes()
        with self._lock:
            self._sync()
            self._delete([self._entries[i] for i in self._lru])

    def stats(self) -> CacheStats:
        """This instance's hits, misses, evictions and rejections; the directory's entries and bytes."""
        self._wait_for_writes()
        with self._lock:
            self._sync()
            return CacheStats(
                hits=self._hits,
                misses=self._misses,
                entries=len(self._entries),
                bytes=self._bytes,
                capacity_bytes=self.capacity_bytes,
                evictions=self._evictions,
                rejected=self._rejected,
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

        Finds orphan files (named by no entry), entries whose file is missing or has another length than
        recorded, and with ``deep`` entries whose payload does not decode (reads every file). With
        ``fix`` the bad entries are deleted (through the change log, so other processes follow) and
        orphan files older than ``grace_seconds`` are unlinked: younger ones may belong to a write in
        progress in another process.

        Returns:
            A :class:`CheckReport` of what was found (and removed).
        """
        self._wait_for_writes()
        with self._lock:
            conn = self._connection()
            self._sync()
            rows = conn.execute("SELECT id, file, size FROM entries").fetchall()
            index_ok = conn.execute("PRAGMA quick_check").fetchone()[0] == "ok"
        # Rows are read before the directory is listed: a file committed in between is then an
        # orphan younger than the grace period, never a "missing" file of a good entry.
        files = self._list_files()
        named = {file for _, file, _ in rows}
        missing: list[tuple[int, str]] = []
        mismatched: list[tuple[int, str]] = []
        corrupt: list[tuple[int, str]] = []
        for entry_id, file, size in rows:
            found = files.get(file)
            if found is None:
                missing.append((entry_id, file))
            elif found[0] != size:
                mismatched.append((entry_id, file))
            elif deep:
                with self._lock:
                    entry = self._entries.get(entry_id)
                if entry is not None:
                    try:
                        self._load(entry)
                    except _Unreadable:
                        corrupt.append((entry_id, file))
        # Rows evicted by another process while we looked are not problems.
        suspects = missing + mismatched + corrupt
        if suspects:
            with self._lock:
                self._sync()
                alive = {i for i, _ in suspects if i in self._entries}
            missing = [m for m in missing if m[0] in alive]
            mismatched = [m for m in mismatched if m[0] in alive]
            corrupt = [m for m in corrupt if m[0] in alive]
        orphans = sorted(file for file in files if file not in named)
        removed_entries = removed_files = 0
        if fix:
            bad = {i for i, _ in missing + mismatched + corrupt}
            with self._lock:
                self._sync()
                victims = [self._entries[i] for i in bad if i in self._entries]
                removed_entries = len(self._delete(victims))
            now = time.time()
            with self._lock:
                self._sync()
                still_named = {entry.file for entry in self._entries.values()}
            for file in orphans:
                if file in still_named or now - files[file][1] < grace_seconds:
                    continue
                try:
                    os.unlink(self._data_dir / file)
                    removed_files += 1
                except FileNotFoundError:
                    pass
                except OSError as error:
                    logger.warning("check: could not remove orphan %s: %s", file, error)
        return CheckReport(
            entries=len(rows),
            files=len(files),
            bytes_indexed=sum(size for _, _, size in rows),
            bytes_on_disk=sum(size for size, _ in files.values()),
            orphan_files=tuple(orphans),
            missing_files=tuple(file for _, file in missing),
            size_mismatches=tuple(file for _, file in mismatched),
            corrupt_files=tuple(file for _, file in corrupt),
            index_ok=index_ok,
            removed_entries=removed_entries,
            removed_files=removed_files,
        )

    def _list_files(self) -> dict[str, tuple[int, float]]:
        """Payload files under the data directory: relative name -> (size, mtime)."""
        found: dict[str, tuple[int, float]] = {}
        try:
            subdirs = list(os.scandir(self._data_dir))
        except FileNotFoundError:
            return found
        for subdir in subdirs:
            if not subdir.is_dir(follow_symlinks=False):
                continue
            try:
                children = list(os.scandir(subdir.path))
            except FileNotFoundError:
                continue
            for child in children:
                name = f"{subdir.name}/{child.name}"
                if not _FILE_NAME.match(name):
                    continue
                try:
                    info = child.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                found[name] = (info.st_size, info.st_mtime)
        return found

    # --------------------------------------------------------------------------- index in memory

    def _best(self, query: npt.NDArray[np.int32]) -> _Entry | None:
        """The entry answering ``query``: longest common prefix, then most recent. Lock held."""
        if self._namespace is not None:
            index = self._indexes.get(self._namespace)
            match = index.longest_common_prefix(query) if index is not None else None
            return None if match is None else match.value
        best: _Entry | None = None
        best_rank = (0, 0)
        for index in self._indexes.values():
            match = index.longest_common_prefix(query)
            if match is not None and (match.common, match.value.recency) > best_rank:
                best, best_rank = match.value, (match.common, match.value.recency)
        return best

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
        floor = conn.execute("SELECT value FROM meta WHERE name = 'floor'").fetchone()[0]
        if self._last_seq < floor:
            self._rebuild(conn)
            return
        for seq, op, entry_id, _del_ns, del_key, ns, key, size, raw_size, file, codec in conn.execute(
            _REPLAY, (self._last_seq,)
        ):
            if op == _ADD:
                if ns is not None and entry_id not in self._entries:
                    self._add_local(_Entry(entry_id, ns, size, raw_size, file, codec, seq), _tokens(key))
            elif op == _TOUCH:
                entry = self._entries.get(entry_id)
                if entry is not None and key is not None:
                    entry.recency = seq
                    self._lru.move_to_end(entry_id)
                    try:
                        self._indexes[entry.namespace].touch(_tokens(key))
                    except KeyError:  # pragma: no cover - the index and the entries agree
                        logger.error("disk cache index out of step; rebuilding")
                        self._rebuild(conn)
                        return
            elif op == _DELETE:
                entry = self._entries.pop(entry_id, None)
                if entry is not None:
                    del self._lru[entry_id]
                    self._bytes -= entry.size
                    index = self._indexes[entry.namespace]
                    tokens = _tokens(del_key)
                    if index.get(tokens) is entry:
                        index.remove(tokens)
                    if not len(index):
                        del self._indexes[entry.namespace]
            self._last_seq = seq

    def _add_local(self, entry: _Entry, tokens: npt.NDArray[np.int32]) -> None:
        index = self._indexes.get(entry.namespace)
        if index is None:
            index = self._indexes[entry.namespace] = RadixIndex()
        old = index.insert(tokens, entry)
        if old is not None and old is not entry:  # pragma: no cover - deletes precede re-adds
            self._entries.pop(old.id, None)
            self._lru.pop(old.id, None)
            self._bytes -= old.size
        self._entries[entry.id] = entry
        self._lru[entry.id] = None
        self._bytes += entry.size

    def _rebuild(self, conn: sqlite3.Connection) -> None:
        """Rebuild the in-memory index from the entries table (in the caller's read transaction)."""
        self._indexes = {}
        self._entries = {}
        self._lru = OrderedDict()
        self._bytes = 0
        row = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'changes'").fetchone()
        self._last_seq = row[0] if row else 0
        for entry_id, ns, key, size, raw_size, file, codec, recency in conn.execute(
            "SELECT id, namespace, key, size, raw_size, file, codec, recency FROM entries ORDER BY recency"
        ):
            self._add_local(_Entry(entry_id, ns, size, raw_size, file, codec, recency), _tokens(key))

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
        os.makedirs(self._data_dir, exist_ok=True)
        conn = sqlite3.connect(
            self._db_path, timeout=self.timeout, isolation_level=None, check_same_thread=False
        )
        try:
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
                raise sqlite3.OperationalError(f"cannot use WAL mode on {self._db_path} (got {mode})")
            conn.execute(f"PRAGMA synchronous = {'FULL' if self.fsync else 'NORMAL'}")
            with _transaction(conn):
                version = conn.execute("PRAGMA user_version").fetchone()[0]
                if version not in (0, SCHEMA_VERSION):
                    raise ValueError(
                        f"{self._db_path} has index schema version {version}; this llama-cache "
                        f"reads {SCHEMA_VERSION}"
                    )
                for statement in _SCHEMA:
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("BEGIN")
            try:
                self._rebuild(conn)
            finally:
                conn.execute("COMMIT")
            self._data_version = conn.execute("PRAGMA data_version").fetchone()[0]
        except BaseException:
            conn.close()
            raise
        self._conn = conn

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

    def _load(self, entry: _Entry) -> LlamaState:
        """Read and decode an entry's payload. No lock needed: payload files never change.

        Raises:
            _Unreadable: the file is missing, has the wrong length, or does not decode.
        """
        path = self._data_dir / entry.file
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise _Unreadable("payload file is missing", missing=True) from None
        except OSError as error:
            raise _Unreadable(f"cannot open payload: {error}") from None
        try:
            size = os.fstat(fd).st_size
            if size != entry.size:
                raise _Unreadable(f"payload is {size} bytes, the index says {entry.size}")
            if entry.codec == "raw":
                buffer: Any = _map_read_only(fd, size)
            elif entry.codec == "zlib":
                buffer = _inflate(_read_all(fd, size), entry.raw_size)
            else:
                raise _Unreadable(f"unknown codec {entry.codec!r}")
        except (OSError, ValueError) as error:  # ValueError: mmap of an empty file
            raise _Unreadable(f"cannot read payload: {error}") from None
        finally:
            os.close(fd)
        try:
            state = decode(buffer, verify=self.verify)
        except CorruptStateError as error:
            raise _Unreadable(f"corrupt payload: {error}") from None
        except Exception as error:  # noqa: BLE001 - odd bytes past the checksum must stay a miss
            raise _Unreadable(f"undecodable payload: {type(error).__name__}: {error}") from None
        if state.fingerprint != entry.namespace:
            raise _Unreadable("payload belongs to another model than its index entry")
        return state

    def _forget_unreadable(self, entry: _Entry, problem: _Unreadable) -> None:
        """Remove an entry whose payload could not be loaded, unless another process already did."""
        with self._lock:
            self._sync()
            if entry.id not in self._entries:
                return  # evicted or replaced meanwhile: not damage
            logger.warning("disk cache: dropping entry %s (%s): %s", entry.id, entry.file, problem)
            self._delete([entry])

    def _touch(self, entry_id: int) -> None:
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
                        "UPDATE entries SET recency = ?, accessed = ?, hits = hits + 1 WHERE id = ?",
                        (cursor.lastrowid, time.time(), entry_id),
                    )
        except sqlite3.Error as error:
            logger.warning("disk cache: could not record a hit: %s", error)
            return
        self._sync(force=True)

    # ----------------------------------------------------------------------------------- writing

    def _enqueue(self, tokens: npt.NDArray[np.int32], state: LlamaState) -> None:
        with self._cond:
            while len(self._queue) >= self.max_pending:
                self._cond.wait()
            self._queue.append((tokens, state))
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
                tokens, state = self._queue.popleft()
                self._cond.notify_all()
            try:
                self._store(tokens, state)
            except Exception:  # noqa: BLE001 - the writer must outlive one bad state; logged
                self._write_errors += 1
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
                    tokens, state = self._queue.popleft()
                    self._cond.release()
                    try:
                        self._store(tokens, state)
                    finally:
                        self._cond.acquire()
                        self._completed += 1
                        self._cond.notify_all()
                    continue
                self._cond.wait(timeout=1.0)

    def _store(self, tokens: npt.NDArray[np.int32], state: LlamaState) -> None:
        """Write one state's payload, then commit it. Runs in the writer thread or the caller's."""
        namespace = state.fingerprint
        parts = encode(state)
        raw_size = encoded_size(parts)
        if self.compress is None and raw_size > self.capacity_bytes:
            self._reject(namespace, tokens, raw_size)
            return
        name = f"{secrets.token_hex(1)}/{secrets.token_hex(16)}{_SUFFIX}"
        try:
            size = self._write_payload(self._data_dir / name, parts)
        except OSError as error:
            with self._lock:
                self._write_errors += 1
            level = logging.WARNING
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                logger.log(level, "disk cache: no space left for a %d-byte state; not cached", raw_size)
            else:
                logger.log(level, "disk cache: could not write a state (%s); not cached", error)
            return
        if size > self.capacity_bytes:
            _unlink(self._data_dir / name)
            self._reject(namespace, tokens, size)
            return
        self._commit(namespace, tokens, name, size, raw_size)

    def _write_payload(self, path: Path, parts: list[memoryview]) -> int:
        """Create ``path`` (which must not exist) holding ``parts``; remove it on any failure."""
        os.makedirs(path.parent, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
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
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)
        if self.fsync:
            _fsync_dir(path.parent)
        return size

    def _commit(self, namespace: str, tokens: npt.NDArray[np.int32], name: str, size: int, raw_size: int) -> None:
        """Commit a written payload: replace the same key, evict LRU entries, then unlink their files."""
        blob = _key_blob(tokens)
        now = time.time()
        with self._lock:
            try:
                conn = self._connection()
                with _transaction(conn):
                    self._sync(force=True)  # under the write lock: the local view equals the index
                    index = self._indexes.get(namespace)
                    old = index.get(tokens) if index is not None else None
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
                        row = conn.execute("SELECT hits FROM entries WHERE id = ?", (old.id,)).fetchone()
                        hits = int(row[0]) if row is not None else 0
                    self._delete_rows(conn, victims)
                    cursor = conn.execute(
                        "INSERT INTO entries (namespace, key, key_hash, file, size, raw_size, codec, created, "
                        "accessed, recency, hits) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?)",
                        (namespace, blob, _key_hash(blob), name, size, raw_size,
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
                logger.warning("disk cache: could not commit a state (%s); not cached", error)
                _unlink(self._data_dir / name)
                return
            self._evictions += evicted
            try:
                self._sync(force=True)
            except sqlite3.Error as error:  # committed; the next operation catches up
                logger.warning("disk cache: could not re-read the index after a commit: %s", error)
        for victim in victims:  # only now that no committed row names them
            _unlink(self._data_dir / victim.file)

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
            index = self._indexes.get(namespace)
            old = index.get(tokens) if index is not None else None
            if old is not None:
                self._delete([old])

    def _delete(self, victims: list[_Entry]) -> list[_Entry]:
        """Delete entries in one transaction, then unlink their files. Lock held; errors are logged.

        Returns:
            The entries deleted.
        """
        if not victims:
            return []
        conn = self._connection()
        try:
            with _transaction(conn):
                deleted = self._delete_rows(conn, victims)
        except sqlite3.Error as error:
            logger.warning("disk cache: could not delete %d entries: %s", len(victims), error)
            return []
        self._sync(force=True)
        for victim in deleted:
            _unlink(self._data_dir / victim.file)
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
        floor = conn.execute("SELECT value FROM meta WHERE name = 'floor'").fetchone()[0]
        if seq - floor >= _TRIM_EVERY:
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


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as error:
        logger.warning("disk cache: could not remove %s: %s", path, error)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
