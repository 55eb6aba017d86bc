"""The disk tier's index: its SQLite schema, its version, creation and migration, and the change log.

The index (``INDEX_FILE`` in the cache directory, a rollback journal: :mod:`.connection`) holds seven
tables: ``entries`` (one row per entry), ``changes`` (the change log every process replays, see the package docstring), ``meta`` (the
log's trim point, ``floor``), ``models`` (descriptions of the namespaces' models), ``chunks`` (one row
per stored KV chunk), ``links`` (which chunks each chunked entry uses, in order: a chunk's
reference count is its number of links) and ``folders`` (the measured sizes of the shard folders,
which the byte budget charges: :mod:`.budget`). This module owns
their definition and the SQL shared by the cache and the checker; it holds no state. Nothing read from
the index is trusted here: rows are validated by :mod:`.rows`.

Functions taking a connection run in the caller's transaction unless they say otherwise.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from llama_cache.caches.disk.rows import Entry, is_int

logger = logging.getLogger("llama_cache.caches.disk")  # one logger for the whole disk tier

INDEX_FILE = "index.sqlite3"
SCHEMA_VERSION = 3
# Version 2 (whole-state entries only) is upgraded in place: its tables are version 3's minus chunks
# and links, and its entries stay readable as whole-state entries.
_UPGRADABLE = (2,)

ADD, TOUCH, DELETE = 1, 2, 3  # change-log operations
_TRIM_EVERY = 20_000  # log rows accumulated before a trim...
_TRIM_KEEP = 5_000  # ...which keeps this many (a process further behind rebuilds its index)

ENTRY_COLUMNS = (
    "id", "namespace", "key", "key_hash", "kind", "cut", "logits", "n_state", "file", "size", "raw_size",
    "codec", "created", "accessed", "recency", "hits",
)
SCHEMA = (
    """CREATE TABLE IF NOT EXISTS entries (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        namespace TEXT NOT NULL,     -- the state's model fingerprint
        key BLOB NOT NULL,           -- the tokens, int32 little-endian
        key_hash BLOB NOT NULL,      -- blake2b-128 of key, for uniqueness
        kind INTEGER NOT NULL,       -- 0 llama-cache LlamaState, 1 llama-cpp-python LlamaState,
                                     -- 2 llama-cache LlamaState as a chain head and chunks (links)
        cut INTEGER NOT NULL,        -- 1 when the state can be cut back to a shorter prefix
        logits INTEGER NOT NULL,     -- 1 when the state holds logits
        n_state INTEGER NOT NULL,    -- tokens the state holds (the key is a prefix of them)
        file TEXT NOT NULL,          -- payload (or chain head) path relative to data/
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
    """CREATE TABLE IF NOT EXISTS chunks (
        id BLOB PRIMARY KEY,         -- chained hash of namespace, prev and tokens (state/chunks.py)
        namespace TEXT NOT NULL,
        prev BLOB NOT NULL,          -- the previous chunk's id; empty for a chain's first chunk
        start INTEGER NOT NULL,      -- position of its first token
        tokens BLOB NOT NULL,        -- its tokens, int32 little-endian
        file TEXT NOT NULL,          -- chunk file path relative to data/
        size INTEGER NOT NULL,
        raw_size INTEGER NOT NULL,
        codec TEXT NOT NULL
    ) WITHOUT ROWID""",
    "CREATE INDEX IF NOT EXISTS chunks_prev ON chunks (namespace, prev)",
    """CREATE TABLE IF NOT EXISTS links (
        entry_id INTEGER NOT NULL,
        pos INTEGER NOT NULL,        -- the chunk's index in the entry's chain
        chunk BLOB NOT NULL,
        PRIMARY KEY (entry_id, pos)
    ) WITHOUT ROWID""",
    "CREATE INDEX IF NOT EXISTS links_chunk ON links (chunk)",
    # Added within version 3 (an index without it gets it when opened; older code ignores it).
    """CREATE TABLE IF NOT EXISTS folders (
        name TEXT PRIMARY KEY,       -- a shard folder of data/ (two hex digits)
        bytes INTEGER NOT NULL       -- its size on disk (st_blocks * 512) when last measured
    ) WITHOUT ROWID""",
)
_TABLES = ("entries", "changes", "meta", "models", "chunks", "links", "folders")
ENTRY_ROW = "id, namespace, key, kind, cut, logits, n_state, file, size, raw_size, codec, recency"

# Changes newer than a seq, with what replaying them needs. Adds and touches join their entry: an
# entry deleted since has no row, and its delete follows in the log.
REPLAY = """
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


def create_schema(conn: sqlite3.Connection, db_path: Path) -> None:
    """Create the tables, or start them again empty when they are of an older or damaged schema.

    Runs in the caller's write transaction.

    Raises:
        CacheDirectoryError: the index has a newer schema version than this llama-cache reads.
        sqlite3.Error: the index cannot be read or written.
    """
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if is_int(version) and version > SCHEMA_VERSION:
        raise CacheDirectoryError(
            f"{str(db_path)!r} has index schema version {version}; this llama-cache reads "
            f"{SCHEMA_VERSION} (use another directory, or upgrade llama-cache)"
        )
    if version not in (0, SCHEMA_VERSION, *_UPGRADABLE) or not _schema_ok(conn):
        # An older or damaged schema: it is a cache, so start it again (the old payloads become
        # orphans, removed by the sweep once older than the grace period).
        logger.warning(
            "disk cache: %s has index schema version %s or unexpected tables; rebuilding it empty",
            db_path, version,
        )
        for table in _TABLES:
            conn.execute(f"DROP TABLE IF EXISTS {table}")
    for statement in SCHEMA:
        conn.execute(statement)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def _schema_ok(conn: sqlite3.Connection) -> bool:
    """Whether existing tables have the columns this version expects (absent tables are created)."""
    expected = {
        "entries": list(ENTRY_COLUMNS),
        "changes": ["seq", "op", "entry_id", "namespace", "key"],
        "meta": ["name", "value"],
        "models": ["fingerprint", "info"],
        "chunks": ["id", "namespace", "prev", "start", "tokens", "file", "size", "raw_size", "codec"],
        "links": ["entry_id", "pos", "chunk"],
        "folders": ["name", "bytes"],
    }
    for table, columns in expected.items():
        found = [row[1] for row in conn.execute(f"PRAGMA table_info({table})")]
        if found and found != columns:
            return False
    return True


def log_floor(conn: sqlite3.Connection) -> int | None:
    """The change-log trim point, or None when the meta row is missing or damaged."""
    row = conn.execute("SELECT value FROM meta WHERE name = 'floor'").fetchone()
    if row is None or not is_int(row[0]) or row[0] < 0:
        return None
    return int(row[0])


def maybe_trim(conn: sqlite3.Connection, seq: int, floor: int | None) -> int | None:
    """Trim the change log once it holds ``_TRIM_EVERY`` rows past the floor; repair a damaged floor.

    Args:
        seq: the last row of the log.
        floor: the trim point as the caller's view last read it (:func:`log_floor`; None: missing or
            damaged), in step with the index (no other connection committed since).

    Returns:
        The trim point now. No statement unless the log is trimmed or the floor repaired.
    """
    if floor is None:  # damaged: every process rebuilds once, then the log continues from here
        conn.execute("INSERT OR REPLACE INTO meta (name, value) VALUES ('floor', ?)", (seq,))
        return seq
    if seq - floor >= _TRIM_EVERY:
        floor = seq - _TRIM_KEEP
        conn.execute("DELETE FROM changes WHERE seq <= ?", (floor,))
        conn.execute("UPDATE meta SET value = ? WHERE name = 'floor'", (floor,))
    return floor


def shed_log(conn: sqlite3.Connection, seq: int, floor: int | None) -> int | None:
    """Trim the change log to its last row (``seq``): what a write transaction whose log row took the
    index over the budget sheds before any entry, the log being only how other processes catch up
    (each one behind rebuilds its index from the entries once instead).

    Args:
        seq: the last row of the log.
        floor: the trim point, in step with the index (as for :func:`maybe_trim`); None: damaged,
            left for the next store to repair.

    Returns:
        The trim point now (the pages freed are the caller's to give back). No statement when the log
        holds no other row.
    """
    if floor is None or seq - floor < 2:
        return floor
    conn.execute("DELETE FROM changes WHERE seq < ?", (seq,))
    conn.execute("UPDATE meta SET value = ? WHERE name = 'floor'", (seq - 1,))
    return seq - 1


@contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[None]:
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


def delete_rows(conn: sqlite3.Connection, victims: list[Entry]) -> tuple[list[Entry], set[bytes]]:
    """Delete entries' rows and links, logging each delete with its key (for replaying processes).

    The chunks the entries linked are not freed here: pass the returned ids to
    :func:`.chunkstore.release` once the transaction has added whatever links it adds.

    Returns:
        The entries whose row was still there (others were deleted meanwhile by another process), and
        the ids of the chunks they linked.
    """
    deleted = []
    linked: set[bytes] = set()
    for victim in victims:
        cursor = conn.execute(
            "INSERT INTO changes (op, entry_id, namespace, key) "
            "SELECT ?, id, namespace, key FROM entries WHERE id = ?",
            (DELETE, victim.id),
        )
        if cursor.rowcount:
            conn.execute("DELETE FROM entries WHERE id = ?", (victim.id,))
            deleted.append(victim)
        linked.update(row[0] for row in conn.execute("SELECT chunk FROM links WHERE entry_id = ?", (victim.id,)))
        conn.execute("DELETE FROM links WHERE entry_id = ?", (victim.id,))
    return deleted, linked
