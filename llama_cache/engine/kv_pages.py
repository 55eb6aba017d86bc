"""The KV pool's memory taken as its cells are used, not all at once when the context is made.

llama.cpp zeroes a context's KV buffer when it makes it (``ggml_backend_buffer_clear``), which would put
every page of the pool in memory: a 32,768-cell pool of the default model is 720 MiB of zeros before
its first request. A page of zeros handed back with ``madvise(MADV_DONTNEED)`` reads as zeros again (the
kernel maps a zero page at the next touch), so what the buffer holds is unchanged, and the pool's pages
come back one by one as its cells are first written. The process's resident memory then follows the
cells in use; an operator still plans for the whole pool, which it reaches as the cells fill.

:class:`KvPageWatch` does it in two parts around ``llama_init_from_model``:

- **While the context is made**, a thread looks every millisecond (``mincore``) at the pages llama.cpp
  has zeroed so far and hands them back, 2 MiB behind the zeroing. The whole pool is never resident
  at once: its start's peak is the model and the other buffers, not the pool. This is safe because the
  zeroing is the only writer of the buffer until the context is returned: whether a page is handed back
  before or after ``memset`` writes its zeros, it reads as zeros. Each range is also read (through
  ``/proc/self/mem``, which fails where memory is not mapped rather than faulting) and handed back only
  if it is zero, and only while the block's glibc header is still in place, 4 MiB at a time.
- **Once it is made**, :meth:`KvPageWatch.finish` hands back the rest, in the thread that made the
  context, before anyone uses it: the block must be the one block of the KV's size among the new
  mappings, and zero. Where the thread handed most of it back, only the pages still in memory are read
  (the others read as zeros); otherwise :func:`release_zeroed_block` reads every new page.

Which memory is the KV buffer is not in llama.cpp's API, so it is recognised: a block allocated while
the context was made (in address space that was not mapped before), laid out as glibc's
``posix_memalign(64, size)`` lays out a block it maps of its own (ggml's ``ggml_aligned_malloc``), of
exactly the KV cache's size (:func:`kv_bytes`), every page of it zero. Nothing else is touched: another
allocator, a KV on a GPU, a model whose cache this does not size (sliding-window or recurrent layers,
per-layer head counts) find no block and change nothing. Contexts are made one at a time in the process
(:data:`~llama_cache.context_lock.MAKING_CONTEXTS`, which ``llama_cache.Llama`` holds too), so no other
context of this package can be writing a block of the same size meanwhile. What the thread cannot rule
out: if llama.cpp fails to make the context, it frees the buffer, and another thread could map memory
of exactly that layout at that address and write it in the microseconds between a range's check and
its ``madvise``; and a context made with llama-cpp-python directly, in another thread at that moment.

Linux only (``/proc/self/maps``, ``/proc/self/mem``, ``mincore``, ``madvise``); elsewhere nothing is
handed back. Thread-safety: one :class:`KvPageWatch` per context being made, driven by the thread that
makes it; the context must not be used by another thread before :meth:`KvPageWatch.finish` returns.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import llama_cpp
import numpy as np
import numpy.typing as npt

from llama_cache.context_lock import MAKING_CONTEXTS
from llama_cache.engine.model import Model

__all__ = ["KvPageWatch", "anonymous_ranges", "kv_bytes", "pool_cells", "release_zeroed_block"]

logger = logging.getLogger(__name__)

Range = tuple[int, int]

_PAGE = mmap.PAGESIZE
_MAPS = Path("/proc/self/maps")
# glibc's posix_memalign(64, n) on a block it maps of its own: the mapping starts with a chunk header
# (size | IS_MMAPPED at byte 8), moved 48 bytes on for the alignment (48 at byte 48, the moved chunk's
# size | IS_MMAPPED at byte 56), and the caller's memory starts at byte 64.
_LEAD = 48
_USER_AT = 64
_IS_MMAPPED = 2
_F16_BYTES = 2
_SCAN_PIECE = 1 << 20  # bytes read at once: small, for the copies add to the moment the whole pool is resident
_MAX_SCAN = 1 << 36  # a mapping larger than this (a reservation, not a buffer) is not read
_MEMORY = "/proc/self/mem"
_POLL_SECONDS = 0.001
_WRITE_FRONT = 512  # the last pages zeroed so far (2 MiB: a huge page), left to the zeroing (it would fault again)
_FIND_SECONDS = 2.0  # how long after entering the thread looks for the block (none: a KV elsewhere, say)
_CHECK_PIECE = 4 << 20  # bytes checked, then handed back, at once while the context is made
_MAX_CANDIDATES = 4096  # pages read as possible block headers in one look


def anonymous_ranges() -> list[Range]:
    """The process's private, writable anonymous mappings as ``(start, end)``; empty where there is no
    ``/proc/self/maps``. O(mappings)."""
    try:
        lines = _MAPS.read_text().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split()
        if len(fields) == 5 and fields[1] == "rw-p" and fields[4] == "0":
            start, _, end = fields[0].partition("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def kv_bytes(model: Model, n_cells: int) -> int | None:
    """The size of llama.cpp's buffer of ``n_cells`` KV cells of ``model`` in half precision (its
    default), for a model whose every layer holds K and V of ``n_head_kv`` heads; None for a model with
    recurrent layers (other buffers)."""
    pointer = model.pointer
    if llama_cpp.llama_model_is_recurrent(pointer) or llama_cpp.llama_model_is_hybrid(pointer):
        return None
    n_head = int(llama_cpp.llama_model_n_head(pointer))
    n_head_kv = int(llama_cpp.llama_model_n_head_kv(pointer))
    if n_head <= 0 or n_head_kv <= 0:
        return None
    architecture = model.metadata.get("general.architecture", "")
    lengths = []
    for name in ("key", "value"):
        text = model.metadata.get(f"{architecture}.attention.{name}_length", "")
        lengths.append(int(text) if text.isdigit() else int(llama_cpp.llama_model_n_embd(pointer)) // n_head)
    return int(llama_cpp.llama_model_n_layer(pointer)) * n_cells * n_head_kv * sum(lengths) * _F16_BYTES


def release_zeroed_block(before: Sequence[Range], size: int) -> int:
    """Hand back the pages of the one block of ``size`` bytes, laid out as glibc's ``posix_memalign(64,
    size)`` maps it, found in memory mapped since ``before`` (:func:`anonymous_ranges`) and zero
    throughout. Returns the bytes handed back (0: no such block, or not zero throughout: nothing done).

    The caller guarantees that nothing else writes into the block meanwhile (see the module). O(the new
    mappings' pages) to find it, O(size) to check it.
    """
    if size < _PAGE:
        return 0
    blocks = [start for start, end in _new_ranges(before, anonymous_ranges())
              for start in _blocks_of(start, end, size)]
    if len(blocks) != 1:
        if blocks:
            logger.debug("kv pages: %d blocks of %d bytes were made; none released", len(blocks), size)
        return 0
    first, end = _user_pages(blocks[0], size)
    if not _all_zero(first, end):
        logger.debug("kv pages: the KV block at %#x holds data; not released", blocks[0])
        return 0
    if _madvise(first, end - first, mmap.MADV_DONTNEED) != 0:
        logger.debug("kv pages: madvise failed (errno %d)", ctypes.get_errno())
        return 0
    return end - first


def pool_cells(n_ctx: int, n_seq_max: int, unified: bool) -> int:
    """The cells llama.cpp gives a context asked for ``n_ctx`` cells (``llama_context``'s rule in
    llama.cpp as vendored by llama-cpp-python 0.3.36: a multiple of 256; without one unified pool, a
    stream of a multiple of 256 cells per sequence)."""
    n_ctx = -(-n_ctx // 256) * 256
    if unified or n_seq_max < 1:
        return n_ctx
    return -(-(n_ctx // n_seq_max) // 256) * 256 * n_seq_max


class KvPageWatch:
    """Hands back the pages of the KV buffer llama.cpp zeroes while it makes a context, as they are
    zeroed, and the rest once it is made (see the module)::

        with KvPageWatch(kv_bytes(model, pool_cells(n_ctx, n_seq_max, unified))) as watch:
            pointer = llama_cpp.llama_init_from_model(model.pointer, params)
            released = watch.finish(kv_bytes(model, llama_cpp.llama_n_ctx(pointer))) if pointer else 0

    Entering takes :data:`~llama_cache.context_lock.MAKING_CONTEXTS` (one context made at a time in
    the process), reads the process's mappings and, with ``follow``, starts a thread that calls
    :meth:`poll` every millisecond until :meth:`finish` or the block's end; no thread is started where
    nothing could be handed back (another OS, a model :func:`kv_bytes` does not size: ``size`` None).
    Leaving stops the thread and releases the lock. Ownership: the thread that makes the context owns
    the watch; :meth:`poll` may be called from any thread (one look at a time).
    """

    def __init__(self, size: int | None, *, follow: bool = True) -> None:
        if not hasattr(mmap, "MADV_DONTNEED"):
            size = None
        self.size = size if size is not None and size >= _PAGE else None
        """The bytes of the KV buffer looked for while the context is made (None: nothing is)."""
        self.follow = follow
        """Whether entering starts the thread (False: only :meth:`poll` calls look)."""
        self.before: list[Range] = []
        """The anonymous mappings when the watch was entered (before the context was made)."""
        self.block: int | None = None
        """Where the KV block starts, once :meth:`poll` has found it."""
        self.released_while_made = 0
        """Bytes handed back by :meth:`poll` (ranges handed back twice count twice)."""
        self._memory: int | None = None
        self._buffer = np.zeros(_CHECK_PIECE // 8, dtype=np.uint64)
        self._looking = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._entered_at = 0.0
        self._locked = False
        self._closed = False

    def __enter__(self) -> KvPageWatch:
        MAKING_CONTEXTS.acquire()
        self._locked = True
        self._entered_at = time.monotonic()
        if self.size is None:
            return self
        self.before = anonymous_ranges()
        if self.follow and self.before and self._open():
            thread = threading.Thread(target=self._follow, name="llama-cache-kv-pages", daemon=True)
            try:
                thread.start()
            except RuntimeError:  # no thread to be had: finish() still hands the pages back
                logger.debug("kv pages: no thread to follow the KV buffer", exc_info=True)
            else:
                self._thread = thread
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._stop_following()
        with self._looking:
            self._closed = True
            if self._memory is not None:
                os.close(self._memory)
                self._memory = None
        if self._locked:
            self._locked = False
            MAKING_CONTEXTS.release()

    def poll(self) -> int:
        """One look: find the block if it is not found yet (for at most :data:`_FIND_SECONDS` after
        entering), then hand back the ranges of it that are in memory and zero, but for the last
        :data:`_WRITE_FRONT` pages. Returns the bytes handed back. Never raises for what it reads;
        O(the new mappings' pages / 4,096) for ``mincore`` plus O(the bytes in memory) read."""
        with self._looking:
            if self.size is None or not self.before or not self._open():
                return 0
            if self.block is None:
                if time.monotonic() - self._entered_at > _FIND_SECONDS:
                    return 0
                self.block = self._find_block(self.size)
                if self.block is None:
                    return 0
            first, end = _user_pages(self.block, self.size)
            in_memory = _resident(first, end)
            if in_memory is None:
                return 0
            pages = np.flatnonzero(in_memory)
            released = 0
            for low, high in _runs_of(pages[: len(pages) - _WRITE_FRONT]):
                for at in range(first + low * _PAGE, first + high * _PAGE, _CHECK_PIECE):
                    length = min(_CHECK_PIECE, first + high * _PAGE - at)
                    if not (self._is_block(self.block, self.size) and self._zero(at, length)
                            and _madvise(at, length, mmap.MADV_DONTNEED) == 0):
                        self.released_while_made += released
                        return released
                    released += length
            self.released_while_made += released
            return released

    def finish(self, size: int | None) -> int:
        """Once the context is made, with a KV buffer of ``size`` bytes (:func:`kv_bytes` of its cells;
        None: not sized), inside the ``with`` block: stop the thread and hand back the rest of the
        buffer. Returns the buffer's bytes handed back, now or while it was made (0: no block found,
        or not zero throughout).

        Where the thread found the block and handed most of it back, only the pages still in memory
        are read: the block must be the one glibc-mapped block of ``size`` bytes among the new
        mappings' pages in memory (a block's header page is), and those of its pages must be zero
        (the others read as zeros). Otherwise :func:`release_zeroed_block` reads every new page."""
        self._stop_following()
        if size is None or not self.before or not hasattr(mmap, "MADV_DONTNEED"):
            return 0
        with self._looking:
            released = self._release_found(size) if self.block is not None and size == self.size else None
        if released is None:
            released = release_zeroed_block(self.before, size)
        logger.debug("kv pages: %d of the KV buffer's %d bytes handed back until their cells are used "
                     "(%d while the context was made)", released, size, self.released_while_made)
        return released

    def _stop_following(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _release_found(self, size: int) -> int | None:
        """:meth:`finish` for the block the thread found: the bytes handed back, 0 if it is not zero,
        None if that cannot be told from the pages in memory (too many of them, or another block)."""
        assert self.block is not None
        candidates: list[int] = []
        in_memory_count = 0
        for start, end in _new_ranges(self.before, anonymous_ranges()):
            if end - start > _MAX_SCAN:
                continue
            in_memory = _resident(start, end)
            if in_memory is None:
                return None
            pages = np.flatnonzero(in_memory)
            in_memory_count += len(pages)
            if in_memory_count > _MAX_CANDIDATES:
                return None
            candidates += [at for at in (start + int(page) * _PAGE for page in pages)
                           if at + _USER_AT + size <= end and self._is_block(at, size)]
        if candidates != [self.block]:
            return None
        first, end = _user_pages(self.block, size)
        in_memory = _resident(first, end)
        if in_memory is None:
            return None
        for low, high in _runs_of(np.flatnonzero(in_memory)):
            for at in range(first + low * _PAGE, first + high * _PAGE, _CHECK_PIECE):
                if not self._zero(at, min(_CHECK_PIECE, first + high * _PAGE - at)):
                    logger.debug("kv pages: the KV block at %#x holds data; not released", self.block)
                    return 0
        if _madvise(first, end - first, mmap.MADV_DONTNEED) != 0:
            return 0
        return end - first

    def _follow(self) -> None:
        while not self._stop.wait(_POLL_SECONDS):
            try:
                self.poll()
            except Exception:  # best effort: what the thread could not do, finish() still does
                logger.debug("kv pages: stopped following the KV buffer", exc_info=True)
                return

    def _open(self) -> bool:
        if self._memory is None and not self._closed:
            try:
                self._memory = os.open(_MEMORY, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return False
        return self._memory is not None

    def _find_block(self, size: int) -> int | None:
        """The start of a page in the new mappings that begins a run of pages in memory and holds the
        header of a glibc-mapped block of ``size`` bytes (glibc writes the header; llama.cpp then zeroes
        the block from its start up)."""
        for start, end in _new_ranges(self.before, anonymous_ranges()):
            if end - start < size + _USER_AT or end - start > _MAX_SCAN:
                continue
            in_memory = _resident(start, end)
            if in_memory is None:
                continue
            run_starts = np.flatnonzero(in_memory & ~np.concatenate(([False], in_memory[:-1])))
            for index in run_starts[:_MAX_CANDIDATES].tolist():
                at = start + index * _PAGE
                if at + _USER_AT + size <= end and self._is_block(at, size):
                    return at
        return None

    def _is_block(self, at: int, size: int) -> bool:
        """Whether ``at`` holds the header of a glibc-mapped ``posix_memalign(64, size)`` block."""
        header = self._read(at, _USER_AT)
        if header is None:
            return False
        return bool(_block_headers(header.view(np.uint64).reshape(1, -1), size)[0])

    def _zero(self, address: int, length: int) -> bool:
        piece = self._read(address, length)
        return piece is not None and not piece.any()

    def _read(self, address: int, length: int) -> npt.NDArray[np.uint8] | None:
        """``length`` (at most :data:`_CHECK_PIECE`) bytes at ``address`` read through ``/proc/self/mem``
        into the watch's buffer; None where they are not all mapped."""
        view = self._buffer.view(np.uint8)[:length]
        if self._memory is None:
            return None
        try:
            read = os.preadv(self._memory, [memoryview(view)], address)
        except OSError:
            return None
        return view if read == length else None


def _new_ranges(before: Sequence[Range], after: Sequence[Range]) -> list[Range]:
    """The parts of ``after`` that no range of ``before`` covers. O(len(before) x len(after)): a process
    has some hundreds of mappings."""
    old = sorted(before)
    new: list[Range] = []
    for start, end in sorted(after):
        cursor = start
        for old_start, old_end in old:
            if old_end <= cursor or old_start >= end:
                continue
            if old_start > cursor:
                new.append((cursor, old_start))
            cursor = max(cursor, old_end)
        if cursor < end:
            new.append((cursor, end))
    return new


def _blocks_of(start: int, end: int, size: int) -> list[int]:
    """The page-aligned addresses in ``[start, end)`` where a glibc-mapped ``posix_memalign(64, size)``
    block begins and ends inside the range."""
    if end - start < size + _USER_AT or end - start > _MAX_SCAN:
        return []
    found: list[int] = []
    for at in range(start, end, _SCAN_PIECE):
        pages = _copy(at, min(_SCAN_PIECE, end - at)).view(np.uint64).reshape(-1, _PAGE // 8)
        found += [at + int(index) * _PAGE for index in np.flatnonzero(_block_headers(pages, size))]
    return [block for block in found if block + _USER_AT + size <= end]


def _block_headers(words: npt.NDArray[np.uint64], size: int) -> npt.NDArray[np.bool_]:
    """Which rows of ``words`` (each a page's first 8 or more 64-bit words) hold the header of a
    glibc-mapped ``posix_memalign(64, size)`` block (see the layout above :data:`_LEAD`)."""
    # The mapped length: the block and glibc's 72 to 200 bytes before and after it, in whole pages.
    shortest, longest = (-(-(size + overhead) // _PAGE) * _PAGE for overhead in (_USER_AT + 8, _USER_AT + 136))
    lengths = (words[:, 7] & ~np.uint64(7)) + np.uint64(_LEAD)
    return ((words[:, 6] == _LEAD) & (words[:, 7] & np.uint64(7) == _IS_MMAPPED)
            & (words[:, 1] == lengths | np.uint64(_IS_MMAPPED)) & (lengths >= shortest) & (lengths <= longest))


def _all_zero(start: int, end: int) -> bool:
    return not any(_copy(at, min(_SCAN_PIECE, end - at)).any() for at in range(start, end, _SCAN_PIECE))


def _copy(address: int, length: int) -> npt.NDArray[np.uint8]:
    """A copy of ``length`` bytes at ``address``, read holding the GIL (``ctypes.string_at``): no Python
    thread can unmap memory meanwhile (a page read for the first time maps the zero page, nothing more)."""
    return np.frombuffer(ctypes.string_at(address, length), dtype=np.uint8)


def _user_pages(block: int, size: int) -> Range:
    """The whole pages of a ``posix_memalign(64, size)`` block's memory (not its header's page)."""
    return (block + _USER_AT + _PAGE - 1) // _PAGE * _PAGE, (block + _USER_AT + size) // _PAGE * _PAGE


def _runs_of(pages: npt.NDArray[np.intp]) -> list[tuple[int, int]]:
    """``[low, high)`` runs of consecutive page numbers in the sorted ``pages``."""
    if not len(pages):
        return []
    breaks = np.flatnonzero(np.diff(pages) != 1)
    starts = np.concatenate((pages[:1], pages[breaks + 1]))
    ends = np.concatenate((pages[breaks], pages[-1:])) + 1
    return list(zip(starts.tolist(), ends.tolist()))


def _resident(start: int, end: int) -> npt.NDArray[np.bool_] | None:
    """Which pages of ``[start, end)`` (page-aligned) are in memory (``mincore``); None if it fails (a
    part is not mapped)."""
    libc = _libc()
    vector = np.zeros((end - start) // _PAGE, dtype=np.uint8)
    if libc is None or not len(vector) or libc.mincore(start, end - start, vector.ctypes.data) != 0:
        return None
    return (vector & 1).astype(bool)


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    """libc with ``mincore`` and ``madvise`` declared; None where there is none to call."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, TypeError, AttributeError):
        return None
    libc.mincore.restype = ctypes.c_int
    libc.madvise.restype = ctypes.c_int
    return libc


def _madvise(address: int, length: int, advice: int) -> int:
    """libc's ``madvise``; -1 where there is none to call."""
    libc = _libc()
    return -1 if libc is None else int(libc.madvise(address, length, advice))
