"""llama.cpp's per-sequence KV bytes, parsed into per-layer arrays that states can share.

``llama_state_seq_get_data`` serialises one sequence of a transformer KV cache as::

    u32 magic (0xaf143cd8), i32 seq_id
    u32 n_stream (1)
    u32 cell_count
    cell_count x (i32 pos, u32 n_seq_id = 1, i32 seq_id)
    u32 v_trans, u32 n_layer
    n_layer x (i32 k_type, u64 k_row_bytes, cell_count x k_row_bytes)
    v_trans == 0: n_layer x (i32 v_type, u64 v_row_bytes, cell_count x v_row_bytes)
    v_trans == 1: n_layer x (i32 v_type, u32 v_elem_bytes, u32 n_embd_v,
                             n_embd_v x cell_count x v_elem_bytes)

(``llama_kv_cache::state_write`` in the vendored llama.cpp). Parsing it into :class:`KVSegment`\\ s, one
run of consecutive positions each, lets a state extended by a few tokens keep its parent's segments and
own only the new one: a chat's next turn costs the memory of its new tokens, not a whole copy. Layouts
this module does not recognise (several streams, extra cell data, recurrent memory) are not parsed;
callers keep those states as opaque bytes.
"""

from __future__ import annotations

import mmap
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Bytes = npt.NDArray[np.uint8]

SEQ_STATE_MAGIC = 0xAF143CD8
_CELL = np.dtype([("pos", "<i4"), ("n_seq", "<u4"), ("seq", "<i4")])
CELL_BYTES = _CELL.itemsize  # per cell: position, sequence count (1), sequence id
_HEAD = struct.Struct("<IiII")  # magic, seq_id, n_stream, cell_count
_U32X2 = struct.Struct("<II")  # v_trans, n_layer
_ROW_HEADER = struct.Struct("<iQ")  # type, row bytes
_TRANS_HEADER = struct.Struct("<iII")  # type, element bytes, n_embd_v


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape of one model's per-sequence KV bytes (everything but the cells' contents)."""

    v_trans: bool
    k_types: tuple[int, ...]
    k_row_bytes: tuple[int, ...]
    v_types: tuple[int, ...]
    v_row_bytes: tuple[int, ...]  # bytes per cell; with v_trans, elem_bytes * n_embd_v
    v_elem_bytes: tuple[int, ...]  # with v_trans only, else zeros
    n_embd_v: tuple[int, ...]  # with v_trans only, else zeros

    @property
    def n_layer(self) -> int:
        return len(self.k_types)

    @property
    def bytes_per_token(self) -> int:
        return sum(self.k_row_bytes) + sum(self.v_row_bytes)

    def serialized_size(self, n_tokens: int) -> int:
        """Bytes of the llama.cpp serialisation of ``n_tokens`` cells in this layout."""
        if n_tokens == 0:
            return 16
        header = 16 + n_tokens * _CELL.itemsize + 8
        # Per layer: a 12-byte header before its keys and another before its values.
        return header + 24 * self.n_layer + n_tokens * self.bytes_per_token


@dataclass(frozen=True, slots=True)
class KVSegment:
    """The KV of ``n_tokens`` consecutive positions, every layer, in one buffer.

    ``k[i]`` is layer i's keys, shape (n_tokens, k_row_bytes); ``v[i]`` its values, shape
    (n_tokens, v_row_bytes) or, transposed, (n_embd_v, n_tokens * v_elem_bytes). All are views into
    ``buffer``; a truncated segment is a view too and keeps the same ``buffer``.
    """

    buffer: Bytes
    n_tokens: int
    k: tuple[Bytes, ...]
    v: tuple[Bytes, ...]

    def head(self, n_tokens: int, layout: KVLayout) -> KVSegment:
        """The first ``n_tokens`` positions of this segment, as views (no copy)."""
        if n_tokens == self.n_tokens:
            return self
        k = tuple(layer[:n_tokens] for layer in self.k)
        if layout.v_trans:
            v = tuple(layer[:, : n_tokens * el] for layer, el in zip(self.v, layout.v_elem_bytes))
        else:
            v = tuple(layer[:n_tokens] for layer in self.v)
        return KVSegment(self.buffer, n_tokens, k, v)

    def slice_copy(self, start: int, layout: KVLayout) -> KVSegment:
        """Positions ``start:`` of this segment, copied into a new buffer of their own."""
        n = self.n_tokens - start
        buffer = np.empty(n * layout.bytes_per_token, dtype=np.uint8)
        k: list[Bytes] = []
        v: list[Bytes] = []
        offset = 0
        for layer, row in zip(self.k, layout.k_row_bytes):
            view = buffer[offset : offset + n * row].reshape(n, row)
            view[...] = layer[start:]
            k.append(view)
            offset += n * row
        for i, layer in enumerate(self.v):
            size = n * layout.v_row_bytes[i]
            if layout.v_trans:
                el = layout.v_elem_bytes[i]
                view = buffer[offset : offset + size].reshape(layout.n_embd_v[i], n * el)
                view[...] = layer[:, start * el :]
            else:
                view = buffer[offset : offset + size].reshape(n, layout.v_row_bytes[i])
                view[...] = layer[start:]
            v.append(view)
            offset += size
        return KVSegment(buffer, n, tuple(k), tuple(v))


class _Reader:
    def __init__(self, data: Bytes) -> None:
        self.data = data
        self.offset = 0

    def scalar(self, dtype: str) -> int:
        size = np.dtype(dtype).itemsize
        if self.offset + size > len(self.data):
            raise ValueError("truncated")
        value = int(self.data[self.offset : self.offset + size].view(dtype)[0])
        self.offset += size
        return value

    def take(self, size: int) -> Bytes:
        if size < 0 or self.offset + size > len(self.data):
            raise ValueError("truncated")
        chunk = self.data[self.offset : self.offset + size]
        self.offset += size
        return chunk


def parse_seq_state(data: Bytes) -> tuple[KVLayout, KVSegment] | None:
    """Parse one sequence's KV bytes into a layout and a single segment of views into ``data``.

    Cells are put in position order. Returns None for anything this module does not handle (several
    streams, cells with extra data or several sequences, positions other than 0..n-1, trailing bytes),
    and for an empty sequence; callers then keep the bytes whole.

    Complexity: O(number of layers) Python work plus one gather when llama.cpp wrote cells out of
    position order; no copy otherwise.
    """
    try:
        reader = _Reader(data)
        if reader.scalar("<u4") != SEQ_STATE_MAGIC:
            return None
        reader.scalar("<i4")  # the sequence it was saved from; restoring names its own
        if reader.scalar("<u4") != 1:
            return None
        n = reader.scalar("<u4")
        if n == 0:
            return None
        cells = reader.take(n * _CELL.itemsize).view(_CELL)
        if not (cells["n_seq"] == 1).all():
            return None
        order = np.argsort(cells["pos"], kind="stable")
        if not np.array_equal(cells["pos"][order], np.arange(n)):
            return None
        in_order = bool((order == np.arange(n)).all())
        v_trans = reader.scalar("<u4")
        n_layer = reader.scalar("<u4")
        if v_trans not in (0, 1) or n_layer == 0:
            return None
        k_types, k_rows, k = [], [], []
        for _ in range(n_layer):
            k_types.append(reader.scalar("<i4"))
            row = reader.scalar("<u8")
            k_rows.append(row)
            block = reader.take(n * row).reshape(n, row)
            k.append(block if in_order else block[order])
        v_types, v_rows, v_els, v_embd, v = [], [], [], [], []
        for _ in range(n_layer):
            v_types.append(reader.scalar("<i4"))
            if v_trans:
                el = reader.scalar("<u4")
                embd = reader.scalar("<u4")
                plane = reader.take(embd * n * el).reshape(embd, n * el)
                if not in_order:
                    # Each element as one opaque item: numpy's gather of (embd, n, el) bytes went byte by
                    # byte, 12x slower (the state of an engine's sequence whose cells lie out of order).
                    plane = np.take(plane.view(np.dtype((np.void, el))), order, axis=1).view(np.uint8)
                v.append(plane)
                v_els.append(el)
                v_embd.append(embd)
                v_rows.append(el * embd)
            else:
                row = reader.scalar("<u8")
                block = reader.take(n * row).reshape(n, row)
                v.append(block if in_order else block[order])
                v_rows.append(row)
                v_els.append(0)
                v_embd.append(0)
        if reader.offset != len(data):
            return None
    except ValueError:
        return None
    layout = KVLayout(
        v_trans=bool(v_trans),
        k_types=tuple(k_types),
        k_row_bytes=tuple(k_rows),
        v_types=tuple(v_types),
        v_row_bytes=tuple(v_rows),
        v_elem_bytes=tuple(v_els),
        n_embd_v=tuple(v_embd),
    )
    return layout, KVSegment(data, n, tuple(k), tuple(v))


def serialize_segments(layout: KVLayout, segments: list[KVSegment], seq_id: int = 0) -> Bytes:
    """Assemble segments (consecutive, from position 0) into llama.cpp's per-sequence KV bytes.

    The inverse of :func:`parse_seq_state`: one pass, each byte copied once into a new buffer that the
    caller owns. To restore without allocating, assemble into a reused buffer with
    :func:`serialize_segments_into`.
    """
    n = sum(segment.n_tokens for segment in segments)
    out = np.empty(layout.serialized_size(n), dtype=np.uint8)
    return serialize_segments_into(layout, segments, out, seq_id)


def serialize_segments_into(layout: KVLayout, segments: list[KVSegment], out: Bytes, seq_id: int = 0) -> Bytes:
    """Assemble segments into the leading bytes of ``out``, as :func:`serialize_segments` does.

    Returns the view ``out[:layout.serialized_size(n_tokens)]``, which holds the bytes.

    Raises:
        ValueError: ``out`` is not a contiguous uint8 array or is too small.
    """
    n = sum(segment.n_tokens for segment in segments)
    size = layout.serialized_size(n)
    if out.dtype != np.uint8 or out.ndim != 1 or not out.flags.c_contiguous:
        raise ValueError("the target must be a contiguous 1-D uint8 array")
    if len(out) < size:
        raise ValueError(f"the target holds {len(out)} bytes; the state needs {size}")
    out = out[:size]
    _HEAD.pack_into(out, 0, SEQ_STATE_MAGIC, seq_id, 1, n)
    if n == 0:
        return out
    offset = 16
    cells = out[offset : offset + n * _CELL.itemsize].view(_CELL)
    cells["pos"] = np.arange(n)
    cells["n_seq"] = 1
    cells["seq"] = seq_id
    offset += n * _CELL.itemsize
    _U32X2.pack_into(out, offset, int(layout.v_trans), layout.n_layer)
    offset += 8
    # Rows of K (and of untransposed V) are contiguous per layer, and so is each segment's share of them:
    # one concatenation per layer copies every segment's share in C (states read back from many disk
    # chunks have a hundred segments or more).
    for i in range(layout.n_layer):
        row = layout.k_row_bytes[i]
        _ROW_HEADER.pack_into(out, offset, layout.k_types[i], row)
        offset += 12
        _concatenate([segment.k[i] for segment in segments], out[offset : offset + n * row].reshape(n, row), 0)
        offset += n * row
    for i in range(layout.n_layer):
        if layout.v_trans:
            el, embd = layout.v_elem_bytes[i], layout.n_embd_v[i]
            _TRANS_HEADER.pack_into(out, offset, layout.v_types[i], el, embd)
            offset += 12
            # Transposed V: one row per embedding dimension, each segment a run of columns.
            target = out[offset : offset + embd * n * el].reshape(embd, n * el)
            _concatenate([segment.v[i] for segment in segments], target, 1)
            offset += embd * n * el
        else:
            row = layout.v_row_bytes[i]
            _ROW_HEADER.pack_into(out, offset, layout.v_types[i], row)
            offset += 12
            _concatenate([segment.v[i] for segment in segments], out[offset : offset + n * row].reshape(n, row), 0)
            offset += n * row
    assert offset == size
    return out


def _concatenate(parts: list[Bytes], target: Bytes, axis: int) -> None:
    if len(parts) == 1:
        target[...] = parts[0]
    else:
        np.concatenate(parts, axis=axis, out=target)


def canonical_seq_id(data: Bytes, n_tokens: int) -> int | None:
    """The sequence id for which ``data`` (parsed bytes of ``n_tokens`` cells) is already exactly what
    :func:`serialize_segments` produces, or None: cells in position order, each of the recorded sequence.
    """
    seq_id = int(data[4:8].view("<i4")[0])
    cells = data[16 : 16 + n_tokens * _CELL.itemsize].view(_CELL)
    if np.array_equal(cells["pos"], np.arange(n_tokens)) and bool((cells["seq"] == seq_id).all()):
        return seq_id
    return None


# -- staging buffers -------------------------------------------------------------------------------

_PAGE = mmap.PAGESIZE


# Below this a buffer's first touch costs little next to a mapping of its own.
_PREFAULT_FROM = 1 << 20


def prefaulted(nbytes: int) -> Bytes:
    """A new writable ``nbytes`` buffer whose pages are already mapped (small ones: ``np.empty``).

    A freshly allocated buffer costs a page fault on each first touch: for a 28 MB state that is 60-100
    ms on the project's machine, where copying into touched memory takes 4-8 ms. Anonymous memory mapped
    with ``MAP_POPULATE`` is faulted in by the kernel in one call (about 6x cheaper than faulting each
    page on first write); elsewhere every byte is written once. The array owns its mapping, which is
    unmapped when the last view of it goes. Thread-safe.
    """
    if nbytes < _PREFAULT_FROM:
        return np.empty(max(0, nbytes), dtype=np.uint8)
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if populate and hasattr(mmap, "MAP_ANONYMOUS"):
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
        return np.frombuffer(mapping, dtype=np.uint8)  # the array keeps the mapping alive
    buffer = np.empty(nbytes, dtype=np.uint8)
    buffer.fill(0)
    return buffer


class StagingPool:
    """Reusable, pre-faulted buffers in which states are assembled for a restore.

    Assembling a state into fresh memory spends most of its time faulting pages in, not copying. A pool
    keeps a few buffers whose pages are already mapped and lends them out: a restore then costs one
    copy at memory speed every time, including a state's first restore.

    A borrowed buffer belongs to one borrower until it is given back, so any number of threads can
    borrow at once (a thread that finds no idle buffer large enough gets a new one). Buffers grow
    geometrically (by ``growth``, rounded up to whole pages), so a sequence of slowly growing states
    re-faults memory a logarithmic number of times. At most ``max_idle`` buffers are kept between
    borrows; the smallest are dropped first.

    Thread-safety: every method may be called from any thread; a lock guards the list of idle buffers
    only, never an allocation or a copy.
    """

    def __init__(self, max_idle: int = 2, growth: float = 1.5) -> None:
        if max_idle < 1:
            raise ValueError(f"max_idle must be at least 1, got {max_idle}")
        if growth < 1.0:
            raise ValueError(f"growth must be at least 1.0, got {growth}")
        self.max_idle = max_idle
        self.growth = growth
        self._idle: list[Bytes] = []  # sorted by size, smallest first
        self._lock = threading.Lock()
        self.allocations = 0
        """Buffers allocated (and faulted in) so far."""

    @property
    def idle_nbytes(self) -> int:
        """Bytes held by idle buffers."""
        with self._lock:
            return sum(len(buffer) for buffer in self._idle)

    def reserve(self, nbytes: int) -> None:
        """Make sure a later :meth:`borrow` of ``nbytes`` finds an idle buffer and faults nothing.

        Meant to be called off the restore path (when a state that will need assembling is made), so
        that the first restore of a state is as fast as later ones. Costs nothing when an idle buffer
        is large enough already.
        """
        with self._lock:
            if self._idle and len(self._idle[-1]) >= nbytes:
                return
            replaced = len(self._idle.pop()) if self._idle else 0
        self._give_back(self._allocate(nbytes, replaced))

    @contextmanager
    def borrow(self, nbytes: int) -> Iterator[Bytes]:
        """Lend a buffer of exactly ``nbytes`` (a view of a pooled one) for the duration of the block.

        The view must not be used after the block: the next borrower overwrites it.
        """
        if nbytes < 0:
            raise ValueError(f"cannot borrow {nbytes} bytes")
        buffer = self._take(nbytes)
        try:
            yield buffer[:nbytes]
        finally:
            self._give_back(buffer)

    def clear(self) -> None:
        """Drop every idle buffer; buffers lent out come back to the pool when their blocks end."""
        with self._lock:
            self._idle.clear()

    def _take(self, nbytes: int) -> Bytes:
        with self._lock:
            for index, buffer in enumerate(self._idle):
                if len(buffer) >= nbytes:
                    return self._idle.pop(index)
            # Too small, all of them: the largest is replaced by a larger one.
            replaced = len(self._idle.pop()) if self._idle else 0
        return self._allocate(nbytes, replaced)

    def _allocate(self, nbytes: int, replaced: int) -> Bytes:
        """A new buffer for ``nbytes``, ``growth`` times larger than the one it replaces if that is more."""
        with self._lock:
            self.allocations += 1
        capacity = max(nbytes, int(replaced * self.growth), 1)
        return prefaulted(-(-capacity // _PAGE) * _PAGE)

    def _give_back(self, buffer: Bytes) -> None:
        with self._lock:
            self._idle.append(buffer)
            self._idle.sort(key=len)
            if len(self._idle) > self.max_idle:
                del self._idle[: len(self._idle) - self.max_idle]
