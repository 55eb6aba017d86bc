"""The disk tier's byte budget: what a cache directory takes as ``du`` counts it, and eviction until it fits.

``capacity_bytes`` bounds the directory's usage on disk, counted as ``du`` counts it (``st_blocks *
512``, what ``du -s`` reports by default) once no store is in progress:

- every payload, chain head and chunk file the index names, each once, rounded up to the file
  system's block (:func:`charge`): a 300-byte chunk file takes a whole 4 KiB block;
- the index file (``PRAGMA page_count * page_size``, free pages included, plus the file system's own
  blocks for it, measured) and its rollback journal, which every commit truncates to nothing. The
  index is kept in ``auto_vacuum=INCREMENTAL`` mode (an older one is converted once, when opened:
  :func:`make_shrinkable`), so that a commit over the budget gives its free pages back
  (:func:`reclaim_free_pages`) before evicting: the index shrinks with the entries instead of
  keeping the size of the largest cache it ever held;
- the folders: the cache directory, ``data/`` and each shard folder, at their measured sizes.

Files are charged from the sizes the index records (:func:`charge`), so every process computes the same
figure without a system call. Folder sizes change behind the index's back (a folder grows with its
entries and, on ext4, never shrinks until removed), so they are measured, never estimated: each commit
``stat``\\ s the folders it wrote into and records their sizes in the ``folders`` table, where every
process reads them; a folder emptied by a removal is removed and its row dropped; a cache opening the
directory and ``check(fix=True)`` measure every folder again. New files go into at most
:func:`shard_count` folders, about one per ``FILES_PER_FOLDER`` blocks of the budget, so folders take a
small share of a small budget. Nothing here lists the directory on a store: a commit costs a
``stat`` per folder it wrote into and one of the index, and (the store keeping the figures between
commits while no other process commits: :class:`~.store.DiskStore`) writes a folder's row only when its
size changed, measures the top folders only after a shard folder came or went, and, far from the
budget, bounds the index's pages (:func:`growth_bound`) instead of counting them.

What the budget cannot see: files written but not yet committed (a store in progress, another
process's included, and the journal during a commit: the directory exceeds the budget by them until
the commit that evicts for them), orphans of killed writers until they are swept (the folders they
grew are measured, and entries evicted to fit, when a cache next opens the directory), and damaged
indexes moved aside (``index.sqlite3.damaged-*``), which are kept for inspection.

Functions taking a connection run in the caller's transaction, with the directory's lock held.
"""

from __future__ import annotations

import functools
import os
import sqlite3
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from llama_cache.caches.disk import chunkstore
from llama_cache.caches.disk.rows import Entry, is_int
from llama_cache.caches.disk.schema import SCHEMA, delete_rows

if TYPE_CHECKING:
    from llama_cache.caches.disk.store import DiskStore

FILES_PER_FOLDER = 64
"""New files are spread over one shard folder per this many blocks of the budget (256 at most)."""
_MAX_SHARDS = 256  # two hex digits
_MAX_FOLDER_BYTES = 1 << 32  # a folder row above this is not believed (and charged as this)
_PAGE_SIZE = 4096  # SQLite's default: what a new index is created with
_INCREMENTAL = 2  # PRAGMA auto_vacuum's value for incremental mode


def block_size(path: Path) -> int:
    """The allocation unit of the file system holding ``path`` (or its nearest existing ancestor).

    ``f_frsize`` from ``statvfs``, at least 512 bytes (``du``'s unit); 4096 when it cannot be read.
    """
    for candidate in (path, *path.absolute().parents):
        try:
            found = os.statvfs(candidate).f_frsize
        except OSError:
            continue
        return max(512, int(found)) if found > 0 else 4096
    return 4096


def charge(size: int, block: int) -> int:
    """Bytes a file of ``size`` bytes takes on disk: whole blocks."""
    return -(-size // block) * block


def shard_count(capacity: int, block: int) -> int:
    """How many shard folders new files are spread over: one per ``FILES_PER_FOLDER`` blocks, 1..256."""
    return max(1, min(_MAX_SHARDS, capacity // (block * FILES_PER_FOLDER)))


@functools.cache
def empty_index_bytes() -> int:
    """Bytes of an index holding no row: one page per table and index of the schema, and a pointer map."""
    conn = sqlite3.connect(":memory:")
    try:
        conn.execute(f"PRAGMA page_size = {_PAGE_SIZE}")
        conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
        for statement in SCHEMA:
            conn.execute(statement)
        return int(conn.execute("PRAGMA page_count").fetchone()[0]) * _PAGE_SIZE
    finally:
        conn.close()


def minimum_capacity(block: int) -> int:
    """The smallest budget a cache accepts: an empty index, the cache folder, ``data/`` and one shard
    folder, each at least a block."""
    return charge(empty_index_bytes(), block) + 3 * block


def index_pages(conn: sqlite3.Connection) -> int:
    """Pages of the index, as of the caller's transaction: one pragma (to notice that it grew)."""
    return int(conn.execute("PRAGMA page_count").fetchone()[0])


def index_bytes(conn: sqlite3.Connection, block: int, path: Path) -> int:
    """Bytes of the index file at ``path``, as of the caller's transaction (pages it added included):
    :func:`index_size` with the page size read too."""
    return index_size(conn, block, path, int(conn.execute("PRAGMA page_size").fetchone()[0]))[1]


def index_size(conn: sqlite3.Connection, block: int, path: Path, page_size: int) -> tuple[int, int]:
    """Pages of the index as of the caller's transaction, and the bytes of its file (:func:`index_bytes_of`).
    One pragma and one ``stat``."""
    pages = int(conn.execute("PRAGMA page_count").fetchone()[0])
    return pages, index_bytes_of(pages, page_size, block, path)


def index_bytes_of(pages: int, page_size: int, block: int, path: Path) -> int:
    """Bytes an index of ``pages`` pages takes: the pages in whole blocks, plus the blocks the file
    system spends on the file at ``path`` beyond its data as the file is now (ext4 counts an extent
    block in ``st_blocks`` once a file is in more than four pieces, which SQLite's writes out of order
    soon make). One ``stat``."""
    try:
        found = os.stat(path)
        extra = max(0, found.st_blocks * 512 - charge(found.st_size, block))
    except OSError:
        extra = 0
    return charge(pages * page_size, block) + extra


# A whole-state store writes into at most this many b-trees: entries and its two indexes, changes,
# folders, meta and sqlite_sequence (chunked stores, which write more, count pages instead).
_STORE_TREES = 7
_TREE_DEPTH = 8  # more levels than an index of billions of rows has
_POINTER_MAP_PAGES = 2  # auto-vacuum's pointer-map pages that new pages may need


def growth_bound(key_bytes: int, page_size: int) -> int:
    """The most pages a whole-state store's rows can add to the index: a key of ``key_bytes`` bytes in
    overflow pages, and in each b-tree written a split at every level (two new pages each: SQLite's
    balance makes at most one more sibling per level, the root one more level) and a new root."""
    overflow = -(-key_bytes // (page_size - 4)) + 1  # 4 bytes of each overflow page hold its link
    return overflow + _STORE_TREES * (2 * _TREE_DEPTH + 1) + _POINTER_MAP_PAGES


_VALID_FOLDER = "name GLOB '[0-9a-f][0-9a-f]' AND typeof(bytes) = 'integer' AND bytes >= 0 AND bytes <= ?"


def make_shrinkable(conn: sqlite3.Connection) -> bool:
    """Convert an index made without ``auto_vacuum=INCREMENTAL`` (by an older version) with ``VACUUM``,
    which rewrites it in place: O(its size), once. Outside any transaction, the directory's lock held.

    Returns:
        Whether it was converted now.

    Raises:
        sqlite3.Error: it could not be (the index stays as it was).
    """
    if conn.execute("PRAGMA auto_vacuum").fetchone()[0] == _INCREMENTAL:
        return False
    conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
    conn.execute("VACUUM")
    return True


def reclaim_free_pages(conn: sqlite3.Connection) -> int:
    """Give the index's free pages back to the file system (in the caller's write transaction: the file
    is cut at its commit). A no-op for an index without incremental auto-vacuum. O(pages freed).

    Returns:
        The pages given back.
    """
    freed = 0
    while conn.execute("PRAGMA freelist_count").fetchone()[0] > 0:
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        # One page per call: Python's sqlite3 steps a statement without result columns once.
        conn.execute("PRAGMA incremental_vacuum(1)")
        if conn.execute("PRAGMA page_count").fetchone()[0] >= pages:
            break  # not in incremental mode
        freed += 1
    return freed


def folder_bytes(conn: sqlite3.Connection, *, named_only: bool = False) -> int:
    """The recorded sizes of the shard folders (rows that do not validate are not counted).

    With ``named_only``, only the folders holding a file some row names: what is left once the
    files of the rows deleted in this transaction are unlinked and their folders removed. That scans
    the entries and chunks (O(rows)): for when eviction has run out of entries.
    """
    named = (" AND name IN (SELECT substr(file, 1, 2) FROM entries UNION SELECT substr(file, 1, 2) FROM chunks)"
             if named_only else "")
    row = conn.execute(
        f"SELECT COALESCE(SUM(bytes), 0) FROM folders WHERE {_VALID_FOLDER}{named}", (_MAX_FOLDER_BYTES,)
    ).fetchone()
    return int(row[0]) if row is not None and is_int(row[0]) else 0


def read_folders(conn: sqlite3.Connection) -> dict[str, int]:
    """The valid rows of the ``folders`` table (a folder name and a size within bounds): one query."""
    return {
        name: int(nbytes)
        for name, nbytes in conn.execute(f"SELECT name, bytes FROM folders WHERE {_VALID_FOLDER}", (_MAX_FOLDER_BYTES,))
        if isinstance(name, str) and is_int(nbytes)
    }


def record_folders(conn: sqlite3.Connection, sizes: Mapping[str, int], gone: Iterable[str] = ()) -> None:
    """Record measured folder sizes, and forget folders found missing. A row already right is not written."""
    for name, nbytes in sizes.items():
        conn.execute(
            "INSERT INTO folders (name, bytes) VALUES (?, ?) "
            "ON CONFLICT (name) DO UPDATE SET bytes = excluded.bytes WHERE bytes IS NOT excluded.bytes",
            (name, nbytes),
        )
    for name in gone:
        conn.execute("DELETE FROM folders WHERE name = ?", (name,))


def replace_folders(conn: sqlite3.Connection, sizes: Mapping[str, int]) -> None:
    """Make the ``folders`` table exactly ``sizes`` (a fresh measurement of every folder)."""
    conn.execute("DELETE FROM folders")
    record_folders(conn, sizes)


def top_bytes(store: DiskStore) -> int:
    """Bytes of the cache folder and ``data/`` themselves (two ``stat`` calls; a missing one is 0)."""
    total = 0
    for path in (store.cache_dir, store.data_dir):
        try:
            total += os.lstat(path).st_blocks * 512
        except OSError:
            pass
    return total


def measure(path: Path) -> int:
    """What ``du -s`` reports for ``path``: ``st_blocks * 512`` of it and of everything below it, links
    not followed, each inode once. A listing of the whole tree: for checks, never on a store."""
    seen: set[tuple[int, int]] = set()
    total = 0
    pending = [os.fspath(path)]
    try:
        info = os.lstat(pending[0])
    except OSError:
        return 0
    seen.add((info.st_dev, info.st_ino))
    total += info.st_blocks * 512
    while pending:
        folder = pending.pop()
        try:
            with os.scandir(folder) as children:
                for child in children:
                    try:
                        info = child.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if (info.st_dev, info.st_ino) in seen:
                        continue
                    seen.add((info.st_dev, info.st_ino))
                    total += info.st_blocks * 512
                    if child.is_dir(follow_symlinks=False):
                        pending.append(child.path)
        except OSError:
            continue
    return total


def files_bytes(store: DiskStore, conn: sqlite3.Connection) -> int:
    """The charge of every file the index names: entries from the in-memory view, chunks from the
    index (as of the caller's transaction). The view must be in step (synced in the transaction)."""
    return store.view.charged + chunkstore.stored_bytes(conn, store.block)[1]


def evict_to_fit(
    store: DiskStore, conn: sqlite3.Connection, capacity: int, files: int, keep: Collection[int],
    grown: int | None = None,
) -> tuple[list[Entry], list[tuple[str, int]], bool]:
    """Delete least recently used entries until ``files`` (the charge of the files the transaction
    leaves, as the caller computed it) plus the index and the folders fit ``capacity``.

    In the caller's write transaction, its view in step; entries in ``keep`` are never evicted. The
    index is measured again after each eviction (logging a delete may add a page), and gives its free
    pages back whenever the total is over (those an eviction freed included). Folders are
    charged as recorded until every other entry is gone; then only those still holding a named file
    are (the others are removed with their last file after the commit), so a directory whose folders
    alone exceed the budget (made by a cache with a larger one) empties instead of refusing every
    store. Costs O(victims) queries, and one pass over the rows when everything goes.

    Returns:
        The entries deleted, the chunks freed (``(file, size)``: unlink them after commit), and
        whether the total fits.
    """
    fixed = store.top_bytes() + sum(store.folder_sizes(conn).values())
    if grown is not None:  # far from the budget, an upper bound of the index tells without counting pages
        bound = store.index_bound(conn, grown)
        if bound is not None and files + fixed + bound <= capacity:
            return [], [], True
    victims: list[Entry] = []
    freed: list[tuple[str, int]] = []
    lru = iter(list(store.view.lru))
    exhausted = False
    while files + fixed + store.index_bytes(conn) > capacity:
        if reclaim_free_pages(conn):
            continue
        victim_id = next(lru, None)
        if victim_id is None:
            if exhausted:
                return victims, freed, False
            exhausted = True
            fixed = top_bytes(store) + folder_bytes(conn, named_only=True)
            continue
        if victim_id in keep:
            continue
        entry = store.view.entries[victim_id]
        gone, linked = delete_rows(conn, [entry])
        released = chunkstore.release(conn, linked)
        victims += gone
        freed += released
        files -= charge(entry.size, store.block) + sum(charge(nbytes, store.block) for _, nbytes in released)
    return victims, freed, True
