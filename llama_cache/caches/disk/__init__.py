"""LlamaDiskCache: a persistent prefix-state cache that several processes can share.

Layout of ``cache_dir``::

    index.sqlite3 (+ -journal)     the index (SQLite, rollback journal): entries, a change log, metadata,
                                    the models of the namespaces, chunks and links, folder sizes
    data/ab/ab12...ef.llst          immutable files, optionally zlib-compressed: a payload per
                                    whole-state entry (:mod:`llama_cache.state.format`), a chain
                                    head per chunked entry and one file per KV chunk
                                    (:mod:`llama_cache.state.chunks`), in shard folders (``ab``)
                                    removed when their last file goes

**The byte budget** (:mod:`.budget`): ``capacity_bytes`` bounds what the directory takes on disk as
``du -s`` counts it: the files in whole blocks, the index and the folders. Stores evict least
recently used entries until it fits; a budget below what an empty cache takes is refused.

**Chunks.** A transformer state is stored as a chain head (tokens, logits, seed, KV layout) and the
chunks of its KV: ``chunk_tokens`` tokens each, the last one possibly partial, each identified by a
chained hash of the namespace, the previous chunk's id and its tokens. Equal prefixes of any two
entries are the same chunks, stored once: a system prompt shared by many conversations, and every
earlier turn of a conversation, cost their bytes once however many entries hold them. A store writes
only the chunks the index does not hold yet (and its head). The ``links`` table lists each chunked
entry's chunks in order; a chunk's reference count is its number of links, and a chunk is freed in
the transaction that removes its last link (file unlinked after commit). A partial chunk is absorbed
when a chunk with the same predecessor extending its tokens is stored (its links move there), so a
growing conversation keeps one tail per branch. States that cannot be cut (recurrent and hybrid
memory) and llama-cpp-python's states are stored whole, one payload each; so is everything with
``chunk_tokens=0``. Reading a chunked entry checks every link against the head (positions,
predecessors, tokens, the id recomputed from the chunk file's tokens): what the index says can only
assemble the head's own state. :meth:`LlamaDiskCache.lookup_prefix` reads only the chunks a query
shares with the entry.

**Indexes of version 2** (whole-state entries only, before chunks) are upgraded in place when opened:
the chunk tables are added and the old entries stay readable as whole-state entries. An index of a
newer version than this code reads is refused (:class:`CacheDirectoryError`).

**Write protocol** (diskcache's, see STYLE.md): the payload (or head and new chunks) goes to new,
uniquely named files first (``O_EXCL``; ``fsync`` optional); then the metadata is committed in one
``BEGIN IMMEDIATE`` transaction that also deletes the rows of replaced and evicted entries and of the
chunks they alone used; their files are unlinked only after ``COMMIT``. A whole-state store that
replaces and evicts nothing costs six statements at most (:mod:`.writes`), the process's view
taking the new entry in memory. Should another process free a
chunk a store counted on before it commits, the store plans and writes again. A crash at any
instant therefore leaves either the old index or the new one, both naming complete files; at worst an uncommitted file is left behind: an orphan, which the next
:class:`LlamaDiskCache` opened on the directory removes once it is older than
``ORPHAN_GRACE_SECONDS`` (younger ones may be writes in progress), as ``check(fix=True)`` does. Without
``fsync`` a power loss can lose recent entries, leave a committed row naming a file whose bytes
never reached the disk (the checksum makes that a miss, never a wrong state) or damage the index
(committed with ``synchronous=OFF``; it is then moved aside and started again empty).

**Reads** take the best entry from an in-process :class:`~llama_cache.index.RadixIndex` (O(K) in the
query length, no scan over entries), read its file into a private buffer and decode it in place (no
further copy), verifying the checksum (XXH3-64) by default. The returned state hands llama.cpp its
bytes straight from that buffer. A missing, truncated or tampered payload is a miss: logged at WARNING,
the entry removed, the next best entry tried. Nothing is ever unpickled.

**Nothing is memory-mapped.** Another process may truncate or rewrite any file of the directory at any
instant, and a mapped page past the new end of its file faults the reader (SIGBUS). So payloads are
read, not mapped (one copy: ``benchmarks/disk_io.py`` measures it), and the index is a rollback
journal opened through SQLite's ``unix-none`` VFS, which maps no shared memory (WAL's ``-shm`` is such
a mapping); processes exclude each other with ``flock`` on the directory instead (:mod:`.locking`,
:mod:`.connection`). Whatever another process does to the files gives misses, a logged error or a
reset index, never a fault. **A damaged index** (not a database, corrupt) is moved aside to
``index.sqlite3.damaged-<unix time>`` and started again empty, at open or whenever it is found later
(logged at WARNING, counted in ``stats().index_resets``); its payloads become orphans, swept as any.
An index replaced or removed by another process is reopened; one switched to WAL is converted back.

**The directory is untrusted input.** Whoever can write the index or the payload folder can spoil the
cache (lookups then miss) but nothing more:

- every row is validated before it is used (types, a key of whole int32 tokens, non-negative, a
  payload name matching ``ab/<32 hex>.llst`` exactly, sizes within what a state with that many tokens
  can be: ``STATE_BASE_BYTES + STATE_BYTES_PER_TOKEN`` per token, at most ``MAX_STATE_BYTES``);
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

Modules of the package (each states its own contract):

- :mod:`.cache`: :class:`LlamaDiskCache` itself, the façade: arguments, namespaces, the mapping
  protocol, statistics, maintenance, the fork and exit hooks;
- :mod:`.store`: what the façade and the helpers share: the lock, the connection, the view, payload
  reads, touches and deletes, the counters (no helper takes the façade);
- :mod:`.writes`: the write path: encode, write new files, commit with eviction, unlink what is freed;
- :mod:`.budget`: the byte budget: what the directory takes as ``du`` counts it, eviction until it fits;
- :mod:`.view`: the process's in-memory picture of the index, kept in step with the change log;
- :mod:`.schema`: the SQLite schema and its version, creation and migration, the change-log SQL;
- :mod:`.rows`: validation of untrusted index rows and the in-memory entry record;
- :mod:`.chunkstore`: chunk rows, links (reference counts) and their SQL;
- :mod:`.chunked`: writing a state as chunks and reading a chain back;
- :mod:`.reads`: reading an entry back (a whole payload, or a chain through :mod:`.chunked`), checked against its row;
- :mod:`.payloads`: payload files, opened and written safely, read or inflated;
- :mod:`.connection`: opening the index without shared memory, damage, moving a damaged index aside;
- :mod:`.locking`: the lock of the process's threads and of the directory's processes;
- write-behind: :mod:`llama_cache.caches.write_behind` (shared with the tiered cache), exit and fork hooks: :mod:`llama_cache.caches.lifecycle`;
- :mod:`.checker`: ``check()``, :class:`CheckReport`, ``storage()`` and the orphan sweep.

Names without a leading underscore in these modules are the package's internal interface: what one
module of the package uses of another (documented where defined); names with one are that module's
alone. Imports go one way: :mod:`.store` uses neither :mod:`.chunked` nor :mod:`.reads` nor :mod:`.writes`,
which take the store (the helpers that type their argument as a :class:`~.store.DiskStore` import it
for type checking only).
"""

from __future__ import annotations

# ``X as X``: names outside __all__ that tests and benchmarks import from here (layout and schema).
from llama_cache.caches.disk.cache import ORPHAN_GRACE_SECONDS as ORPHAN_GRACE_SECONDS
from llama_cache.caches.disk.cache import UNBOUND_NAMESPACE, LlamaDiskCache
from llama_cache.caches.disk.checker import CheckReport, StorageReport
from llama_cache.caches.disk.payloads import DATA_DIR as DATA_DIR
from llama_cache.caches.disk.rows import DiskEntry
from llama_cache.caches.disk.schema import ENTRY_COLUMNS as ENTRY_COLUMNS
from llama_cache.caches.disk.schema import SCHEMA_VERSION as SCHEMA_VERSION
from llama_cache.caches.disk.schema import INDEX_FILE, CacheDirectoryError

__all__ = [
    "INDEX_FILE",
    "UNBOUND_NAMESPACE",
    "CacheDirectoryError",
    "CheckReport",
    "DiskEntry",
    "LlamaDiskCache",
    "StorageReport",
]
