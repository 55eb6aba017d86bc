"""This process's picture of a disk cache's index: the entries, their keys, LRU order and bytes.

:class:`IndexView` holds one :class:`~llama_cache.index.RadixIndex` per (namespace, cut) pair, the
entries by id, their LRU order and the sum of their sizes (exact, and in whole blocks as the byte budget
charges them: :mod:`.budget`), as of change-log row ``last_seq``. It is kept
equal to the index by :meth:`IndexView.replay` (the rows of the ``changes`` table past ``last_seq``)
or, when the log was trimmed past it or does not agree with the entries, :meth:`IndexView.rebuild`
(from the ``entries`` table). Lookups (:meth:`IndexView.best`, :meth:`IndexView.exact`) never touch
SQLite. Rows are validated by :mod:`.rows`; one that does not validate is reported through the
``log_bad_row`` function and skipped.

Not thread-safe: the owning cache calls it under its lock, in a read or write transaction of its
connection when it replays or rebuilds.
"""

from __future__ import annotations

import logging
import sqlite3
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from llama_cache.caches.disk.budget import charge
from llama_cache.caches.disk.rows import BadRow, Entry, entry_from_row, is_int, key_tokens
from llama_cache.caches.disk.schema import ADD, DELETE, REPLAY, ENTRY_ROW, TOUCH, log_floor
from llama_cache.index import Match, RadixIndex
from llama_cache.tokens import Tokens

logger = logging.getLogger("llama_cache.caches.disk")  # one logger for the whole disk tier


class IndexView:
    """The entries of the index as this process last saw them.

    Args:
        log_bad_row: called with (table, rowid, reason) for each row that does not validate.
        block: the file system's block: ``charged`` counts each file in whole blocks of it.
    """

    def __init__(self, log_bad_row: Callable[[str, Any, str], None], block: int = 1) -> None:
        self.indexes: dict[tuple[str, bool], RadixIndex[Entry]] = {}
        self.entries: dict[int, Entry] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # entry ids, least recently used first
        self.bytes = 0  # the entries' file sizes
        self.charged = 0  # the same in whole blocks
        self.block = block
        self.last_seq = 0  # the last change-log row applied
        self.floor: int | None = None  # the change log's trim point as last read (None: damaged)
        self._log_bad_row = log_bad_row

    def _count(self, entry: Entry, sign: int) -> None:
        self.bytes += sign * entry.size
        self.charged += sign * charge(entry.size, self.block)

    def best(self, query: Tokens, namespace: str | None) -> Match[Entry] | None:
        """The match answering ``query`` (best a :class:`~llama_cache.tokens.CheckedTokens`: checked once,
        not once per index) from ``namespace`` (None: any), most recent on ties."""
        best: Match[Entry] | None = None
        rank = (-1, 0)
        for (filed, cut), index in self.indexes.items():
            if namespace is not None and filed != namespace:
                continue
            match = index.longest_common_prefix(query) if cut else index.longest_prefix(query)
            if match is not None and (match.common, match.value.recency) > rank:
                best, rank = match, (match.common, match.value.recency)
        return best

    def exact(self, namespace: str, tokens: npt.NDArray[np.int32]) -> Entry | None:
        """The entry stored under exactly ``tokens`` in ``namespace``."""
        for cut in (True, False):
            index = self.indexes.get((namespace, cut))
            entry = index.get(tokens) if index is not None else None
            if entry is not None:
                return entry
        return None

    def replay(self, conn: sqlite3.Connection) -> None:
        """Apply the change log past ``last_seq``, or rebuild when it was trimmed or is out of step."""
        floor = log_floor(conn)
        if floor is None or self.last_seq < floor:
            self.rebuild(conn)
            return
        self.floor = floor
        try:
            self._replay_rows(conn)
        except (BadRow, ValueError, TypeError, KeyError, IndexError) as error:
            logger.warning("disk cache: change log out of step with the entries (%s); rebuilding", error)
            self.rebuild(conn)

    def _replay_rows(self, conn: sqlite3.Connection) -> None:
        for row in conn.execute(REPLAY, (self.last_seq,)):
            seq, op, entry_id, del_key = row[:4]
            if not is_int(seq) or not is_int(entry_id) or op not in (ADD, TOUCH, DELETE):
                self._log_bad_row("changes", seq, "unknown operation or entry")
                if is_int(seq):
                    self.last_seq = seq
                continue
            if op == ADD:
                if row[4] is not None and entry_id not in self.entries:
                    try:
                        entry, tokens = entry_from_row(row[4:])
                    except BadRow as problem:
                        self._log_bad_row("entries", entry_id, str(problem))
                    else:
                        entry.recency = seq
                        self.add(entry, tokens)
            elif op == TOUCH:
                entry = self.entries.get(entry_id)
                if entry is not None and row[4] is not None:
                    key = row[6]
                    if not isinstance(key, bytes) or len(key) != 4 * entry.n_key:
                        raise BadRow(f"entry {entry_id} changed its key")
                    entry.recency = seq
                    self.lru.move_to_end(entry_id)
                    self.indexes[(entry.namespace, entry.cut)].touch(key_tokens(key))
            else:
                entry = self.entries.get(entry_id)
                if entry is not None:
                    if not isinstance(del_key, bytes) or len(del_key) != 4 * entry.n_key:
                        raise BadRow(f"the delete of entry {entry_id} names another key")
                    tokens = key_tokens(del_key)
                    index = self.indexes[(entry.namespace, entry.cut)]
                    if index.get(tokens) is not entry:
                        raise BadRow(f"the delete of entry {entry_id} names another key")
                    self.entries.pop(entry_id)
                    del self.lru[entry_id]
                    self._count(entry, -1)
                    index.remove(tokens)
                    if not len(index):
                        del self.indexes[(entry.namespace, entry.cut)]
            self.last_seq = seq

    def add(self, entry: Entry, tokens: npt.NDArray[np.int32]) -> None:
        """Add a validated entry under ``tokens``, dropping any other entry of its namespace there."""
        # One key per namespace (the UNIQUE constraint): an entry of the other cut kind under the same
        # key can only be a stale or forged row; the newer one wins.
        other = self.indexes.get((entry.namespace, not entry.cut))
        stale = other.get(tokens) if other is not None else None
        if stale is not None:
            self.drop(stale, tokens)
        index = self.indexes.get((entry.namespace, entry.cut))
        if index is None:
            index = self.indexes[(entry.namespace, entry.cut)] = RadixIndex()
        old = index.insert(tokens, entry)
        if old is not None and old is not entry:  # deletes precede re-adds, unless rows were forged
            self.entries.pop(old.id, None)
            self.lru.pop(old.id, None)
            self._count(old, -1)
        self.entries[entry.id] = entry
        self.lru[entry.id] = None
        self._count(entry, 1)

    def drop(self, entry: Entry, tokens: npt.NDArray[np.int32]) -> None:
        """Remove an entry held under ``tokens``."""
        index = self.indexes[(entry.namespace, entry.cut)]
        index.remove(tokens)
        if not len(index):
            del self.indexes[(entry.namespace, entry.cut)]
        self.entries.pop(entry.id, None)
        self.lru.pop(entry.id, None)
        self._count(entry, -1)

    def rebuild(self, conn: sqlite3.Connection) -> None:
        """Rebuild the in-memory index from the entries table (in the caller's read transaction)."""
        self.indexes = {}
        self.entries = {}
        self.lru = OrderedDict()
        self.bytes = self.charged = 0
        row = conn.execute("SELECT max(seq) FROM changes").fetchone()
        self.last_seq = row[0] if row and is_int(row[0]) else 0
        floor = self.floor = log_floor(conn)
        if floor is not None and floor > self.last_seq:
            self.last_seq = floor
        for row in conn.execute(f"SELECT {ENTRY_ROW} FROM entries ORDER BY recency"):
            try:
                entry, tokens = entry_from_row(row)
            except BadRow as problem:
                self._log_bad_row("entries", row[0], str(problem))
                continue
            self.add(entry, tokens)
