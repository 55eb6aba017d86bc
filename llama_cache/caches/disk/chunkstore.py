"""The chunks of the disk tier's index: rows, links (reference counts) and their SQL.

A chunked entry (``kind`` 2) is a chain head file plus one ``links`` row per chunk of its chain, in
order (``pos``). A chunk row names one chunk file (random name, like every payload: two processes
storing the same chunk never write the same file). A chunk's reference count is the number of links to
it: it is freed (row deleted in the same transaction as its last link, file unlinked after commit) by
:func:`release`. Counts derived from links cannot drift from them, whatever crashes.

A partial chunk (the last of a chain, fewer tokens than the chain's chunk length) is *absorbed* when a
chunk with the same predecessor extending its tokens is stored: the links to it move to the longer
chunk (which holds the same KV for those positions) and it is freed. Successive stores of a growing
conversation thus keep one tail per branch, not one per entry.

Rows are untrusted: :func:`chunk_from_row` validates them (raising :class:`~.rows.BadRow`). A chain that
cannot be used (a link or chunk missing, damaged, or not what the chain says) is a :class:`BrokenChain`,
raised by :mod:`.chunked` when it reads one and handled by the store. Functions taking a connection run
in the caller's transaction.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from llama_cache.caches.disk.payloads import CODECS, FILE_NAME
from llama_cache.caches.disk.rows import MAX_NAMESPACE, BadRow, is_int, key_blob, key_tokens
from llama_cache.state.chunks import ID_BYTES, MAX_CHUNK_FILE_TOKENS

CHUNK_COLUMNS = "id, namespace, prev, start, tokens, file, size, raw_size, codec"
_BASE_BYTES = 1 << 16  # a chunk file's header
_BYTES_PER_TOKEN = (4 << 20) + 4  # KV of the largest models, and the token id
_ZLIB_MAX_RATIO = 1032


@dataclass(frozen=True, slots=True)
class ChunkRow:
    """A validated ``chunks`` row."""

    id: bytes
    namespace: str
    prev: bytes
    start: int
    tokens: npt.NDArray[np.int32]
    file: str
    size: int
    raw_size: int
    codec: str

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


class BrokenChain(Exception):
    """A chunk of an entry's chain could not be used: missing, damaged, or not what the chain says.

    Attributes:
        chunk: the chunk's id (None when the links themselves are malformed).
        reason: why.
    """

    def __init__(self, chunk: bytes | None, reason: str) -> None:
        super().__init__(reason)
        self.chunk = chunk
        self.reason = reason


def chunk_from_row(row: Sequence[Any]) -> ChunkRow:
    """Validate one ``chunks`` row (columns of ``CHUNK_COLUMNS``).

    Raises:
        BadRow: anything about it is wrong.
    """
    if len(row) != 9:
        raise BadRow("wrong number of columns")
    ident, namespace, prev, start, tokens, file, size, raw_size, codec = row
    if not isinstance(ident, bytes) or len(ident) != ID_BYTES:
        raise BadRow("id is not a chunk id")
    if not isinstance(namespace, str) or not 0 < len(namespace) <= MAX_NAMESPACE:
        raise BadRow("namespace is not a short non-empty text")
    if not isinstance(prev, bytes) or len(prev) not in (0, ID_BYTES):
        raise BadRow("prev is not a chunk id")
    if not isinstance(tokens, bytes) or len(tokens) % 4 or not 0 < len(tokens) <= 4 * MAX_CHUNK_FILE_TOKENS:
        raise BadRow("tokens is not a blob of int32 tokens")
    held = key_tokens(tokens)
    if int(held.min()) < 0:
        raise BadRow("tokens holds a negative token")
    if not is_int(start) or start < 0 or (start == 0) != (prev == b""):
        raise BadRow("start does not agree with prev")
    if not isinstance(file, str) or not FILE_NAME.fullmatch(file):
        raise BadRow("file is not a payload name")
    cap = _BASE_BYTES + len(held) * _BYTES_PER_TOKEN
    if not is_int(size) or not 0 < size <= cap or not is_int(raw_size) or not 0 < raw_size <= cap:
        raise BadRow("size out of bounds")
    if not isinstance(codec, str) or codec not in CODECS:
        raise BadRow("unknown codec")
    if (codec == "raw" and raw_size != size) or (codec == "zlib" and raw_size > size * _ZLIB_MAX_RATIO + 1024):
        raise BadRow("raw_size does not agree with size")
    return ChunkRow(ident, namespace, prev, start, held, file, size, raw_size, codec)


def present(conn: sqlite3.Connection, ids: Iterable[bytes]) -> set[bytes]:
    """Which of ``ids`` have a chunk row. One query per 500 ids."""
    wanted = list(ids)
    found: set[bytes] = set()
    for at in range(0, len(wanted), 500):
        batch = wanted[at : at + 500]
        marks = ",".join("?" * len(batch))
        found.update(row[0] for row in conn.execute(f"SELECT id FROM chunks WHERE id IN ({marks})", batch))
    return found


def extending(conn: sqlite3.Connection, namespace: str, prev: bytes, tokens: npt.NDArray[np.int32]) -> ChunkRow | None:
    """A stored chunk after ``prev`` whose tokens start with ``tokens`` (the longest; None if none).

    Malformed rows are skipped. Cost: the chunks stored after ``prev`` (the branches at that point).
    """
    best: ChunkRow | None = None
    for row in conn.execute(f"SELECT {CHUNK_COLUMNS} FROM chunks WHERE namespace = ? AND prev = ?", (namespace, prev)):
        try:
            chunk = chunk_from_row(row)
        except BadRow:
            continue
        if chunk.n_tokens >= len(tokens) and np.array_equal(chunk.tokens[: len(tokens)], tokens):
            if best is None or chunk.n_tokens > best.n_tokens:
                best = chunk
    return best


def insert(conn: sqlite3.Connection, chunk: ChunkRow) -> bool:
    """Add a chunk row unless one with its id exists. Returns whether it was added."""
    cursor = conn.execute(
        f"INSERT OR IGNORE INTO chunks ({CHUNK_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (chunk.id, chunk.namespace, chunk.prev, chunk.start, key_blob(chunk.tokens), chunk.file, chunk.size,
         chunk.raw_size, chunk.codec),
    )
    return bool(cursor.rowcount)


def absorb(conn: sqlite3.Connection, chunk: ChunkRow) -> set[bytes]:
    """Move the links to shorter chunks after ``chunk.prev`` whose tokens ``chunk`` extends onto ``chunk``.

    Returns:
        The ids of the chunks absorbed (now unlinked: pass them to :func:`release`).
    """
    absorbed: set[bytes] = set()
    rows = conn.execute(
        f"SELECT {CHUNK_COLUMNS} FROM chunks WHERE namespace = ? AND prev = ? AND id != ?",
        (chunk.namespace, chunk.prev, chunk.id),
    ).fetchall()
    for row in rows:
        try:
            shorter = chunk_from_row(row)
        except BadRow:
            continue
        if shorter.n_tokens < chunk.n_tokens and np.array_equal(chunk.tokens[: shorter.n_tokens], shorter.tokens):
            # Only a chain's last chunk may be replaced by a longer one. A shorter chunk is not always
            # partial: a full chunk of a chain with a smaller chunk length is shorter too, and links
            # follow it.
            if conn.execute(
                "SELECT 1 FROM links AS a JOIN links AS b ON b.entry_id = a.entry_id AND b.pos = a.pos + 1 "
                "WHERE a.chunk = ? LIMIT 1",
                (shorter.id,),
            ).fetchone() is not None:
                continue
            conn.execute("UPDATE links SET chunk = ? WHERE chunk = ?", (chunk.id, shorter.id))
            absorbed.add(shorter.id)
    return absorbed


def link(conn: sqlite3.Connection, entry_id: int, ids: Sequence[bytes]) -> None:
    """Link an entry to its chain's chunks, in order (one row each)."""
    conn.executemany("INSERT INTO links (entry_id, pos, chunk) VALUES (?, ?, ?)", ((entry_id, pos, ident) for pos, ident in enumerate(ids)))


def release(conn: sqlite3.Connection, ids: Iterable[bytes]) -> list[tuple[str, int]]:
    """Delete the chunk rows among ``ids`` that no link references.

    Returns:
        ``(file, size)`` of each chunk deleted: unlink the files after commit. A malformed row is deleted
        too; its file (untrusted name) is left to the orphan sweep.
    """
    freed: list[tuple[str, int]] = []
    for ident in ids:
        row = conn.execute(
            f"SELECT {CHUNK_COLUMNS} FROM chunks WHERE id = ? AND NOT EXISTS (SELECT 1 FROM links WHERE chunk = ?)",
            (ident, ident),
        ).fetchone()
        if row is None:
            continue
        conn.execute("DELETE FROM chunks WHERE id = ?", (ident,))
        try:
            chunk = chunk_from_row(row)
        except BadRow:
            continue
        freed.append((chunk.file, chunk.size))
    return freed


def chain(conn: sqlite3.Connection, entry_id: int) -> list[ChunkRow]:
    """The chunks an entry links, in order.

    Raises:
        BadRow: a link is missing or malformed, or names no chunk or a malformed one.
    """
    rows = conn.execute(
        f"SELECT l.pos, {', '.join('c.' + c.strip() for c in CHUNK_COLUMNS.split(','))} "
        "FROM links AS l LEFT JOIN chunks AS c ON c.id = l.chunk WHERE l.entry_id = ? ORDER BY l.pos",
        (entry_id,),
    ).fetchall()
    out: list[ChunkRow] = []
    for expected, row in enumerate(rows):
        if row[0] != expected:
            raise BadRow(f"entry {entry_id} has no link at position {expected}")
        if row[1] is None:
            raise BadRow(f"entry {entry_id} links a chunk that is not stored")
        out.append(chunk_from_row(row[1:]))
    return out


def stored_bytes(conn: sqlite3.Connection, block: int) -> tuple[int, int]:
    """Bytes of every chunk file the index records, and what they take on disk in whole blocks of
    ``block`` bytes (sizes out of bounds are not counted). One pass over the chunk rows."""
    row = conn.execute(
        "SELECT COALESCE(SUM(size), 0), COALESCE(SUM((size + ? - 1) / ? * ?), 0) FROM chunks "
        "WHERE typeof(size) = 'integer' AND size > 0 AND size <= ?",
        (block, block, block, _BASE_BYTES + MAX_CHUNK_FILE_TOKENS * _BYTES_PER_TOKEN),
    ).fetchone()
    if row is None or not is_int(row[0]) or not is_int(row[1]):
        return 0, 0
    return int(row[0]), int(row[1])
