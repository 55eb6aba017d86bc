"""LlamaDiskCache: the disk tier's façade over its store, its write path and its write-behind queue.

It owns the public face: argument checking, the namespaces (``bind``, filing of states), the mapping
protocol (lookups, stores, deletes, listings), statistics, maintenance (``check``, ``storage``, ``close``)
and the fork and exit hooks. What the operations share lives in a :class:`~.store.DiskStore` (the lock,
the connection, the in-memory view, payload reads, deletes, the counters); the write path is
:mod:`.writes`; the checker and the chunk code take the store, never this class. See the package
docstring for the protocols.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sqlite3
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import numpy.typing as npt

from llama_cache.caches import lifecycle
from llama_cache.caches.base import DEFAULT_CAPACITY_BYTES, BaseLlamaCache, CacheStats
from llama_cache.caches.disk import budget, checker, reads, writes
from llama_cache.caches.disk.chunkstore import BrokenChain
from llama_cache.caches.disk.checker import CheckReport, StorageReport
from llama_cache.caches.disk.payloads import compress_level, Unreadable
from llama_cache.caches.disk.rows import (
    MAX_KEY_TOKENS,
    MAX_NAMESPACE,
    DiskEntry,
    as_float,
    BadRow,
    check_fingerprint,
    check_model_info,
    is_int,
    model_info_from_row,
)
from llama_cache.caches.disk.store import DiskStore
from llama_cache.caches.write_behind import WriteBehindQueue
from llama_cache.state.chunks import KIND_CHUNKED, MAX_CHUNK_FILE_TOKENS
from llama_cache.state.fingerprint import model_description, model_fingerprint
from llama_cache.state.format import KIND_LLAMA_CACHE, KIND_UPSTREAM
from llama_cache.state.llama_state import LlamaState
from llama_cache.state.values import filing_key, state_tokens
from llama_cache.tokens import CheckedTokens, as_token_array, checked_tokens

logger = logging.getLogger("llama_cache.caches.disk")  # one logger for the whole disk tier

UNBOUND_NAMESPACE = "llama-cpp-python"
"""The namespace of llama-cpp-python states stored without a fingerprint into an unbound cache."""
ORPHAN_GRACE_SECONDS = 600.0
"""Orphan payload files older than this are removed when a cache opens the directory."""
_KIND_NAMES = {KIND_LLAMA_CACHE: "llama_cache", KIND_UPSTREAM: "llama_cpp", KIND_CHUNKED: "chunked"}
_LOAD_ATTEMPTS = 8  # entries tried by one lookup before it gives up (each failure removes one)


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

    ``capacity_bytes`` bounds what the whole directory takes on disk as ``du -s`` counts it
    (:attr:`disk_usage`): the payload, head and chunk files in whole blocks (each once however many
    entries share it), the SQLite index and the folders; it holds whenever no store is in progress
    (see :mod:`~llama_cache.caches.disk.budget` for what a store in progress adds). ``cache_size`` is
    the files' share of it. Storing evicts least recently used entries until the directory fits;
    evicting an entry frees the chunks no other entry links, and a shard folder goes with its last
    file. A state that does not fit the whole capacity is not stored (``stats().rejected``). The LRU
    order and the capacity are shared by every process using the directory (each evicts with the
    ``capacity_bytes`` it was given: give them the same). ``len``, ``cache_size`` and ``stats().entries`` cover every
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
        capacity_bytes: the byte budget of the whole directory on disk (default 2 GiB), at least
            :meth:`minimum_capacity` (what an empty cache takes: 76 KiB with 4 KiB blocks).
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
        timeout: seconds (finite, > 0) to wait for another process using the index (the directory's lock).
        chunk_tokens: tokens per KV chunk (None: by the model's KV bytes per token,
            :func:`~llama_cache.state.chunks.default_chunk_tokens`, 16 for the default model), or 0
            to store every state whole, one payload file each (nothing shared: the fastest store
            and hit when entries share no prefixes). Processes sharing a directory should use the
            same value: chains of different lengths share no chunks (they are never confused either).

    Raises:
        TypeError, ValueError: a bad argument (``capacity_bytes`` below :meth:`minimum_capacity` included).
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
        level = compress_level(compress)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(f"timeout must be a number of seconds, got {type(timeout).__name__}")
        if not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(f"timeout must be finite and positive, got {timeout!r}")
        check_fingerprint(fingerprint)
        if chunk_tokens is not None:
            if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool):
                raise TypeError(f"chunk_tokens must be an int or None, got {type(chunk_tokens).__name__}")
            if not 0 <= chunk_tokens <= MAX_CHUNK_FILE_TOKENS:
                raise ValueError(f"chunk_tokens must be in 0..{MAX_CHUNK_FILE_TOKENS}, got {chunk_tokens}")
        block = budget.block_size(Path(directory))
        floor = budget.minimum_capacity(block)
        if self.capacity_bytes < floor:
            raise ValueError(
                f"capacity_bytes must be at least {floor} here, got {self.capacity_bytes}: an empty disk cache "
                f"takes that much on this file system (its index and folders, in blocks of {block} bytes)"
            )
        self.cache_dir = Path(directory)
        self.verbose = verbose
        self.write_behind = bool(write_behind)
        self.max_pending = max_pending
        self.timeout = float(timeout)
        self._namespace = fingerprint
        self._store = DiskStore(self.cache_dir, timeout=self.timeout, fsync=bool(fsync), compress=level,
                                verify=bool(verify), chunk_tokens=chunk_tokens, capacity=self.capacity_bytes,
                                block=block)
        self._lock = self._store.lock
        self._counters = self._store.counters
        # Write-behind queue of (key, value, namespace, kind).
        self._pending = WriteBehindQueue(lambda item: self._write(*item), self._store_failed,
                                         thread_name="llama-cache-disk-writer")
        with self._lock:
            self._store.open()  # fail early on an unusable directory
        checker.reclaim_orphans(self._store, ORPHAN_GRACE_SECONDS)
        lifecycle.register(self, stage=lifecycle.BACK)

    @staticmethod
    def minimum_capacity(cache_dir: str | os.PathLike[str] = ".") -> int:
        """The smallest ``capacity_bytes`` a cache in ``cache_dir`` accepts: what an empty cache takes on
        its file system (an empty index, the cache folder, ``data/`` and one shard folder, each in
        whole blocks). Reads the file system's block size; creates nothing."""
        return budget.minimum_capacity(budget.block_size(Path(os.fspath(cache_dir))))

    # The storage settings live in the store, which the write path and the readers share.

    @property
    def fsync(self) -> bool:
        """``fsync`` payloads and commit the index with ``synchronous=FULL`` (see the class docstring)."""
        return self._store.fsync

    @property
    def compress(self) -> int | None:
        """The zlib level new payloads are compressed with, or None."""
        return self._store.compress

    @property
    def verify(self) -> bool:
        """Check payloads' checksums when reading them (may be changed at any time)."""
        return self._store.verify

    @verify.setter
    def verify(self, verify: bool) -> None:
        self._store.verify = bool(verify)

    @property
    def chunk_tokens(self) -> int | None:
        """Tokens per KV chunk (None: by the model; 0: states stored whole)."""
        return self._store.chunk_tokens

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
        check_fingerprint(fingerprint)
        info = check_model_info(model_info) if model_info is not None else None
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
            conn = self._store.connection()
            row = conn.execute("SELECT info FROM models WHERE fingerprint = ?", (fingerprint,)).fetchone()
            if row is not None and row[0] == text:
                return
            with self._store.transaction() as conn:
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
                rows = self._store.connection().execute("SELECT rowid, fingerprint, info FROM models").fetchall()
        except sqlite3.Error as error:
            logger.warning("disk cache: index unavailable (%s)", error)
            return out
        for rowid, fingerprint, info in rows:
            try:
                out[fingerprint] = model_info_from_row(fingerprint, info)
            except BadRow as problem:
                self._store.log_bad_row("models", rowid, str(problem))
        return out

    # --------------------------------------------------------------------------------- the mapping

    @property
    def cache_size(self) -> int:
        """Bytes the payload, head and chunk files of the directory take on disk, each once and in whole
        blocks of the file system (after pending writes). The index and the folders are not included:
        :attr:`disk_usage` is the total ``capacity_bytes`` bounds."""
        self._wait_for_writes()
        with self._lock:
            self._store.sync_or_log()
            return self._store.view.charged + self._store.chunk_charged

    @property
    def disk_usage(self) -> int:
        """What the directory takes on disk as the budget counts it (after pending writes): ``cache_size``
        plus the index file and the folders, as ``du -s`` would report them (see
        :mod:`~llama_cache.caches.disk.budget` for what it cannot see). At most ``capacity_bytes``.
        Costs a few queries and two ``stat`` calls; 0 when the index is unavailable (logged)."""
        self._wait_for_writes()
        try:
            with self._lock:
                return self._store.usage()
        except sqlite3.Error as error:
            logger.warning("disk cache: index unavailable (%s)", error)
            return 0

    def __len__(self) -> int:
        self._wait_for_writes()
        with self._lock:
            self._store.sync_or_log()
            return len(self._store.view.entries)

    def __contains__(self, key: Sequence[int]) -> bool:  # type: ignore[override]
        """Whether an entry would answer ``key``; touches neither recency nor counters.

        The payload is not read: ``cache[key]`` can still miss if it turns out to be damaged.
        """
        query = checked_tokens(key)
        self._wait_for_writes()
        try:
            with self._lock:
                self._store.sync()
                return self._store.view.best(query, self._namespace) is not None
        except Exception as error:  # noqa: BLE001 - a damaged index is a "no", never an error
            logger.warning("disk cache: index unavailable (%s); answering no", error)
            return False

    def match_length(self, key: Sequence[int], *, namespace: str | None = None) -> int:
        """Leading tokens of ``key`` the state ``lookup_prefix(key)`` would restore, 0 on a miss: the
        common prefix with the best entry's key (a whole key for states that cannot be cut). From the
        in-memory index, O(K) per namespace searched; no payload read, no recency change.

        Raises:
            TypeError, ValueError: ``key`` is not a sequence of token ids.
        """
        query = checked_tokens(key)
        self._wait_for_writes()
        try:
            with self._lock:
                self._store.sync()
                match = self._store.view.best(query, namespace or self._namespace)
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

    def lookup_prefix(self, key: Sequence[int], *, namespace: str | None = None) -> Any:
        """Like ``cache[key]``, reading only what ``key`` shares with the entry: the chunk-granular path.

        The same entry answers as for ``cache[key]``. When it diverges from ``key`` (or runs past its
        end), the state returned holds only the common prefix, without logits, and only the chunks
        covering that prefix are read: a prompt sharing 1,000 tokens with a 5,000-token entry reads
        1,000 tokens' KV. Otherwise the whole state comes back, as from ``cache[key]``.
        ``llama_cache.Llama`` looks up through this method. ``namespace``: answer from the states filed
        under that fingerprint (see :meth:`BaseLlamaCache.lookup_prefix`); None: the bound one.

        Raises:
            KeyError: as ``cache[key]``.
            TypeError, ValueError: ``key`` is not a sequence of token ids.
        """
        return self._answer(key, shared_only=True, namespace=namespace)

    def _answer(self, key: Sequence[int], shared_only: bool, namespace: str | None = None) -> Any:
        query = checked_tokens(key)
        self._wait_for_writes()
        try:
            state = self._lookup(query, shared_only, namespace or self._namespace)
        except Exception as error:  # noqa: BLE001 - whatever the directory holds, a lookup only misses
            logger.warning("disk cache: index unavailable or damaged (%s: %s); a miss", type(error).__name__, error)
            state = None
        if state is None:
            with self._lock:
                self._counters.misses += 1
            raise KeyError("no cached prefix for this key")
        return state

    def _lookup(self, query: CheckedTokens, shared_only: bool, namespace: str | None) -> Any:
        for _ in range(_LOAD_ATTEMPTS):
            with self._lock:
                self._store.sync()
                match = self._store.view.best(query, namespace)
            if match is None:
                return None
            entry = match.value
            upto = match.common if shared_only and entry.cut and match.common < entry.n_state else None
            try:
                state = reads.load(self._store, entry, np.asarray(match.key, dtype=np.int32), upto)
            except Unreadable as problem:
                self._store.forget_unreadable(entry, problem)
                continue
            except BrokenChain as broken:
                self._store.forget_broken_chunk(entry, broken)
                continue
            with self._lock:
                self._store.touch(entry.id)
                self._counters.hits += 1
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
                self._counters.store_errors += 1
            logger.warning("disk cache: not caching a %s: %s", type(value).__name__, error)
            return
        if self.write_behind:
            self._enqueue(filed, value, namespace, kind)
        else:
            self._write(filed, value, namespace, kind)

    def _classify(self, tokens: npt.NDArray[np.int32], value: Any) -> tuple[int, str, npt.NDArray[np.int32]]:
        """The kind, namespace and filing key of a value to store.

        Raises:
            TypeError, ValueError: the value cannot be stored.
        """
        if isinstance(value, LlamaState):
            kind = KIND_LLAMA_CACHE if value.layout is None or self.chunk_tokens == 0 else KIND_CHUNKED
            namespace = value.fingerprint
            if not isinstance(namespace, str) or not 0 < len(namespace) <= MAX_NAMESPACE:
                raise ValueError("the state has no fingerprint")
        elif isinstance(value, llama_cpp.llama.LlamaState):
            kind = KIND_UPSTREAM
            own = getattr(value, "fingerprint", None)
            if isinstance(own, str) and own:
                namespace = own
            else:
                namespace = self._namespace if self._namespace is not None else UNBOUND_NAMESPACE
            if len(namespace) > MAX_NAMESPACE:
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
        if len(held) > MAX_KEY_TOKENS:
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
            self._store.sync()
            victims = [
                entry
                for (namespace, _), index in self._store.view.indexes.items()
                if self._namespace in (None, namespace) and (entry := index.get(tokens)) is not None
            ]
            if not victims:
                raise KeyError("no state stored under exactly this key")
            self._store.delete(victims)

    def keys(self) -> Iterator[tuple[int, ...]]:
        """Stored keys of the bound namespace (all when unbound), least recently used first (a snapshot)."""
        self._wait_for_writes()
        with self._lock:
            rows = self._store.valid_rows()
        return iter([tuple(tokens.tolist()) for entry, tokens, _ in rows if self._namespace in (None, entry.namespace)])

    def entries(self) -> list[DiskEntry]:
        """Every valid entry of the directory (all namespaces), least recently used first."""
        self._wait_for_writes()
        with self._lock:
            rows = self._store.valid_rows()
        out = []
        for entry, _, (created, accessed, hits) in rows:
            out.append(
                DiskEntry(
                    entry.id, entry.namespace, entry.n_key, entry.size, entry.raw_size, entry.codec, entry.file,
                    as_float(created), as_float(accessed), hits if is_int(hits) else 0,
                    _KIND_NAMES[entry.kind], entry.cut,
                )
            )
        return out

    def clear(self) -> None:
        """Remove every entry of the directory (all namespaces). Counters are kept."""
        self._wait_for_writes()
        with self._lock:
            self._store.sync()
            self._store.delete([self._store.view.entries[i] for i in self._store.view.lru])

    def stats(self) -> CacheStats:
        """This instance's counters; the directory's entries and bytes."""
        self._wait_for_writes()
        with self._lock:
            self._store.sync_or_log()
            return CacheStats(
                hits=self._counters.hits,
                misses=self._counters.misses,
                entries=len(self._store.view.entries),
                bytes=self._store.view.charged + self._store.chunk_charged,
                capacity_bytes=self.capacity_bytes,
                evictions=self._counters.evictions,
                rejected=self._counters.rejected,
                writes=self._counters.writes,
                store_errors=self._counters.store_errors,
                index_resets=self._counters.index_resets,
            )

    @property
    def write_errors(self) -> int:
        """States this instance failed to store because of an I/O or index error (logged)."""
        return self._counters.write_errors

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
            self._store.close()

    def __enter__(self) -> LlamaDiskCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def storage(self) -> StorageReport:
        """Unique bytes on disk against logical bytes (every entry stored whole): what chunks save.

        Raises:
            sqlite3.Error: the index is unavailable.
        """
        self._wait_for_writes()
        return checker.storage(self._store)

    def check(self, fix: bool = False, *, deep: bool = False, grace_seconds: float = 60.0) -> CheckReport:
        """Reconcile the index with the payload files.

        Finds malformed rows (see the module docstring), orphan files (named by no entry), entries whose
        file is missing, is not a regular file or has another length than recorded, empty shard
        folders, and with ``deep`` entries whose payload does not decode (reads every file); measures
        what the directory takes as ``du`` counts it (a walk of the directory) next to what the budget
        counts. With ``fix`` the bad entries and malformed rows are deleted (through the change log,
        so other processes follow), orphan files older than ``grace_seconds`` are unlinked (younger
        ones may belong to a write in progress in another process), empty folders are removed and the
        folders' sizes measured again. Never raises for what the directory holds; an unavailable index
        is logged and reported as ``index_ok=False``.

        Returns:
            A :class:`CheckReport` of what was found (and removed).
        """
        self._wait_for_writes()
        return checker.check(self._store, fix, deep, grace_seconds)

    # ----------------------------------------------------------------------------------- writing

    def _write(self, tokens: npt.NDArray[np.int32], value: Any, namespace: str, kind: int) -> None:
        writes.store_state(self._store, self.capacity_bytes, tokens, value, namespace, kind)

    def _enqueue(self, tokens: npt.NDArray[np.int32], value: Any, namespace: str, kind: int) -> None:
        self._pending.put((tokens, value, namespace, kind), self.max_pending)

    def _wait_for_writes(self) -> None:
        if not self.write_behind and not len(self._pending):
            return
        self._pending.wait()

    def _store_failed(self) -> None:
        """Count a store that raised unexpectedly (the write queue logs it)."""
        with self._lock:
            self._counters.write_errors += 1
            self._counters.store_errors += 1

    # ---------------------------------------------------------------------------------- fork hooks

    @property
    def fork_lock(self) -> lifecycle.Lock:
        """The store's lock, which every operation takes, held across a fork (see
        :class:`~llama_cache.caches.lifecycle.HeldAcrossFork`)."""
        return self._lock

    def drain(self) -> None:
        """Wait until every state queued before this call is written and committed (as :meth:`flush`).
        Thread-safe."""
        self._wait_for_writes()

    def reset_after_fork(self) -> None:
        """In a forked child: drop everything tied to the parent's process (never touch its SQLite)."""
        super().reset_after_fork()
        self._store.reset_after_fork()
        self._pending.reset_after_fork()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.cache_dir)!r}, capacity_bytes={self.capacity_bytes})"
