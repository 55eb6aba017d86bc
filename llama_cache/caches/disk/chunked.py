"""Chunked entries of the disk tier: writing a state as chunks, reading a chain back.

A transformer state (a llama-cache ``LlamaState`` with a KV layout) is stored as a chain head file
(tokens, logits, seed, layout: :func:`~llama_cache.state.chunks.encode_head`) and the chunks of its
KV (:func:`~llama_cache.state.chunks.pieces`). :func:`plan` finds which chunks the index already holds
(one query for the full chunks' ids; for the last, partial one, a stored chunk after the same
predecessor that extends its tokens) and :func:`write_chunks` writes only the others, each to a new
file, before anything is committed. The commit (in :mod:`.writes`) re-checks presence under the write
lock, links the entry to its chain and frees what nothing links any more.

Reading (:func:`load`) checks every link against the head: positions, predecessors, tokens, and the id
recomputed from the chunk file's tokens, so a chain assembled from what the index says can only be
the state of the head's tokens. A chunk that cannot be read raises :class:`BrokenChain`.

Functions here take the :class:`~.store.DiskStore` (its lock, connection, data folder and settings); none
holds state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from llama_cache.caches.disk import chunkstore
from llama_cache.caches.disk.chunkstore import BrokenChain, ChunkRow
from llama_cache.caches.disk.payloads import Unreadable, new_name
from llama_cache.caches.disk.rows import BadRow, Entry
from llama_cache.state.chunks import (
    Head,
    Piece,
    assemble,
    decode_chunk,
    decode_head,
    default_chunk_tokens,
    encode_chunk,
    pieces,
)
from llama_cache.state.format import CorruptStateError
from llama_cache.state.kv_layout import KVSegment
from llama_cache.state.llama_state import LlamaState

if TYPE_CHECKING:
    from llama_cache.caches.disk.store import DiskStore


@dataclass(slots=True)
class ChainPlan:
    """What storing a state as chunks needs: its chain and the chunks written for it.

    Attributes:
        chunk_tokens: the chain's chunk length.
        ids: the chain's chunk ids, in order (the last may be a stored chunk extending the state's).
        todo: pieces no stored chunk provides, to write.
        written: rows of the chunk files written (uncommitted until the entry is).
    """

    chunk_tokens: int
    ids: list[bytes]
    todo: list[Piece]
    written: list[ChunkRow] = field(default_factory=list)

    @property
    def written_bytes(self) -> int:
        return sum(chunk.size for chunk in self.written)


def plan(store: DiskStore, state: LlamaState, namespace: str) -> ChainPlan:
    """Decide which of ``state``'s chunks must be written. Lock held by the caller.

    Raises:
        sqlite3.Error: the index is unavailable.
    """
    assert state.layout is not None
    chunk_tokens = store.chunk_tokens or default_chunk_tokens(state.layout)
    chain = pieces(namespace, np.asarray(state.tokens, dtype=np.int32), chunk_tokens)
    conn = store.connection()
    have = chunkstore.present(conn, [piece.id for piece in chain])
    ids = [piece.id for piece in chain]
    todo = [piece for piece in chain if piece.id not in have]
    last = chain[-1]
    if last.n_tokens < chunk_tokens and last.id not in have:
        longer = chunkstore.extending(conn, namespace, last.prev, last.tokens)
        if longer is not None:
            ids[-1] = longer.id
            todo.remove(last)
    return ChainPlan(chunk_tokens, ids, todo)


def write_chunks(store: DiskStore, state: LlamaState, namespace: str, chain: ChainPlan) -> None:
    """Write the planned chunk files (no lock needed: new files only). On failure, remove them.

    Raises:
        OSError: a file could not be written (those written are removed).
    """
    assert state.layout is not None
    try:
        for piece in chain.todo:
            parts = encode_chunk(namespace, piece, state.layout, state.segments)
            raw_size = sum(part.nbytes for part in parts)
            name = new_name(store.shards)
            size = store.data.write(name, parts, store.compress, store.fsync)
            chain.written.append(
                ChunkRow(piece.id, namespace, piece.prev, piece.start, piece.tokens, name, size, raw_size,
                         "raw" if store.compress is None else "zlib")
            )
    except BaseException:
        discard(store, chain)
        raise


def discard(store: DiskStore, chain: ChainPlan) -> None:
    """Remove the chunk files written for a store that was not committed (and the folders that empties)."""
    store.remove_files([chunk.file for chunk in chain.written])
    chain.written.clear()


def load(store: DiskStore, entry: Entry, key: npt.NDArray[np.int32] | None, upto: int | None = None) -> LlamaState:
    """Read a chunked entry: its head, then the chunks covering its first ``upto`` tokens (all: None).

    The state holds views of private copies of the files and the head's logits only when it
    holds every token of the entry.

    Raises:
        Unreadable: the head file is missing or damaged, or does not hold what its row says.
        BrokenChain: the links or a chunk are.
    """
    buffer = store.data.read(entry.file, entry.size, entry.codec, entry.raw_size)
    try:
        head = decode_head(buffer, verify=store.verify)
    except CorruptStateError as error:
        raise Unreadable(f"corrupt chain head: {error}") from None
    n = entry.n_state
    if head.fingerprint != entry.namespace:
        raise Unreadable("chain head belongs to another model than its index entry")
    if len(head.tokens) != n or (head.logits is not None) != entry.logits:
        raise Unreadable("chain head does not hold what its index entry says")
    if key is not None and (len(key) != entry.n_key or not np.array_equal(head.tokens[: len(key)], key)):
        raise Unreadable("chain head does not hold the tokens of its key")
    upto = n if upto is None else upto
    if not 0 < upto <= n:
        raise ValueError(f"cannot read {upto} of an entry's {n} tokens")
    with store.lock:
        try:
            rows = chunkstore.chain(store.connection(), entry.id)
        except BadRow as problem:
            raise BrokenChain(None, str(problem)) from None
    return assemble(head, _segments(store, head, rows, n, upto), upto)


def _segments(store: DiskStore, head: Head, rows: list[ChunkRow], n: int, upto: int) -> list[KVSegment]:
    """The KV segments of the chunks covering ``upto`` tokens, each checked against the head."""
    size = head.chunk_tokens
    if len(rows) != -(-n // size):
        raise BrokenChain(None, f"{len(rows)} links for {n} tokens in chunks of {size}")
    segments: list[KVSegment] = []
    prev = b""
    for k in range(-(-upto // size)):
        row, start = rows[k], k * size
        expected = head.tokens[start : start + size]
        held = len(expected)
        # The last chunk may hold more tokens than the entry uses: a longer one absorbed it, maybe
        # stored by a chain of a larger chunk length.
        whole = row.n_tokens == size or (k == len(rows) - 1 and held <= row.n_tokens)
        if (
            row.namespace != head.fingerprint or row.prev != prev or row.start != start or not whole
            or not np.array_equal(row.tokens[:held], expected)
        ):
            raise BrokenChain(row.id, "chunk row does not continue the chain")
        try:
            data = store.data.read(row.file, row.size, row.codec, row.raw_size)
            tokens, segment = decode_chunk(
                data, namespace=row.namespace, ident=row.id, prev=row.prev, start=start, layout=head.layout,
                verify=store.verify,
            )
        except Unreadable as problem:
            raise BrokenChain(row.id, str(problem)) from None
        except CorruptStateError as error:
            raise BrokenChain(row.id, f"corrupt chunk: {error}") from None
        if not np.array_equal(tokens, row.tokens):
            raise BrokenChain(row.id, "chunk file holds other tokens than its row")
        segments.append(segment)
        prev = row.id
    return segments
