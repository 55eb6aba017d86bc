"""The KV pool's memory as it is used: pages of cells never written are given back to the system.

llama.cpp allocates a context's whole KV buffer at once and zero-fills it (``llama_kv_cache``'s
constructor, so that unused cells read as zeros, not NaNs), which makes every page of it resident: an
engine with a 32,768-cell pool holds 720 MiB of KV for the default model before its first request,
and ``llama-server`` the same. Pages that are still all zeros can be handed back with
``madvise(MADV_DONTNEED)``: a private anonymous page read after that is a fresh zero page, so the
buffer's contents are unchanged for llama.cpp, and memory then grows with the cells written (a page
is mapped again when a cell in it is first written, and stays: memory follows the pool's high-water
mark, not the cells in use now).

What it does not change: the peak. The zero-fill makes every page resident for a moment while the
context is made, before anything can be given back, so a process's peak resident set (``VmHWM``, a
container's memory limit) still includes the whole pool once.

The buffer's address is not in llama.cpp's API, so :func:`locate` finds it: one token is decoded into
sequence 0 (cell 0), its K and V rows are read back with the state API, the first layer's K row is
searched for in the memory mapped while the context was made, the buffer's layout (every layer's K
then V tensor, ``row bytes x cells`` each, in layer order) is checked at every layer's offset, and a
random K row written through the context must then show at the address found. Anything unexpected
(another layout, no match or several, a recurrent, sliding-window or encoder model, another OS)
finds nothing, and the pages stay resident as they would anyway; so does a small buffer (under
glibc's 32 MiB mmap threshold) that the allocator took from memory it already held.

Only the context's own KV buffer is ever discarded, and only while the context is idle (no decode
runs): no other object's memory and no concurrent write can be affected. Memory is read only through
``process_vm_readv``, so a range another thread unmaps meanwhile is a failed read, not a crash. On a
system whose transparent huge pages are ``always``, khugepaged may fill given-back ranges in again.

Linux only (``/proc/self/maps``, ``madvise``); elsewhere :func:`mapped_ranges` is empty and
:func:`locate` finds nothing. Not thread-safe: call on the thread that owns the context.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np
import numpy.typing as npt

from llama_cache.state.kv_layout import KVLayout, KVSegment, parse_seq_state

__all__ = ["KVPages", "Ranges", "locate", "locate_single", "mapped_ranges", "new_ranges"]

logger = logging.getLogger(__name__)

Ranges = list[tuple[int, int]]
"""Address ranges ``[start, end)``, sorted, not overlapping."""

_PAGE = mmap.PAGESIZE
_BLOCK = 64 << 10  # discard granularity: a 64 KiB block is given back only if all of it is zero
_SEARCH_CHUNK = 4 << 20  # bytes copied and compared at a time while searching (bounds the memory it takes)
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)


def mapped_ranges() -> Ranges:
    """The process's private, writable, anonymous mappings now, the heap among them, adjacent ones
    merged (``/proc/self/maps``); empty where that file does not exist. O(mappings)."""
    if not sys.platform.startswith("linux"):
        return []
    ranges: Ranges = []
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) < 5 or not fields[1].startswith("rw") or fields[1][3] != "p" or fields[4] != "0":
                    continue
                if len(fields) == 6 and not fields[5].strip().startswith(("[anon", "[heap]")):
                    continue  # stacks, files
                start, end = (int(value, 16) for value in fields[0].split("-"))
                ranges.append((start, end))
    except OSError:
        return []
    merged: Ranges = []
    for start, end in sorted(ranges):  # one allocation may span several adjacent mappings
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def new_ranges(before: Ranges, after: Ranges) -> Ranges:
    """The addresses in ``after`` that are in no range of ``before``. O(len(before) + len(after))."""
    out: Ranges = []
    i = 0
    for start, end in after:
        while i < len(before) and before[i][1] <= start:
            i += 1
        cursor, j = start, i
        while cursor < end:
            if j < len(before) and before[j][0] < end:
                old_start, old_end = before[j]
                if old_start > cursor:
                    out.append((cursor, old_start))
                cursor = max(cursor, old_end)
                j += 1
            else:
                out.append((cursor, end))
                break
    return out


@dataclass(frozen=True)
class KVPages:
    """A context's KV buffer, found by :func:`locate`: ``start`` and ``size`` in bytes."""

    start: int
    size: int

    def zero(self) -> None:
        """Make the whole buffer zeros, as llama.cpp's clear with data does, without making its pages
        resident: its whole pages are given back (they read as zeros), the partial pages at its ends
        are zero-filled. Call only while the context is idle. One ``madvise``."""
        first = -(-self.start // _PAGE) * _PAGE
        last = (self.start + self.size) // _PAGE * _PAGE
        madvise = _madvise()
        if last <= first or madvise is None or madvise(first, last - first, _MADV_DONTNEED) != 0:
            ctypes.memset(self.start, 0, self.size)
            return
        ctypes.memset(self.start, 0, first - self.start)
        ctypes.memset(last, 0, self.start + self.size - last)

    def release_zero_pages(self) -> int:
        """Give back every 64 KiB block of the buffer that holds only zeros; the bytes given back.
        Call only while the context is idle. O(buffer) reads, one ``madvise`` per such block."""
        first = -(-self.start // _BLOCK) * _BLOCK
        last = (self.start + self.size) // _BLOCK * _BLOCK
        madvise = _madvise()
        if last <= first or madvise is None:
            return 0
        blocks = _view(first, last - first, np.uint64).reshape(-1, _BLOCK // 8)
        released = 0
        run_start: int | None = None
        for index, used in enumerate(blocks.any(axis=1).tolist() + [True]):
            if not used and run_start is None:
                run_start = index
            elif used and run_start is not None:
                length = (index - run_start) * _BLOCK
                if madvise(first + run_start * _BLOCK, length, _MADV_DONTNEED) == 0:
                    released += length
                run_start = None
        return released


Probe = Callable[[], "npt.NDArray[np.uint8] | None"]
"""Writes one token into the new context's empty sequence 0 and returns that sequence's state
(``llama_state_seq_get_data``), or None; the token stays until the caller empties the sequence."""

Rewrite = Callable[["npt.NDArray[np.uint8]"], bool]
"""Empties sequence 0 and writes the given one-token state into it (``llama_state_seq_set_data``);
False if llama.cpp refused it."""


def locate(candidates: Ranges, probe: Probe, rewrite: Rewrite, n_cells: int, n_streams: int = 1) -> KVPages | None:
    """Find the KV buffer of a context made while the ``candidates`` ranges were mapped.

    Args:
        candidates: memory mapped while the context was made (:func:`new_ranges`).
        probe: see :data:`Probe`.
        rewrite: see :data:`Rewrite`. The buffer is confirmed by writing the probe's state with its
            first K row replaced by random bytes and reading them back at the address found: only
            this context can have written them. The caller empties sequence 0 afterwards.
        n_cells: the context's KV cells, all streams together.
        n_streams: its KV streams (a transposed V is checked with one stream only).

    Returns:
        The buffer, or None when it cannot be found with certainty (see the module's docstring); a
        failure on the way is None too (logged): this only saves memory.
    """
    try:
        return _locate(candidates, probe, rewrite, n_cells, n_streams)
    except Exception as error:  # noqa: BLE001 - saving memory must never fail the context's creation
        logger.debug("the KV buffer could not be located: %s: %s", type(error).__name__, error)
        return None


def _locate(candidates: Ranges, probe: Probe, rewrite: Rewrite, n_cells: int, n_streams: int) -> KVPages | None:
    if not candidates or n_cells < 1:
        return None
    state = probe()
    parsed = parse_seq_state(state) if state is not None else None
    if parsed is None:
        return None
    layout, segment = parsed
    if segment.n_tokens != 1 or (layout.v_trans and n_streams != 1):
        return None
    offsets, size = _offsets(layout, n_cells)
    reader = _Reader.make()
    if reader is None:
        return None
    row = np.ascontiguousarray(segment.k[0][0])
    words = row[: len(row) // 8 * 8].view(np.uint64)
    nonzero = np.flatnonzero(words)
    if not len(nonzero):
        return None
    at = int(nonzero[0])
    found: list[int] = []
    for start, end in candidates:
        if end - start < size:
            continue
        for address in _matches(reader, start, end, int(words[at])):
            base = address - 8 * at
            if start <= base and base + size <= end and _laid_out(reader, base, layout, segment, offsets, n_cells):
                found.append(base)
    if not found or len(found) > 16:
        logger.debug("the KV buffer was not found (%d candidates); its pages stay resident", len(found))
        return None
    # The same bytes could sit in another context of the same model made meanwhile: write a nonce
    # through this context and keep the one candidate where it shows.
    marked = np.array(state, dtype=np.uint8, copy=True)
    parsed = parse_seq_state(marked)
    if parsed is None or not np.shares_memory(parsed[1].k[0], marked):
        return None
    nonce = np.frombuffer(os.urandom(len(row)), dtype=np.uint8)
    parsed[1].k[0][0][:] = nonce
    if not rewrite(marked):
        return None
    confirmed = [base for base in found if reader.equals(base, nonce)]
    if len(confirmed) != 1:
        logger.debug("the KV buffer was not confirmed (%d of %d candidates)", len(confirmed), len(found))
        return None
    return KVPages(confirmed[0], size)


def locate_single(made: Ranges, context: Any, model: Any) -> KVPages | None:
    """:func:`locate` for a new one-stream llama.cpp context (``llama_cpp.Llama``'s) of a decoder-only
    transformer model without sliding-window layers; None for anything else (a context without
    memory, e.g. ``vocab_only``, among them). Writes into its sequence 0 and empties it again, so the
    context must be empty and idle."""
    memory = llama_cpp.llama_get_memory(context) if context else None
    if (not made or not memory or llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model)
            or llama_cpp.llama_model_has_encoder(model) or int(llama_cpp.llama_model_n_swa(model)) > 0
            or int(llama_cpp.llama_n_seq_max(context)) != 1):
        return None

    def probe() -> npt.NDArray[np.uint8] | None:
        token = (llama_cpp.llama_token * 1)(max(0, int(llama_cpp.llama_vocab_bos(llama_cpp.llama_model_get_vocab(model)))))
        if llama_cpp.llama_decode(context, llama_cpp.llama_batch_get_one(token, 1)) != 0:
            return None
        size = int(llama_cpp.llama_state_seq_get_size(context, 0))
        data = np.empty(size, dtype=np.uint8)
        written = llama_cpp.llama_state_seq_get_data(context, data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, 0)
        return data if written == size else None

    def rewrite(data: npt.NDArray[np.uint8]) -> bool:
        llama_cpp.llama_memory_seq_rm(memory, 0, 0, -1)
        read = llama_cpp.llama_state_seq_set_data(context, data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                                                  len(data), 0)
        return int(read) == len(data)

    try:
        return locate(made, probe, rewrite, int(llama_cpp.llama_n_ctx(context)))
    finally:
        llama_cpp.llama_memory_seq_rm(memory, 0, 0, -1)


def _offsets(layout: KVLayout, n_cells: int) -> tuple[list[tuple[int, int]], int]:
    """Each layer's (K offset, V offset) in the buffer, and its size: K then V, layer after layer."""
    offsets: list[tuple[int, int]] = []
    cursor = 0
    for k_row, v_row in zip(layout.k_row_bytes, layout.v_row_bytes):
        offsets.append((cursor, cursor + k_row * n_cells))
        cursor += (k_row + v_row) * n_cells
    return offsets, cursor


def _laid_out(reader: _Reader, base: int, layout: KVLayout, segment: KVSegment, offsets: list[tuple[int, int]],
              n_cells: int) -> bool:
    """Whether cell 0's K and V rows of every layer are where the layout puts them from ``base``."""
    for layer, (k_offset, v_offset) in enumerate(offsets):
        if not reader.equals(base + k_offset, np.ascontiguousarray(segment.k[layer][0])):
            return False
        if layout.v_trans:
            # Transposed: cell 0's value of dimension e is the first element of the e-th row of cells.
            element = layout.v_elem_bytes[layer]
            rows = np.ascontiguousarray(segment.v[layer][:, :element])
            for dimension in range(rows.shape[0]):
                if not reader.equals(base + v_offset + dimension * n_cells * element, rows[dimension]):
                    return False
        elif not reader.equals(base + v_offset, np.ascontiguousarray(segment.v[layer][0])):
            return False
    return True


def _matches(reader: _Reader, start: int, end: int, word: int) -> list[int]:
    """Addresses in ``[start, end)``, 8-aligned, holding the 64-bit ``word`` (at most 17)."""
    found: list[int] = []
    first = -(-start // 8) * 8
    for chunk in range(first, end - 7, _SEARCH_CHUNK):
        data = reader.read(chunk, min(_SEARCH_CHUNK, end - chunk) // 8 * 8)
        if data is None:
            break
        hits = np.flatnonzero(data.view(np.uint64) == np.uint64(word))
        found.extend(chunk + 8 * int(hit) for hit in hits[:17])
        if len(found) > 16:
            break
    return found


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


class _Reader:
    """Reads the process's own memory with ``process_vm_readv``: an address unmapped meanwhile (by
    another thread) is a failed read, not a crash."""

    def __init__(self, function: Any) -> None:
        self._function = function
        self._buffer = np.empty(0, dtype=np.uint8)
        self._pid = os.getpid()

    @classmethod
    def make(cls) -> _Reader | None:
        try:
            function = ctypes.CDLL(None, use_errno=True).process_vm_readv
        except (OSError, AttributeError):
            return None
        function.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.POINTER(_IOVec),
                             ctypes.c_ulong, ctypes.c_ulong]
        function.restype = ctypes.c_ssize_t
        return cls(function)

    def read(self, address: int, nbytes: int) -> npt.NDArray[np.uint8] | None:
        """``nbytes`` at ``address``, in a buffer reused by the next read; None if not all readable."""
        if nbytes <= 0:
            return None
        if len(self._buffer) < nbytes:
            self._buffer = np.empty(nbytes, dtype=np.uint8)
        local = _IOVec(self._buffer.ctypes.data, nbytes)
        remote = _IOVec(address, nbytes)
        done = self._function(self._pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        return self._buffer[:nbytes] if done == nbytes else None

    def equals(self, address: int, expected: npt.NDArray[np.uint8]) -> bool:
        data = self.read(address, len(expected))
        return data is not None and np.array_equal(data, expected)


def _view(address: int, nbytes: int, dtype: type[np.generic]) -> npt.NDArray[Any]:
    """A numpy view of ``nbytes`` at ``address`` (the located buffer: valid while its context lives)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address)).view(dtype)


def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function  # type: ignore[no-any-return]
