"""The Redis tier's chunk values: a fixed binary header and the chunk's tokens and KV, checksummed whole.

A chunk (:mod:`llama_cache.state.chunks`: its id, predecessor, position and tokens) is stored in Redis
as one value::

    header (HEADER_SIZE bytes, little-endian): magic "LLCR", version, namespace tag (8 bytes), layout
        digest (8), start, n_tokens, chunk id (16), previous id (16; zeros for a chain's first), XXH3-64 of the payload
    payload: tokens (int32 x n_tokens), then per layer its keys (n_tokens x k_row_bytes), then per
             layer its values (n_tokens x v_row_bytes; transposed layouts: n_embd_v x n_tokens x elem)

The payload is the disk tier's chunk payload; the header is what the Redis tier checks a value against,
packed with :mod:`struct` (no JSON to write or parse per chunk). Everything read back is untrusted:
:func:`decode_frame` checks the header against what the caller expects, the size against the layout,
the checksum over the whole payload in one call, and the id recomputed from the tokens, and raises
:class:`~llama_cache.state.format.CorruptStateError` for anything else.

**Copies.** :func:`encode_frame` writes a chunk into a caller's buffer in one pass: when a segment's
layers are equally spaced views of one buffer (llama.cpp's sequence state parsed by
:class:`~llama_cache.state.llama_state.LlamaState`: every layer the same row size), all its layers' keys
are copied by one numpy assignment, and all its values by another, instead of two per layer.
:func:`decode_frame` makes views into the value (no copy). Pure functions; :func:`layer_stacks`
results may be reused for every chunk of one state.
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import xxhash

from llama_cache.state.chunks import MAX_CHUNK_FILE_TOKENS, Piece, chunk_id, chunk_size, layout_to_json
from llama_cache.state.format import CorruptStateError
from llama_cache.state.kv_layout import Bytes, KVLayout, KVSegment

__all__ = ["HEADER_SIZE", "LayerStacks", "decode_frame", "encode_frame", "frame_namespace", "frame_size",
           "layer_stacks", "layout_digest", "namespace_tag"]

MAGIC = b"LLCR"
VERSION = 1
_HEADER = struct.Struct("<4sB3x8s8sII16s16sQ")
HEADER_SIZE = _HEADER.size  # 72


@functools.lru_cache(maxsize=64)
def namespace_tag(namespace: str) -> bytes:
    """The 8 bytes naming a namespace in a frame (the Redis keys' ``{ns}`` tag, as bytes)."""
    return hashlib.blake2b(namespace.encode(), digest_size=8).digest()


@functools.lru_cache(maxsize=16)
def layout_digest(layout: KVLayout) -> bytes:
    """The 8 bytes naming a KV layout in a frame (XXH3-64 of its canonical JSON)."""
    return xxhash.xxh3_64_digest(json.dumps(layout_to_json(layout), sort_keys=True).encode())


def frame_size(layout: KVLayout, n_tokens: int) -> int:
    """Bytes of the value of a chunk of ``n_tokens`` tokens."""
    return HEADER_SIZE + chunk_size(layout, n_tokens)


def frame_namespace(value: bytes | memoryview) -> bytes | None:
    """The namespace tag of a frame's header (None: not a frame); for :mod:`~llama_cache.caches.redis_sweep`."""
    if len(value) < HEADER_SIZE or bytes(value[:4]) != MAGIC:
        return None
    return bytes(value[8:16])


class LayerStacks(NamedTuple):
    """A segment's layers as one array each for keys and values (None: not equally spaced)."""

    k: npt.NDArray[np.uint8] | None  # (layers, tokens, row)
    v: npt.NDArray[np.uint8] | None  # (layers, tokens, row), or (layers, n_embd_v, tokens * elem) transposed


def _stacked(arrays: Sequence[Bytes]) -> npt.NDArray[np.uint8] | None:
    """``arrays`` as one read-only (len, *shape) view when they are equally spaced views of one buffer."""
    first = arrays[0]
    if first.dtype != np.uint8 or any(a.shape != first.shape or a.strides != first.strides for a in arrays):
        return None
    if len(arrays) == 1:
        return first[np.newaxis]
    addresses = [a.__array_interface__["data"][0] for a in arrays]
    step = addresses[1] - addresses[0]
    if step <= 0 or any(b - a != step for a, b in zip(addresses, addresses[1:])):
        return None
    return np.lib.stride_tricks.as_strided(first, shape=(len(arrays), *first.shape), strides=(step, *first.strides),
                                           writeable=False)


def layer_stacks(segment: KVSegment) -> LayerStacks:
    """The stacked views :func:`encode_frame` copies a segment's layers through. O(layers)."""
    return LayerStacks(_stacked(segment.k), _stacked(segment.v))


def _runs(segments: Sequence[KVSegment], start: int, end: int) -> list[tuple[int, int, int, int]]:
    """(segment index, first, last, offset in the chunk) of the runs covering positions ``[start, end)``."""
    runs = []
    offset = 0
    for index, segment in enumerate(segments):
        lo, hi = max(start, offset), min(end, offset + segment.n_tokens)
        if lo < hi:
            runs.append((index, lo - offset, hi - offset, lo - start))
        offset += segment.n_tokens
        if offset >= end:
            break
    return runs


def _copy_columns(target: npt.NDArray[np.uint8], source: npt.NDArray[np.uint8]) -> None:
    """``target[...] = source`` for slices of a few bytes of long rows (transposed values).

    Copied as one opaque element per row: numpy's byte-by-byte loop over such short runs was most of
    a store's copying time (``benchmarks/redis_tier.py``'s profile).
    """
    width = source.shape[-1]
    if width and source.strides[-1] == 1 and target.strides[-1] == 1:
        kind = np.dtype((np.void, width))
        np.copyto(target.view(kind), source.view(kind))
    else:
        target[...] = source


def encode_frame(namespace: str, piece: Piece, layout: KVLayout, segments: Sequence[KVSegment],
                 into: npt.NDArray[np.uint8], stacks: Sequence[LayerStacks] | None = None) -> memoryview:
    """Write the value of ``piece`` (its KV taken from a state's ``segments``) at the start of ``into``.

    ``stacks``: :func:`layer_stacks` of each segment, when the caller encodes several chunks of the
    same segments. Returns the value (a view of ``into``, valid until the next encoding into it).
    Complexity: one copy of the chunk's bytes (two numpy calls per run for equally spaced layers, two
    per layer and run otherwise) and one checksum pass.

    Raises:
        ValueError: ``into`` is too small, or the segments do not cover the chunk.
    """
    n = piece.n_tokens
    total = frame_size(layout, n)
    if len(into) < total:
        raise ValueError("the buffer is too small for the chunk")
    runs = _runs(segments, piece.start, piece.start + n)
    if sum(hi - lo for _, lo, hi, _ in runs) != n:
        raise ValueError("the segments do not cover the chunk")
    if stacks is None:
        stacks = [layer_stacks(segments[index]) for index, _, _, _ in runs] if runs else []
        by_index = {index: stack for (index, _, _, _), stack in zip(runs, stacks)}
    else:
        by_index = dict(enumerate(stacks))
    out = into[:total]
    offset = HEADER_SIZE
    out[offset : offset + 4 * n] = np.ascontiguousarray(piece.tokens, dtype="<i4").view(np.uint8)
    offset += 4 * n
    n_layer = len(layout.k_row_bytes)
    k_bytes = n * sum(layout.k_row_bytes)
    k_rows = set(layout.k_row_bytes)
    for index, lo, hi, at in runs:
        stack = by_index[index].k
        if stack is not None and len(k_rows) == 1:
            row = layout.k_row_bytes[0]
            out[offset : offset + k_bytes].reshape(n_layer, n, row)[:, at : at + hi - lo] = stack[:, lo:hi]
        else:
            position = offset
            for i, row in enumerate(layout.k_row_bytes):
                out[position : position + n * row].reshape(n, row)[at : at + hi - lo] = segments[index].k[i][lo:hi]
                position += n * row
    offset += k_bytes
    v_rows = set(layout.v_row_bytes)
    for index, lo, hi, at in runs:
        stack = by_index[index].v
        uniform = stack is not None and len(v_rows) == 1 and (
            not layout.v_trans or len(set(layout.v_elem_bytes)) == 1)
        if uniform and stack is not None:
            row = layout.v_row_bytes[0]
            if layout.v_trans:
                el = layout.v_elem_bytes[0]
                target = out[offset : offset + n * row * n_layer].reshape(n_layer, row // el, n * el)
                _copy_columns(target[:, :, at * el : (at + hi - lo) * el], stack[:, :, lo * el : hi * el])
            else:
                out[offset : offset + n * row * n_layer].reshape(n_layer, n, row)[:, at : at + hi - lo] = stack[:, lo:hi]
        else:
            position = offset
            for i, row in enumerate(layout.v_row_bytes):
                if layout.v_trans:
                    el = layout.v_elem_bytes[i]
                    target = out[position : position + n * row].reshape(layout.n_embd_v[i], n * el)
                    _copy_columns(target[:, at * el : (at + hi - lo) * el], segments[index].v[i][:, lo * el : hi * el])
                else:
                    out[position : position + n * row].reshape(n, row)[at : at + hi - lo] = segments[index].v[i][lo:hi]
                position += n * row
    view = memoryview(out)
    checksum = xxhash.xxh3_64_intdigest(view[HEADER_SIZE:])
    _HEADER.pack_into(out, 0, MAGIC, VERSION, namespace_tag(namespace), layout_digest(layout), piece.start, n,
                      piece.id, piece.prev, checksum)
    return view


class _Shape(NamedTuple):
    """What decoding a layout's frames needs, worked out once per layout."""

    digest: bytes
    token_bytes: int  # payload bytes per token: its id and its KV
    k_row: int | None  # every layer's key row, when they are all alike
    v_block: tuple[int, int] | None  # (rows, row bytes) per token of a layer's values, when all alike


@functools.lru_cache(maxsize=16)
def _layout_shape(layout: KVLayout) -> _Shape:
    k_rows, v_rows = set(layout.k_row_bytes), set(layout.v_row_bytes)
    v_block = None
    if len(v_rows) == 1 and len(set(layout.n_embd_v)) == 1:
        if not layout.v_trans:
            v_block = (1, layout.v_row_bytes[0])
        elif len(set(layout.v_elem_bytes)) == 1:
            v_block = (layout.n_embd_v[0], layout.v_elem_bytes[0])
    return _Shape(layout_digest(layout), 4 + layout.bytes_per_token, k_rows.pop() if len(k_rows) == 1 else None,
                  v_block)


_last_shape: tuple[KVLayout | None, _Shape | None] = (None, None)


def _shape(layout: KVLayout) -> _Shape:
    """:func:`_layout_shape`, with the layout of the last call recognised by identity (a lookup decodes
    all its chunks against one layout object; hashing the layout took a tenth of a chunk's decoding)."""
    global _last_shape
    last, shape = _last_shape
    if last is layout and shape is not None:
        return shape
    shape = _layout_shape(layout)
    _last_shape = (layout, shape)
    return shape


def decode_frame(value: bytes | memoryview, *, namespace: str, ident: bytes, prev: bytes, start: int,
                 layout: KVLayout, verify: bool = True) -> tuple[npt.NDArray[np.int32], KVSegment]:
    """The tokens and KV of a chunk value read from Redis, checked to be the chunk the caller expects.

    Views into ``value`` (which must stay alive, as the returned segment keeps it). Complexity: one
    checksum pass over the value (``verify``) and one chunk id; O(layers) views.
    Thread-safe.

    Raises:
        CorruptStateError: damaged, or not the expected chunk.
    """
    if len(value) < HEADER_SIZE:
        raise CorruptStateError("chunk value shorter than its header")
    magic, version, tag, digest, found_start, n_tokens, found_id, found_prev, checksum = _HEADER.unpack_from(value, 0)
    if magic != MAGIC or version != VERSION:
        raise CorruptStateError("not a chunk value of this version")
    # A chain's first chunk has no predecessor: its field is zeros (packing pads the empty id).
    if (tag, found_id, found_prev, found_start) != (namespace_tag(namespace), ident, prev.ljust(16, b"\0"), start):
        raise CorruptStateError("not the expected chunk")
    shape = _shape(layout)
    if digest != shape.digest:
        raise CorruptStateError("chunk of another KV layout")
    if not 0 < n_tokens <= MAX_CHUNK_FILE_TOKENS or len(value) != HEADER_SIZE + n_tokens * shape.token_bytes:
        raise CorruptStateError("chunk length does not match its header")
    data = np.frombuffer(value, dtype=np.uint8)
    if verify and xxhash.xxh3_64_intdigest(memoryview(data)[HEADER_SIZE:]) != checksum:
        raise CorruptStateError("chunk checksum mismatch")
    tokens = data[HEADER_SIZE : HEADER_SIZE + 4 * n_tokens].view("<i4")
    if tokens.min() < 0 or chunk_id(namespace, prev, tokens) != ident:
        raise CorruptStateError("chunk tokens do not match its id")
    offset = HEADER_SIZE + 4 * n_tokens
    n_layer = len(layout.k_row_bytes)
    k: tuple[Bytes, ...]
    v: tuple[Bytes, ...]
    if shape.k_row is not None:
        row = shape.k_row
        k = tuple(data[offset : offset + n_layer * n_tokens * row].reshape(n_layer, n_tokens, row))
        offset += n_layer * n_tokens * row
    else:
        parts = []
        for row in layout.k_row_bytes:
            parts.append(data[offset : offset + n_tokens * row].reshape(n_tokens, row))
            offset += n_tokens * row
        k = tuple(parts)
    if shape.v_block is not None:
        rows, width = shape.v_block
        block = data[offset : offset + n_layer * n_tokens * rows * width]
        if layout.v_trans:
            v = tuple(block.reshape(n_layer, rows, n_tokens * width))
        else:
            v = tuple(block.reshape(n_layer, n_tokens, width))
    else:
        parts = []
        for i, row in enumerate(layout.v_row_bytes):
            block = data[offset : offset + n_tokens * row]
            parts.append(block.reshape(layout.n_embd_v[i], n_tokens * layout.v_elem_bytes[i]) if layout.v_trans
                         else block.reshape(n_tokens, row))
            offset += n_tokens * row
        v = tuple(parts)
    return tokens, KVSegment(data, n_tokens, k, v)
