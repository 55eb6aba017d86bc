"""LlamaDiskCache: the disk tier's cache class, tying the index, the payloads and the write queue together.

It owns what the other modules of the package do not: the namespaces (``bind``, filing of states), the
mapping protocol (lookups, stores, deletes, listings), decoding and checking payloads against their
rows, the store path (encode, write, commit with eviction, unlink) and this process's SQLite connection
(reopened after ``fork``), kept in step with the index through an :class:`~.view._IndexView`. See the
package docstring for the protocols.

This module is past the ~400 lines STYLE.md asks for because it is one class whose methods share one
lock, one connection and one view: a store decides in the view, commits in SQL and syncs the view in
the same transaction, and lookups, eviction and deletes follow the same pattern. What does not need
that state lives in the sibling modules.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import numpy.typing as npt

from llama_cache.caches.base import DEFAULT_CAPACITY_BYTES, BaseLlamaCache, CacheStats
from llama_cache.caches import lifecycle
from llama_cache.caches.write_behind import WriteBehindQueue
from llama_cache.caches.disk import chunked, chunkstore
from llama_cache.caches.disk.checker import CheckReport, StorageReport, _check, _reclaim_orphans, _storage
from llama_cache.caches.disk.connection import IndexConnection, connect, file_identity, is_damage, move_aside
from llama_cache.caches.disk.locking import DirectoryLock
from llama_cache.caches.disk.payloads import DATA_DIR, _compress_level, _DataDir, _Unreadable
from llama_cache.caches.disk.rows import (
    _MAX_KEY_TOKENS,
    _MAX_NAMESPACE,
    DiskEntry,
    _as_float,
    _BadRow,
    _check_fingerprint,
    _check_model_info,
    _Entry,
    _entry_from_row,
    _is_int,
    _key_blob,
    _key_hash,
    _model_info_from_row,
    _state_cap,
)
from llama_cache.caches.disk.schema import (
    _ADD,
    _DELETE,
    _ROW,
    _TOUCH,
    INDEX_FILE,
    CacheDirectoryError,
    _create_schema,
    _delete_rows,
    _maybe_trim,
    _transaction,
)
from llama_cache.caches.disk.view import _IndexView
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
from llama_cache.state.chunks import KIND_CHUNKED, MAX_CHUNK_FILE_TOKENS, encode_head
from llama_cache.state.fingerprint import model_description, model_fingerprint
from llama_cache.state.llama_state import LlamaState
from llama_cache.state.values import can_be_cut, filing_key, state_tokens
from llama_cache.tokens import as_token_array

logger = logging.getLogger("llama_cache.caches.disk")  # one logger for the whole disk tier

UNBOUND_NAMESPACE = "llama-cpp-python"
"""The namespace of llama-cpp-python states stored without a fingerprint into an unbound cache."""
ORPHAN_GRACE_SECONDS = 600.0
"""Orphan payload files older than this are removed when a cache opens the directory."""
_KIND_NAMES = {KIND_LLAMA_CACHE: "llama_cache", KIND_UPSTREAM: "llama_cpp", KIND_CHUNKED: "chunked"}
_LOAD_ATTEMPTS = 8  # entries tried by one lookup before it gives up (each failure removes one)
# Connections inherited across fork: kept referenced so that their finalizer never runs in the child.
_ABANDONED: list[IndexConnection] = []


class _ChunkGone(Exception):
    """A chunk a store counted on was freed by another process before the store committed."""


class _TooBig(Exception):
    """A new entry does not fit the capacity even with every other entry evicted."""


class LlamaDiskCache(BaseLlamaCache, lifecycle.HeldAcrossFork):
    """A persistent LRU cache of model states in a directory, shared safely by several processes.

    ``cache[query]`` returns the state of the best stored entry for ``query``, ties going to the most
    recently used entry: among entries whose state can be cut back (transformer KV, llama-cpp-python's
    states), the key sharing the longest non-empty common prefix with ``query`` (even if it diverges
    afterwards or runs past the query's end); among the others (recurrent and hybrid states), the
    longest key that is a prefix of ``query``. It raises ``KeyError`` when none qualifies. ``key in
    cache`` asks the same without touching recency. The lookup costs O(K) in the query length per
    namespace searched, whatever the number of entries, plus reading and checksumming the payload.

    Transformer states are stored as a chain of content-addressed KV chunks plus a small chain head
    (tokens, logits): equal prefixes of any two entries are the same chunks, stored once, so a system
    prompt shared by many conversations and each turn's history cost their bytes once (see the package
    docstring). :meth:`lookup_prefix` reads only the chunks a query shares.

    Capacity is real bytes on disk (payload, head and chunk files, each counted once however many
    entries share it; the SQLite index is not charged): ``cache_size`` never exceeds
    ``capacity_bytes``. Storing evicts least recently used entries until the new one fits; evicting an
    entry frees the chunks no other entry links. A state that does not fit the whole capacity is not
    stored (``stats().rejected``). The
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

    All methods are thread-safe; nothing is printed. See the package docstring for the on-disk
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
            with ``synchronous=FULL``: entries then survive a power loss, not only a crash. Without it
            the index is committed with ``synchronous=OFF``: a crash of the process loses nothing, a
            power loss may damage the index, which is then moved aside and started again empty.
        compress: ``"zlib"`` (level 6) or a zlib level 1..9 to compress payloads with, or None
            (default: model states barely compress, and inflating costs more than reading; see
            ``benchmarks/disk.py``).
        verify: check each payload's checksum when it is read (default). Turning it off saves one pass
            over the bytes but lets a damaged payload reach llama.cpp.
        timeout: seconds (finite, > 0) to wait for another process's index transaction.
        chunk_tokens: tokens per KV chunk (None: by the model's KV bytes per token,
            :func:`~llama_cache.state.chunks.default_chunk_tokens`, 16 for the default model), or 0
            to store every state whole, one payload file each (nothing shared: the fastest store
            and hit when entries share no prefixes). Processes sharing a directory should use the
            same value: chains of different lengths share no chunks (they are never confused either).

    Raises:
        TypeError, ValueError: a bad argument.
        CacheDirectoryError: ``cache_dir`` cannot hold a cache (not a directory, read-only, an index
            of a newer schema, a damaged index that cannot be moved aside); an :class:`OSError`
            naming the path. A damaged index (not a database, or corrupt) is not an error: it is
            moved aside to ``index.sqlite3.damaged-<unix time>`` and the cache starts empty (logged
            at WARNING, counted in ``stats().index_resets``), at open or whenever it is found later.
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
        chunk_tokens: int | None = None,
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
        if chunk_tokens is not None:
            if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool):
                raise TypeError(f"chunk_tokens must be an int or None, got {type(chunk_tokens).__name__}")
            if not 0 <= chunk_tokens <= MAX_CHUNK_FILE_TOKENS:
                raise ValueError(f"chunk_tokens must be in 0..{MAX_CHUNK_FILE_TOKENS}, got {chunk_tokens}")
        self.chunk_tokens = chunk_tokens
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
        # Per-process state (rebuilt after fork): the locks, the connection and what it has replayed.
        self._pid = os.getpid()
        self._lock = DirectoryLock(self.cache_dir, self.timeout)
        self._conn: IndexConnection | None = None
        self._data_version = -1
        self._view = _IndexView(self._log_bad_row)
        self._chunk_bytes = 0  # bytes of the chunk files, as of the last sync
        self._bad_rows: set[tuple[str, int]] = set()  # malformed rows already logged
        # This instance's counters.
        self._hits = self._misses = self._evictions = self._rejected = self._write_errors = 0
        self._writes = self._store_errors = self._index_resets = 0
        # Write-behind queue of (key, value, namespace, kind).
        self._pending = WriteBehindQueue(lambda item: self._store(*item), self._store_failed,
                                         thread_name="llama-cache-disk-writer")
        with self._lock:
            self._open()  # fail early on an unusable directory
        _reclaim_orphans(self, ORPHAN_GRACE_SECONDS)
        lifecycle.register(self, stage=lifecycle.BACK)

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
        """Bytes of the payload, head and chunk files of the directory, each once (after pending writes)."""
        self._wait_for_writes()
        with self._lock:
            self._sync_or_log()
            return self._view.bytes + self._chunk_bytes

    def __len__(self) -> int:
        self._wait_for_writes()
        with self._lock:
            self._sync_or_log()
            return len(self._view.entries)

    def __contains__(self, key: Sequence[int]) -> bool:  # type: ignore[override]
        """Whether an entry would answer ``key``; touches neither recency nor counters.

        The payload is not read: ``cache[key]`` can still miss if it turns out to be damaged.
        """
        query = as_token_array(key)
        self._wait_for_writes()
        try:
            with self._lock:
                self._sync()
                return self._view.best(query, self._namespace) is not None
        except Exception as error:  # noqa: BLE001 - a damaged index is a "no", never an error
            logger.warning("disk cache: index unavailable (%s); answering no", error)
            return False

    def match_length(self, key: Sequence[int]) -> int:
        """Leading tokens of ``key`` the state ``lookup_prefix(key)`` would restore, 0 on a miss: the
        common prefix with the best entry's key (a whole key for states that cannot be cut). From the
        in-memory index, O(K) per namespace searched; no payload read, no recency change.

        Raises:
            TypeError, ValueError: ``key`` is not a sequence of token ids.
        """
        query = as_token_array(key)
        self._wait_for_writes()
        try:
            with self._lock:
                self._sync()
                match = self._view.best(query, self._namespace)
        except Exception as error:  # noqa: BLE001 - a damaged index is a miss, never an error
            logger.warning("disk cache: index unavailable (%s); answering 0", error)
            return 0
        return 0 if match is None else match.common

    def __getitem__(self, key: Sequence[int]) -> Any:
        """Return the state of the best entry for ``key`` and make that entry the most recently used.

        A llama-cache state's arrays are read-only views of a private copy of the payload file;
        a llama-cpp-python state is rebuilt as its own ``LlamaState`` type.

        Raises:
            KeyError: no entry answers ``key``, or every candidate's payload was damaged (each such
                entry is logged and removed), or the index is unavailable or damaged (logged).
            TypeError, ValueError: ``key`` is not a sequence of token ids.
        """
        return self._answer(key, shared_only=False)

    def lookup_prefix(self, key: Sequence[int]) -> Any:
        """Like ``cache[key]``, reading only what ``key`` shares with the entry: the chunk-granular path.

        The same entry answers as for ``cache[key]``. When it diverges from ``key`` (or runs past its
        end), the state returned holds only the common prefix, without logits, and only the chunks
        covering that prefix are read: a prompt sharing 1,000 tokens with a 5,000-token entry reads
        1,000 tokens' KV. Otherwise the whole state comes back, as from ``cache[key]``.
        ``llama_cache.Llama`` looks up through this method.

        Raises:
            KeyError: as ``cache[key]``.
            TypeError, ValueError: ``key`` is not a sequence of token ids.
        """
        return self._answer(key, shared_only=True)

    def _answer(self, key: Sequence[int], shared_only: bool) -> Any:
        query = as_token_array(key)
        self._wait_for_writes()
        try:
            state = self._lookup(query, shared_only)
        except Exception as error:  # noqa: BLE001 - whatever the directory holds, a lookup only misses
            logger.warning("disk cache: index unavailable or damaged (%s: %s); a miss", type(error).__name__, error)
            state = None
        if state is None:
            with self._lock:
                self._misses += 1
            raise KeyError("no cached prefix for this key")
        return state

    def _lookup(self, query: npt.NDArray[np.int32], shared_only: bool) -> Any:
        for _ in range(_LOAD_ATTEMPTS):
            with self._lock:
                self._sync()
                match = self._view.best(query, self._namespace)
            if match is None:
                return None
            entry = match.value
            upto = match.common if shared_only and entry.cut and match.common < entry.n_state else None
            try:
                state = self._load(entry, np.asarray(match.key, dtype=np.int32), upto)
            except _Unreadable as problem:
                self._forget_unreadable(entry, problem)
                continue
            except chunked.BrokenChain as broken:
                self._forget_broken_chunk(entry, broken)
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
            kind = KIND_LLAMA_CACHE if value.layout is None or self.chunk_tokens == 0 else KIND_CHUNKED
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
                for (namespace, _), index in self._view.indexes.items()
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
                    _KIND_NAMES[entry.kind], entry.cut,
                )
            )
        return out

    def clear(self) -> None:
        """Remove every entry of the directory (all namespaces). Counters are kept."""
        self._wait_for_writes()
        with self._lock:
            self._sync()
            self._delete([self._view.entries[i] for i in self._view.lru])

    def stats(self) -> CacheStats:
        """This instance's counters; the directory's entries and bytes."""
        self._wait_for_writes()
        with self._lock:
            self._sync_or_log()
            return CacheStats(
                hits=self._hits,
                misses=self._misses,
                entries=len(self._view.entries),
                bytes=self._view.bytes + self._chunk_bytes,
                capacity_bytes=self.capacity_bytes,
                evictions=self._evictions,
                rejected=self._rejected,
                writes=self._writes,
                store_errors=self._store_errors,
                index_resets=self._index_resets,
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
        writer = self._pending.stop()
        if writer is not None and writer is not threading.current_thread():
            writer.join(timeout=self.timeout)
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None and self._pid == os.getpid():
                conn.close()
            self._lock.close()

    def __enter__(self) -> LlamaDiskCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def storage(self) -> StorageReport:
        """Unique bytes on disk against logical bytes (every entry stored whole): what chunks save.

        Raises:
            sqlite3.Error: the index is unavailable.
        """
        return _storage(self)

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
        return _check(self, fix, deep, grace_seconds)

    # ----------------------------------------------------------------------------- keeping in step

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
            self._view.replay(conn)
            self._chunk_bytes = chunkstore.stored_bytes(conn)
            return
        conn.execute("BEGIN")
        try:
            self._view.replay(conn)
            self._chunk_bytes = chunkstore.stored_bytes(conn)
        finally:
            conn.execute("COMMIT")

    # ------------------------------------------------------------------------------- connection

    def _connection(self) -> IndexConnection:
        """This process's connection, (re)opened as needed, with the directory's lock held. Lock held.

        At the start of a locked section the index is reopened if another process replaced or removed
        its file, and moved aside and started again if this connection found it damaged.

        Raises:
            sqlite3.Error: the directory cannot be locked or the index cannot be opened (for callers,
                an unavailable index like any other).
        """
        if self._pid != os.getpid():
            self._reset_after_fork()
        fresh = self._lock.hold_directory()
        conn = self._conn
        if conn is not None and fresh and (
            conn.damaged is not None or conn.stale or file_identity(self._db_path) != conn.identity
        ):
            self._conn = None
            conn.close()
            if conn.damaged is not None and file_identity(self._db_path) == conn.identity:
                try:
                    self._set_aside(conn.damaged)
                except CacheDirectoryError as error:
                    raise sqlite3.OperationalError(str(error)) from None
            else:
                logger.info("disk cache: %s was replaced or removed by another process; reopening it", self._db_path)
        if self._conn is None:
            try:
                self._open()
            except CacheDirectoryError as error:
                raise sqlite3.OperationalError(str(error)) from None
        assert self._conn is not None
        return self._conn

    def _open(self) -> None:
        """Open (creating if needed) the directory and its index; a damaged index is moved aside. Lock held.

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
            self._lock.hold_directory()
        except sqlite3.Error as error:
            raise CacheDirectoryError(str(error)) from None
        for attempt in range(2):
            try:
                conn = connect(self._db_path, self.timeout, self.fsync)
            except sqlite3.Error as error:
                if attempt or not is_damage(error):
                    raise CacheDirectoryError(f"cannot open the disk cache index {str(self._db_path)!r}: {error}") from None
                self._set_aside(error)
                continue
            try:
                self._prepare(conn)
            except sqlite3.Error as error:
                conn.close()
                if attempt or not is_damage(error):
                    raise CacheDirectoryError(f"cannot use the disk cache index {str(self._db_path)!r}: {error}") from None
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
            aside = move_aside(self._db_path)
        except OSError as error:
            raise CacheDirectoryError(
                error.errno, f"cannot move the damaged disk cache index {str(self._db_path)!r} aside: {error.strerror}"
            ) from None
        self._data_version = -1
        if aside is None:
            return  # another process moved it first
        self._index_resets += 1
        logger.warning(
            "disk cache: the index %s is damaged (%s); moved it aside to %s and started again empty",
            self._db_path, damage, aside.name,
        )

    def _prepare(self, conn: IndexConnection) -> None:
        with _transaction(conn):
            _create_schema(conn, self._db_path)
        conn.execute("BEGIN")
        try:
            self._view.rebuild(conn)
            self._chunk_bytes = chunkstore.stored_bytes(conn)
        finally:
            conn.execute("COMMIT")
        self._data_version = conn.execute("PRAGMA data_version").fetchone()[0]

    def _reset_after_fork(self) -> None:
        """In a forked child: drop everything tied to the parent's process (never touch its SQLite)."""
        if self._conn is not None:
            _ABANDONED.append(self._conn)  # closing it could disturb the parent's transaction
            self._conn = None
        self._pid = os.getpid()
        self._lock = self._lock.after_fork()
        self._pending.reset_after_fork()
        self._fork_locked = False
        self._data_version = -1  # the in-memory index stays valid; the next sync catches up

    # ----------------------------------------------------------------------------------- reading

    def _load(self, entry: _Entry, key: npt.NDArray[np.int32] | None, upto: int | None = None) -> Any:
        """Read, decode and check an entry's payload. No lock needed: payload files never change.

        Args:
            entry: a validated entry.
            key: its key (None: do not compare the state's tokens with it).
            upto: return only the state of the first ``upto`` tokens (a cuttable entry's; None: all).

        Raises:
            _Unreadable: the file is missing, not a regular file, has the wrong length, does not
                decode, or does not hold what its row says.
            chunked.BrokenChain: a chunked entry's links or chunks are.
        """
        if entry.kind == KIND_CHUNKED:
            return chunked.load(self, entry, key, upto)
        state = self._load_whole(entry, key)
        if upto is not None and isinstance(state, LlamaState) and state.layout is not None:
            return state.prefix(upto, None)
        return state

    def _load_whole(self, entry: _Entry, key: npt.NDArray[np.int32] | None) -> Any:
        """Read an entry stored whole (a payload file)."""
        buffer = self._data.read(entry.file, entry.size, entry.codec, entry.raw_size)
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
            if entry.id not in self._view.entries:
                return  # evicted or replaced meanwhile: not damage
            logger.warning("disk cache: dropping entry %s (%s): %s", entry.id, entry.file, problem)
            self._delete([entry])

    def _forget_broken_chunk(self, entry: _Entry, broken: chunked.BrokenChain) -> None:
        """Remove a damaged chunk and every entry linking it, unless the chain changed meanwhile.

        A chunk freed or absorbed by another process between reading the links and opening the file
        is not damage: the entry's links have moved on, and the next attempt reads the new ones.
        """
        with self._lock:
            try:
                self._sync()
                if entry.id not in self._view.entries:
                    return
                conn = self._connection()
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
            victims = [self._view.entries[i] for i in users if i in self._view.entries]
            logger.warning(
                "disk cache: dropping %d entries using a damaged chunk %s: %s",
                len(victims), broken.chunk.hex() if broken.chunk else "(links)", broken.reason,
            )
            self._delete(victims)

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
        self._pending.put((tokens, value, namespace, kind), self.max_pending)

    def _wait_for_writes(self) -> None:
        if not self.write_behind and not len(self._pending):
            return
        self._pending.wait()

    def _store_failed(self) -> None:
        """Count a store that raised unexpectedly (the write queue logs it)."""
        with self._lock:
            self._write_errors += 1
            self._store_errors += 1

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
                old = self._view.exact(namespace, tokens)
                if old is not None and old.kind == kind and old.n_state == n_state and (old.logits or not has_logits()):
                    self._touch(old.id, hit=False)
                    return
        except sqlite3.Error as error:
            with self._lock:
                self._write_errors += 1
                self._store_errors += 1
            logger.warning("disk cache: index unavailable (%s); state not cached", error)
            return
        if kind == KIND_CHUNKED:
            self._store_chunked(tokens, value, namespace)
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
        name = chunked.new_name()
        try:
            size = self._data.write(name, parts, self.compress, self.fsync)
        except OSError as error:
            self._write_failed(error, raw_size)
            return
        if size > self.capacity_bytes:
            self._data.unlink(name)
            self._reject(namespace, tokens, size)
            return
        row = (kind, int(cut), int(has_logits()), n_state)
        self._commit(namespace, tokens, name, size, raw_size, row)

    def _write_failed(self, error: OSError, nbytes: int) -> None:
        with self._lock:
            self._write_errors += 1
            self._store_errors += 1
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            logger.warning("disk cache: no space left for a %d-byte state; not cached", nbytes)
        else:
            logger.warning("disk cache: could not write a state (%s); not cached", error)

    def _store_chunked(self, tokens: npt.NDArray[np.int32], state: LlamaState, namespace: str) -> None:
        """Store a transformer state as its chain head and the chunks the index does not hold yet.

        Only missing chunks are written (before the commit, like any payload). Should another
        process free a chunk this store counted on before it commits, the store starts over once.
        """
        for attempt in range(2):
            try:
                with self._lock:
                    self._sync()
                    chain = chunked.plan(self, state, namespace)
            except sqlite3.Error as error:
                with self._lock:
                    self._write_errors += 1
                    self._store_errors += 1
                logger.warning("disk cache: index unavailable (%s); state not cached", error)
                return
            head = encode_head(state, chain.chunk_tokens)
            raw_size = encoded_size(head)
            name = chunked.new_name()
            try:
                chunked.write_chunks(self, state, namespace, chain)
                size = self._data.write(name, head, self.compress, self.fsync)
            except OSError as error:
                chunked.discard(self, chain)
                self._write_failed(error, raw_size + sum(piece.n_tokens for piece in chain.todo))
                return
            row = (KIND_CHUNKED, 1, int(state.logits is not None), state.n_tokens)
            if self._commit(namespace, tokens, name, size, raw_size, row, chain) or attempt:
                return

    def _commit(
        self, namespace: str, tokens: npt.NDArray[np.int32], name: str, size: int, raw_size: int,
        row: tuple[int, int, int, int], chain: chunked.ChainPlan | None = None,
    ) -> bool:
        """Commit a written payload (and chunks): replace the same key, evict LRU entries, then unlink
        the files nothing names any more.

        Returns:
            False when a chunk ``chain`` counted on is gone (nothing committed, the files written are
            removed: plan again), else True (committed, rejected or failed and logged).
        """
        blob = _key_blob(tokens)
        now = time.time()
        unused: list[str] = []  # files written by this store that another store's rows made redundant
        freed: list[tuple[str, int]] = []
        with self._lock:
            try:
                conn = self._connection()
                with _transaction(conn):
                    self._sync(force=True)  # under the write lock: the local view equals the index
                    unlinked: set[bytes] = set()
                    if chain is not None:
                        for chunk in chain.written:
                            if chunkstore.insert(conn, chunk):
                                unlinked |= chunkstore.absorb(conn, chunk)
                            else:
                                unused.append(chunk.file)
                        if len(chunkstore.present(conn, chain.ids)) != len(set(chain.ids)):
                            raise _ChunkGone
                    old = self._view.exact(namespace, tokens)
                    # A replaced entry's hit count carries over: the same prompt is re-stored after
                    # each completion that hit it.
                    hits = 0
                    if old is not None:
                        found = conn.execute("SELECT hits FROM entries WHERE id = ?", (old.id,)).fetchone()
                        hits = found[0] if found is not None and _is_int(found[0]) and found[0] >= 0 else 0
                    victims, linked = _delete_rows(conn, [old] if old is not None else [])
                    unlinked |= linked
                    # A malformed row holding this key (not in memory) would break UNIQUE: it goes too.
                    key_hash = _key_hash(blob)
                    for (stale,) in conn.execute(
                        "SELECT id FROM entries WHERE namespace = ? AND key_hash = ?", (namespace, key_hash)
                    ).fetchall():
                        conn.execute("INSERT INTO changes (op, entry_id) VALUES (?, ?)", (_DELETE, stale))
                        conn.execute("DELETE FROM entries WHERE id = ?", (stale,))
                        unlinked.update(r[0] for r in conn.execute("SELECT chunk FROM links WHERE entry_id = ?", (stale,)))
                        conn.execute("DELETE FROM links WHERE entry_id = ?", (stale,))
                    cursor = conn.execute(
                        "INSERT INTO entries (namespace, key, key_hash, kind, cut, logits, n_state, file, size, "
                        "raw_size, codec, created, accessed, recency, hits) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?)",
                        (namespace, blob, key_hash, *row, name, size, raw_size,
                         "raw" if self.compress is None else "zlib", now, now, hits),
                    )
                    entry_id = cursor.lastrowid
                    assert entry_id is not None  # set by every INSERT
                    # Links left under this id by a damaged index (ids are not reused otherwise) go.
                    unlinked.update(r[0] for r in conn.execute("SELECT chunk FROM links WHERE entry_id = ?", (entry_id,)))
                    conn.execute("DELETE FROM links WHERE entry_id = ?", (entry_id,))
                    if chain is not None:
                        chunkstore.link(conn, entry_id, chain.ids)
                    freed += chunkstore.release(conn, unlinked)
                    # Evict least recently used entries until the unique bytes fit.
                    total = self._view.bytes - (old.size if old is not None else 0) + size
                    total += chunkstore.stored_bytes(conn)
                    evicted = 0
                    for victim_id in self._view.lru:
                        if total <= self.capacity_bytes:
                            break
                        entry = self._view.entries[victim_id]
                        if entry is old:
                            continue
                        gone, linked = _delete_rows(conn, [entry])
                        released = chunkstore.release(conn, linked)
                        freed += released
                        victims += gone
                        total -= entry.size + sum(nbytes for _, nbytes in released)
                        evicted += 1
                    if total > self.capacity_bytes:
                        raise _TooBig
                    seq = conn.execute(
                        "INSERT INTO changes (op, entry_id) VALUES (?, ?)", (_ADD, entry_id)
                    ).lastrowid
                    assert seq is not None
                    conn.execute("UPDATE entries SET recency = ? WHERE id = ?", (seq, entry_id))
                    _maybe_trim(conn, seq)
            except (_ChunkGone, _TooBig, sqlite3.Error) as error:
                self._data.unlink(name)
                if chain is not None:
                    chunked.discard(self, chain)
                if isinstance(error, _ChunkGone):
                    return False
                if isinstance(error, _TooBig):
                    self._reject(namespace, tokens, size + (chain.written_bytes if chain is not None else 0))
                    return True
                self._write_errors += 1
                self._store_errors += 1
                logger.warning("disk cache: could not commit a state (%s); not cached", error)
                return True
            self._evictions += evicted
            self._writes += 1
            self._sync_or_log(force=True)  # committed; on failure the next operation catches up
        # Only now that no committed row names them.
        for file in [victim.file for victim in victims] + [file for file, _ in freed] + unused:
            self._data.unlink(file)
        return True

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
            old = self._view.exact(namespace, tokens)
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
                deleted, linked = _delete_rows(conn, victims)
                freed = chunkstore.release(conn, linked)
        except sqlite3.Error as error:
            logger.warning("disk cache: could not delete %d entries: %s", len(victims), error)
            return []
        self._sync_or_log(force=True)
        for file in [victim.file for victim in deleted] + [file for file, _ in freed]:
            self._data.unlink(file)
        return deleted

    # ---------------------------------------------------------------------------------- fork hooks

    def _drain(self) -> None:
        self._wait_for_writes()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.cache_dir)!r}, capacity_bytes={self.capacity_bytes})"
