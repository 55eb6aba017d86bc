"""The disk tier's write path: encode, write new files, commit with eviction, unlink what is freed.

:func:`store_state` stores one state into a :class:`~.store.DiskStore` under a byte ``capacity``: a
state already held with the same tokens is only touched; otherwise its payload (or its chain head and
the chunks the index does not hold yet, :mod:`.chunked`) goes to new files, then :func:`_commit`
replaces the same key, links the chunks and frees those nothing links, records the sizes of the
folders it wrote into and evicts least recently used entries until the directory fits (as
:mod:`.budget` counts it: files in whole blocks, the index, the folders), in one transaction, and
unlinks the files nothing names only after it (the package docstring's write protocol), removing the
folders that leaves empty. A state that does not fit the whole capacity is rejected (counted), and the
entry it would replace dropped.

Functions here hold no state; they take the store's lock around each index step.
"""

from __future__ import annotations

import errno
import logging
import sqlite3
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from llama_cache.caches.disk import budget, chunked, chunkstore
from llama_cache.caches.disk.payloads import new_name
from llama_cache.caches.disk.rows import Entry, is_int, key_blob, key_hash, state_cap
from llama_cache.caches.disk.schema import ADD, DELETE, delete_rows, maybe_trim
from llama_cache.caches.disk.store import DiskStore
from llama_cache.state.chunks import KIND_CHUNKED, encode_head
from llama_cache.state.format import KIND_UPSTREAM, encode, encode_upstream, encoded_size
from llama_cache.state.llama_state import LlamaState
from llama_cache.state.values import can_be_cut

logger = logging.getLogger("llama_cache.caches.disk")  # one logger for the whole disk tier


class _ChunkGone(Exception):
    """A chunk a store counted on was freed by another process before the store committed."""


class _TooBig(Exception):
    """A new entry does not fit the capacity even with every other entry evicted."""


def store_state(
    store: DiskStore, capacity: int, tokens: npt.NDArray[np.int32], value: Any, namespace: str, kind: int
) -> None:
    """Write one state's payload (or chain head and chunks), then commit it within ``capacity`` bytes.

    Runs in the writer thread or the caller's, without the lock (taken around each index step).
    Never raises for the value or the directory: failures are logged and counted.
    """
    n_state = int(value.n_tokens)

    def has_logits() -> bool:  # a scan of the scores for llama-cpp-python's states: only when needed
        if kind == KIND_UPSTREAM:
            return bool(np.any(np.asarray(value.scores)))
        return value.logits is not None

    # A store that would only rewrite what is there touches the entry instead (decided in memory, from
    # the view as last synced: should another process have replaced or removed the entry since, the
    # touch finds nothing and the state is stored; should it have stored the same state, the commit
    # replaces it, as it syncs under the write lock).
    try:
        with store.lock:
            old = store.view.exact(namespace, tokens)
            if old is not None and old.kind == kind and old.n_state == n_state and (old.logits or not has_logits()):
                if store.touch(old.id, hit=False):
                    return
    except sqlite3.Error as error:
        with store.lock:
            store.counters.write_errors += 1
            store.counters.store_errors += 1
        logger.warning("disk cache: index unavailable (%s); state not cached", error)
        return
    if kind == KIND_CHUNKED:
        _store_chunked(store, capacity, tokens, value, namespace)
        return
    try:
        parts = encode_upstream(value, namespace) if kind == KIND_UPSTREAM else encode(value)
    except (TypeError, ValueError, AttributeError) as error:
        with store.lock:
            store.counters.store_errors += 1
        logger.warning("disk cache: not caching a %s: %s", type(value).__name__, error)
        return
    raw_size = encoded_size(parts)
    cut = kind == KIND_UPSTREAM or can_be_cut(value)
    if raw_size > state_cap(len(tokens)):
        with store.lock:
            store.counters.store_errors += 1
        logger.warning(
            "disk cache: not caching a %d-byte state for %d tokens: above the %d bytes any reader accepts",
            raw_size, len(tokens), state_cap(len(tokens)),
        )
        return
    if store.compress is None and raw_size > capacity:
        _reject(store, capacity, namespace, tokens, raw_size)
        return
    name = new_name(store.shards)
    try:
        size = store.data.write(name, parts, store.compress, store.fsync)
    except OSError as error:
        _write_failed(store, error, raw_size)
        return
    if size > capacity:
        store.remove_files([name])
        _reject(store, capacity, namespace, tokens, size)
        return
    row = (kind, int(cut), int(has_logits()), n_state)
    _commit(store, capacity, namespace, tokens, name, size, raw_size, row)


def _write_failed(store: DiskStore, error: OSError, nbytes: int) -> None:
    with store.lock:
        store.counters.write_errors += 1
        store.counters.store_errors += 1
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        logger.warning("disk cache: no space left for a %d-byte state; not cached", nbytes)
    else:
        logger.warning("disk cache: could not write a state (%s); not cached", error)


def _store_chunked(
    store: DiskStore, capacity: int, tokens: npt.NDArray[np.int32], state: LlamaState, namespace: str
) -> None:
    """Store a transformer state as its chain head and the chunks the index does not hold yet.

    Only missing chunks are written (before the commit, like any payload). Should another
    process free a chunk this store counted on before it commits, the store starts over once.
    """
    for attempt in range(2):
        try:
            with store.lock:
                store.sync()
                chain = chunked.plan(store, state, namespace)
        except sqlite3.Error as error:
            with store.lock:
                store.counters.write_errors += 1
                store.counters.store_errors += 1
            logger.warning("disk cache: index unavailable (%s); state not cached", error)
            return
        head = encode_head(state, chain.chunk_tokens)
        raw_size = encoded_size(head)
        name = new_name(store.shards)
        try:
            chunked.write_chunks(store, state, namespace, chain)
            size = store.data.write(name, head, store.compress, store.fsync)
        except OSError as error:
            chunked.discard(store, chain)
            _write_failed(store, error, raw_size + sum(piece.n_tokens for piece in chain.todo))
            return
        row = (KIND_CHUNKED, 1, int(state.logits is not None), state.n_tokens)
        if _commit(store, capacity, namespace, tokens, name, size, raw_size, row, chain) or attempt:
            return


def _commit(
    store: DiskStore, capacity: int, namespace: str, tokens: npt.NDArray[np.int32], name: str, size: int, raw_size: int,
    row: tuple[int, int, int, int], chain: chunked.ChainPlan | None = None,
) -> bool:
    """Commit a written payload (and chunks): replace the same key, evict LRU entries until the
    directory fits ``capacity``, then unlink the files nothing names any more.

    One ``BEGIN IMMEDIATE`` transaction. A whole-state store that replaces nothing and evicts nothing
    (the common case) costs six statements: the transaction's two, ``PRAGMA data_version`` (the view
    is in step unless another process committed meanwhile; then its changes are replayed), the
    ``entries`` and ``changes`` rows, and ``PRAGMA page_count`` for the budget; the view takes the new
    entry in memory after the commit (:meth:`.store.DiskStore.added`). The folders' sizes are
    measured (a ``stat`` each) and written only when one changed. Replacing, evicting, chunks and
    repairs add the statements they need, and a replay of the log after the commit.

    Returns:
        False when a chunk ``chain`` counted on is gone (nothing committed, the files written are
        removed: plan again), else True (committed, rejected or failed and logged).
    """
    blob = key_blob(tokens)
    now = time.time()
    codec = "raw" if store.compress is None else "zlib"
    unused: list[str] = []  # files written by this store that another store's rows made redundant
    freed: list[tuple[str, int]] = []
    with store.lock:
        try:
            with store.transaction(keeps_bound=True) as conn:
                store.sync()  # under the write lock: the local view equals the index
                unlinked: set[bytes] = set()
                if chain is not None:
                    for chunk in chain.written:
                        if chunkstore.insert(conn, chunk):
                            unlinked |= chunkstore.absorb(conn, chunk)
                        else:
                            unused.append(chunk.file)
                    if len(chunkstore.present(conn, chain.ids)) != len(set(chain.ids)):
                        raise _ChunkGone
                old = store.view.exact(namespace, tokens)
                # A replaced entry's hit count carries over: the same prompt is re-stored after
                # each completion that hit it.
                hits = 0
                if old is not None:
                    found = conn.execute("SELECT hits FROM entries WHERE id = ?", (old.id,)).fetchone()
                    hits = found[0] if found is not None and is_int(found[0]) and found[0] >= 0 else 0
                victims, linked = delete_rows(conn, [old] if old is not None else [])
                unlinked |= linked
                values = (namespace, blob, key_hash(blob), *row, name, size, raw_size, codec, now, now, hits)
                try:
                    entry_id = _insert_entry(conn, values)
                    repaired = False
                except sqlite3.IntegrityError:
                    # A malformed row holding this key (not in memory) breaks UNIQUE: it goes too.
                    unlinked |= _delete_stale(conn, namespace, values[2])
                    entry_id = _insert_entry(conn, values)
                    repaired = True
                if chain is not None:
                    # Links left under this id by a damaged index (ids are not reused otherwise) go.
                    unlinked.update(r[0] for r in conn.execute("SELECT chunk FROM links WHERE entry_id = ?", (entry_id,)))
                    conn.execute("DELETE FROM links WHERE entry_id = ?", (entry_id,))
                    chunkstore.link(conn, entry_id, chain.ids)
                freed += chunkstore.release(conn, unlinked)
                # The change log's row takes the seq the entry's recency was given (both the next one).
                seq = conn.execute(
                    "INSERT INTO changes (seq, op, entry_id) VALUES ((SELECT recency FROM entries WHERE id = ?), ?, ?)",
                    (entry_id, ADD, entry_id),
                ).lastrowid
                assert seq is not None
                store.view.floor = maybe_trim(conn, seq, store.view.floor)
                # The folders this store wrote into, as they are now (they may have grown).
                files_written = [name] + ([chunk.file for chunk in chain.written] if chain is not None else [])
                written = {file.partition("/")[0] for file in files_written}
                sizes = store.data.folder_sizes(written)
                store.record_folders(conn, sizes, gone=written - sizes.keys())
                # Evict least recently used entries until the directory fits.
                block = store.block
                chunk_charge = chunkstore.stored_bytes(conn, block)[1] if chain is not None or freed else store.chunk_charged
                files = store.view.charged - (budget.charge(old.size, block) if old is not None else 0)
                files += budget.charge(size, block) + chunk_charge
                # Far from the budget, a whole-state store needs no page count (see budget.growth_bound).
                grown = budget.growth_bound(len(blob), store.page_size(conn)) if chain is None else None
                gone, released, fits = budget.evict_to_fit(
                    store, conn, capacity, files, {old.id} if old is not None else set(), grown
                )
                if not fits:
                    raise _TooBig
                victims += gone
                freed += released
                evicted = len(gone)
        except (_ChunkGone, _TooBig, sqlite3.Error) as error:  # rolled back (and the view marked stale)
            store.remove_files([name])
            if chain is not None:
                chunked.discard(store, chain)
            if isinstance(error, _ChunkGone):
                return False
            if isinstance(error, _TooBig):
                _reject(store, capacity, namespace, tokens, size + (chain.written_bytes if chain is not None else 0))
                return True
            store.counters.write_errors += 1
            store.counters.store_errors += 1
            logger.warning("disk cache: could not commit a state (%s); not cached", error)
            return True
        store.counters.evictions += evicted
        store.counters.writes += 1
        if chain is None and not victims and not freed and not repaired:
            kind, cut, logits, n_state = row
            entry = Entry(entry_id, namespace, size, raw_size, name, codec, seq, kind, bool(cut), bool(logits),
                          n_state, len(tokens))
            store.added(entry, tokens)
        else:
            store.sync_or_log(force=True)  # committed; on failure the next operation catches up
    # Only now that no committed row names them.
    store.remove_files([victim.file for victim in victims] + [file for file, _ in freed] + unused)
    return True


def _insert_entry(conn: sqlite3.Connection, values: tuple[Any, ...]) -> int:
    """Insert an entry's row, its recency the seq its change-log row will take (the next one, as
    ``AUTOINCREMENT`` would choose it: past both the largest seq ever used and the largest present).

    Raises:
        sqlite3.IntegrityError: a row with the same namespace and key exists.
    """
    cursor = conn.execute(
        "INSERT INTO entries (namespace, key, key_hash, kind, cut, logits, n_state, file, size, raw_size, codec, "
        "created, accessed, hits, recency) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, "
        "max(COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'changes'), 0), "
        "COALESCE((SELECT max(seq) FROM changes), 0)) + 1)",
        values,
    )
    entry_id = cursor.lastrowid
    assert entry_id is not None  # set by every INSERT
    return entry_id


def _delete_stale(conn: sqlite3.Connection, namespace: str, digest: bytes) -> set[bytes]:
    """Delete the rows holding a key that the view does not hold (malformed ones), logging the deletes.

    Returns:
        The chunks they linked (to release).
    """
    unlinked: set[bytes] = set()
    for (stale,) in conn.execute(
        "SELECT id FROM entries WHERE namespace = ? AND key_hash = ?", (namespace, digest)
    ).fetchall():
        conn.execute("INSERT INTO changes (op, entry_id) VALUES (?, ?)", (DELETE, stale))
        conn.execute("DELETE FROM entries WHERE id = ?", (stale,))
        unlinked.update(r[0] for r in conn.execute("SELECT chunk FROM links WHERE entry_id = ?", (stale,)))
        conn.execute("DELETE FROM links WHERE entry_id = ?", (stale,))
    return unlinked


def _reject(store: DiskStore, capacity: int, namespace: str, tokens: npt.NDArray[np.int32], size: int) -> None:
    logger.info(
        "disk cache: not caching a %d-byte state: larger than the whole capacity (%d bytes)",
        size,
        capacity,
    )
    with store.lock:
        store.counters.rejected += 1
        try:
            store.sync()
        except sqlite3.Error as error:
            logger.warning("disk cache: index unavailable (%s)", error)
            return
        old = store.view.exact(namespace, tokens)
        if old is not None:
            store.delete([old])
