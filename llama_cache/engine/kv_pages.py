"""The KV pool's memory taken as its cells are used, not all at once when the context is made.

llama.cpp zeroes a context's KV buffer when it makes it (``ggml_backend_buffer_clear``), which puts
every page of the pool in memory: a 32,768-cell pool of the default model holds 720 MiB of zeros before
its first request. A page of zeros handed back with ``madvise(MADV_DONTNEED)`` reads as zeros again (the
kernel maps a zero page at the next touch), so what the buffer holds is unchanged, and the pool's pages
come back one by one as its cells are first written. The process's resident memory then follows the
cells in use; an operator still plans for the whole pool, which it reaches as the cells fill.

Which memory is the KV buffer is not in llama.cpp's API, so it is recognised: a block allocated while
the context was made (in address space that was not mapped before), laid out as glibc's
``posix_memalign(64, size)`` lays out a block it maps of its own (ggml's ``ggml_aligned_malloc``), of
exactly the KV cache's size (:func:`kv_bytes`), every page of it zero. Nothing else is touched: another
allocator, a KV on a GPU, a model whose cache this does not size (sliding-window or recurrent layers,
per-layer head counts) find no block and change nothing. The block is released in the thread that made
the context, before the context is used or handed to anyone: nothing else can write into it meanwhile.
The new mappings are read in copies of 1 MiB made holding the GIL (no Python thread can unmap them
meanwhile): a KV buffer of 720 MiB takes about 0.3 s more to make.

Linux only (``/proc/self/maps``, ``madvise``); elsewhere :func:`release_zeroed_kv` returns 0.
Stateless; thread-safe as long as the context being made is not used by another thread yet.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from collections.abc import Sequence
from pathlib import Path

import llama_cpp
import numpy as np
import numpy.typing as npt

from llama_cache.engine.model import Model

__all__ = ["anonymous_ranges", "kv_bytes", "release_zeroed_block", "release_zeroed_kv"]

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
    first = (blocks[0] + _USER_AT + _PAGE - 1) // _PAGE * _PAGE
    end = (blocks[0] + _USER_AT + size) // _PAGE * _PAGE
    if not _all_zero(first, end):
        logger.debug("kv pages: the KV block at %#x holds data; not released", blocks[0])
        return 0
    if _madvise(first, end - first, mmap.MADV_DONTNEED) != 0:
        logger.debug("kv pages: madvise failed (errno %d)", ctypes.get_errno())
        return 0
    return end - first


def release_zeroed_kv(before: Sequence[Range], model: Model, n_cells: int) -> int:
    """:func:`release_zeroed_block` for the KV buffer of a context of ``n_cells`` cells of ``model``
    just made (``before``: :func:`anonymous_ranges` read before making it). The bytes handed back."""
    size = kv_bytes(model, n_cells)
    if size is None or not before or not hasattr(mmap, "MADV_DONTNEED"):
        return 0
    released = release_zeroed_block(before, size)
    logger.debug("kv pages: %d of the KV buffer's %d bytes handed back until their cells are used", released, size)
    return released


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
    # The mapped length: the block and glibc's 72 to 200 bytes before and after it, in whole pages.
    shortest, longest = (-(-(size + overhead) // _PAGE) * _PAGE for overhead in (_USER_AT + 8, _USER_AT + 136))
    found: list[int] = []
    for at in range(start, end, _SCAN_PIECE):
        pages = _copy(at, min(_SCAN_PIECE, end - at)).view(np.uint64).reshape(-1, _PAGE // 8)
        lengths = (pages[:, 7] & ~np.uint64(7)) + np.uint64(_LEAD)
        hits = np.flatnonzero((pages[:, 6] == _LEAD) & (pages[:, 7] & np.uint64(7) == _IS_MMAPPED)
                              & (pages[:, 1] == lengths | np.uint64(_IS_MMAPPED))
                              & (lengths >= shortest) & (lengths <= longest))
        found += [at + int(index) * _PAGE for index in hits]
    return [block for block in found if block + _USER_AT + size <= end]


def _all_zero(start: int, end: int) -> bool:
    return not any(_copy(at, min(_SCAN_PIECE, end - at)).any() for at in range(start, end, _SCAN_PIECE))


def _copy(address: int, length: int) -> npt.NDArray[np.uint8]:
    """A copy of ``length`` bytes at ``address``, read holding the GIL (``ctypes.string_at``): no Python
    thread can unmap memory meanwhile (a page read for the first time maps the zero page, nothing more)."""
    return np.frombuffer(ctypes.string_at(address, length), dtype=np.uint8)


def _madvise(address: int, length: int, advice: int) -> int:
    """libc's ``madvise``; -1 where there is none to call."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except (OSError, TypeError):
        return -1
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return int(libc.madvise(address, length, advice))
