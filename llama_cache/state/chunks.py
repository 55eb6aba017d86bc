"""A transformer state's KV as a chain of content-addressed chunks, and the chunks' binary format.

A state of ``n`` tokens is cut into chunks of ``C`` tokens (positions ``[k*C, (k+1)*C)``) and, when ``C``
does not divide ``n``, a last *partial* chunk of the remaining tokens. A chunk's id is

    blake2b-128(namespace, previous chunk's id, the chunk's tokens)

chained from the first chunk (whose previous id is empty), as vLLM's block hashes and LMCache's chunk
keys are: equal prefixes of any two states have equal chunk ids, so a store keeps each shared prefix
once, and any process computes the ids of a query's full chunks from its tokens alone. The id binds a
chunk's KV to every token before it, so a chunk can only be found for the exact prefix that made it.
BLAKE2b (not a faster non-cryptographic hash) because prompts are chosen by users: crafting two token
sequences with the same id must be infeasible, or one user's prompt could be answered with another's KV.

A partial chunk is a chunk too (same id rule, fewer tokens); a state that uses only the first ``m``
tokens of a longer chunk at its last position can use that chunk: positions are implied by the chain,
and the KV of a position depends only on the tokens up to it.

**Chunk files** (:func:`encode_chunk`, :func:`decode_chunk`) use the framing of
:mod:`llama_cache.state.format` (magic, version, kind ``KIND_CHUNK``, lengths, XXH3-64 checksum) with::

    header: JSON {namespace, id (hex), prev (hex), start, n_tokens, layout}
    payload: tokens (int32 x n_tokens), then per layer its keys (n_tokens x k_row_bytes), then per
             layer its values (n_tokens x v_row_bytes; transposed layouts: n_embd_v x n_tokens x elem)

**Chain heads** (:func:`encode_head`, :func:`decode_head`), kind ``KIND_CHUNKED``, hold what an entry
keeps besides its chunks::

    header: JSON {fingerprint, seed, n_tokens, n_vocab, chunk_tokens, layout}
    payload: tokens (int32 x n_tokens), logits (float32 x n_vocab, absent when n_vocab is 0)

Decoding validates everything against what the caller expects (the id recomputed from the tokens, the
tokens of the entry, the layout of the head) and builds views into the given buffer (no copy).

Pure functions, no I/O; shared by every tier that stores chunks.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from llama_cache.state.format import PREFIX_SIZE, CorruptStateError, _field, _framed, _open, _pack_prefix
from llama_cache.state.kv_layout import Bytes, KVLayout, KVSegment
from llama_cache.state.llama_state import LlamaState

KIND_CHUNKED = 2  # a chain head
KIND_CHUNK = 3  # a chunk
ID_BYTES = 16
CHUNK_BYTES_TARGET = 512 << 10  # the default chunk size aims at this many bytes of KV...
MIN_CHUNK_TOKENS, MAX_CHUNK_TOKENS = 4, 256  # ...within these bounds (see default_chunk_tokens)
MAX_CHUNK_FILE_TOKENS = 1 << 16  # the longest chunk any reader accepts (chunk_tokens is bounded by it)

TokenArray = npt.NDArray[np.int32]


def default_chunk_tokens(layout: KVLayout) -> int:
    """The chunk length for a model: the largest power of two whose KV fits ``CHUNK_BYTES_TARGET``.

    16 tokens (368 KB) for the default model; a 7B model with 512 KB of KV per token gets 4 (2 MiB).
    Small chunks waste little at branch points and keep bytes rewritten per store low; the target
    keeps a chunk a size that one file write and one Redis value handle well. ``benchmarks/dedup.py``
    measures the alternatives.
    """
    per_token = max(1, layout.bytes_per_token)
    tokens = MIN_CHUNK_TOKENS
    while tokens * 2 <= MAX_CHUNK_TOKENS and tokens * 2 * per_token <= CHUNK_BYTES_TARGET:
        tokens *= 2
    return tokens


def chunk_id(namespace: str, prev: bytes, tokens: TokenArray) -> bytes:
    """The id of the chunk holding ``tokens`` after the chunk ``prev`` (empty for a chain's first)."""
    digest = hashlib.blake2b(digest_size=ID_BYTES, person=b"llama-cache-kv")
    name = namespace.encode()
    digest.update(len(name).to_bytes(4, "little"))
    digest.update(name)
    digest.update(len(prev).to_bytes(1, "little"))
    digest.update(prev)
    digest.update(np.ascontiguousarray(tokens, dtype="<i4").tobytes())
    return digest.digest()


def chain_ids(namespace: str, tokens: TokenArray, chunk_tokens: int) -> list[bytes]:
    """The ids of the full chunks of ``tokens`` (``len(tokens) // chunk_tokens`` of them), in order.

    Complexity: O(len(tokens)).
    """
    ids: list[bytes] = []
    prev = b""
    for start in range(0, len(tokens) - chunk_tokens + 1, chunk_tokens):
        prev = chunk_id(namespace, prev, tokens[start : start + chunk_tokens])
        ids.append(prev)
    return ids


@dataclass(frozen=True, slots=True)
class Piece:
    """One chunk of a state to store: its id, the previous chunk's id, its position and tokens."""

    id: bytes
    prev: bytes
    start: int
    tokens: TokenArray

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


def pieces(namespace: str, tokens: TokenArray, chunk_tokens: int) -> list[Piece]:
    """The chunks a state of ``tokens`` is stored as: the full ones, then the partial one if any."""
    out: list[Piece] = []
    prev = b""
    for start in range(0, len(tokens), chunk_tokens):
        part = tokens[start : start + chunk_tokens]
        ident = chunk_id(namespace, prev, part)
        out.append(Piece(ident, prev, start, part))
        prev = ident
    return out


# --------------------------------------------------------------------------------------- layouts

def layout_to_json(layout: KVLayout) -> dict[str, Any]:
    return {
        "v_trans": layout.v_trans,
        "k_types": list(layout.k_types),
        "k_row_bytes": list(layout.k_row_bytes),
        "v_types": list(layout.v_types),
        "v_row_bytes": list(layout.v_row_bytes),
        "v_elem_bytes": list(layout.v_elem_bytes),
        "n_embd_v": list(layout.n_embd_v),
    }


@functools.lru_cache(maxsize=16)
def _layout_json(layout: KVLayout) -> dict[str, Any]:
    """:func:`layout_to_json`, memoized: chunk headers are compared with it (treat as read-only)."""
    return layout_to_json(layout)


_MAX_LAYERS = 4096
_MAX_ROW = 1 << 24  # bytes of one layer's K or V per token


def layout_from_json(value: Any) -> KVLayout:
    """Validate a layout read from a header.

    Raises:
        CorruptStateError: not a layout.
    """
    try:
        v_trans = value["v_trans"]
        fields = {name: value[name] for name in ("k_types", "k_row_bytes", "v_types", "v_row_bytes", "v_elem_bytes", "n_embd_v")}
    except (TypeError, KeyError):
        raise CorruptStateError("bad layout") from None
    if not isinstance(v_trans, bool):
        raise CorruptStateError("bad layout: v_trans")
    n_layer = len(fields["k_types"]) if isinstance(fields["k_types"], list) else -1
    if not 0 < n_layer <= _MAX_LAYERS:
        raise CorruptStateError("bad layout: layer count")
    for name, items in fields.items():
        if not isinstance(items, list) or len(items) != n_layer:
            raise CorruptStateError(f"bad layout: {name}")
        for item in items:
            if not isinstance(item, int) or isinstance(item, bool) or not -(1 << 31) <= item <= _MAX_ROW:
                raise CorruptStateError(f"bad layout: {name}")
    for name in ("k_row_bytes", "v_row_bytes"):
        if any(size <= 0 for size in fields[name]):
            raise CorruptStateError(f"bad layout: {name}")
    if v_trans:
        for el, embd, row in zip(fields["v_elem_bytes"], fields["n_embd_v"], fields["v_row_bytes"]):
            if el <= 0 or embd <= 0 or el * embd != row:
                raise CorruptStateError("bad layout: transposed values")
    return KVLayout(v_trans, *(tuple(fields[name]) for name in fields))


# ---------------------------------------------------------------------------------------- chunks

def _window(segments: Sequence[KVSegment], start: int, end: int) -> Iterator[tuple[KVSegment, int, int]]:
    """The (segment, first, last) runs covering positions ``[start, end)`` of consecutive segments."""
    offset = 0
    for segment in segments:
        lo, hi = max(start, offset), min(end, offset + segment.n_tokens)
        if lo < hi:
            yield segment, lo - offset, hi - offset
        offset += segment.n_tokens
        if offset >= end:
            return


def encode_chunk(namespace: str, piece: Piece, layout: KVLayout, segments: Sequence[KVSegment], *,
                 into: npt.NDArray[np.uint8] | None = None) -> list[memoryview]:
    """Encode the KV of ``piece``'s positions, taken from a state's ``segments``, as a chunk file.

    Returns one buffer (in a list, like every encoder here), written in place: its prefix, header and
    payload; in ``into``'s first bytes when it is large enough (a buffer reused for chunk after chunk:
    the view is valid until the next encoding into it), else in a new array. Complexity: one copy of the
    chunk's bytes and one checksum pass.
    """
    start, end = piece.start, piece.start + piece.n_tokens
    runs = list(_window(segments, start, end))
    if sum(hi - lo for _, lo, hi in runs) != piece.n_tokens:
        raise ValueError("the segments do not cover the chunk")
    header = json.dumps(
        {
            "namespace": namespace,
            "id": piece.id.hex(),
            "prev": piece.prev.hex(),
            "start": piece.start,
            "n_tokens": piece.n_tokens,
            "layout": layout_to_json(layout),
        },
        sort_keys=True,
    ).encode()
    n = piece.n_tokens
    body = PREFIX_SIZE + len(header)
    total = body + chunk_size(layout, n)
    out = into[:total] if into is not None and len(into) >= total else np.empty(total, dtype=np.uint8)
    out[PREFIX_SIZE:body] = np.frombuffer(header, dtype=np.uint8)
    offset = body
    out[offset : offset + 4 * n] = np.ascontiguousarray(piece.tokens, dtype="<i4").view(np.uint8)
    offset += 4 * n
    for i, row in enumerate(layout.k_row_bytes):
        target = out[offset : offset + n * row].reshape(n, row)
        _gather(target, [segment.k[i][lo:hi] for segment, lo, hi in runs], axis=0)
        offset += n * row
    for i, row in enumerate(layout.v_row_bytes):
        if layout.v_trans:
            el = layout.v_elem_bytes[i]
            target = out[offset : offset + n * row].reshape(layout.n_embd_v[i], n * el)
            _gather(target, [segment.v[i][:, lo * el : hi * el] for segment, lo, hi in runs], axis=1)
        else:
            target = out[offset : offset + n * row].reshape(n, row)
            _gather(target, [segment.v[i][lo:hi] for segment, lo, hi in runs], axis=0)
        offset += n * row
    view = memoryview(out)
    _pack_prefix(view, KIND_CHUNK, len(header), len(out) - body, xxhash.xxh3_64_intdigest(view[PREFIX_SIZE:]))
    return [view]


def _gather(target: npt.NDArray[np.uint8], parts: list[npt.NDArray[np.uint8]], axis: int) -> None:
    """Copy ``parts``, joined along ``axis``, into ``target``.

    Most chunks lie inside one segment: one part, copied by slice assignment, without
    ``np.concatenate``'s overhead (two calls per layer per chunk were most of a store's Python time).
    """
    if len(parts) == 1:
        target[...] = parts[0]
    else:
        np.concatenate(parts, axis=axis, out=target)


def chunk_size(layout: KVLayout, n_tokens: int) -> int:
    """Bytes of a chunk's payload (tokens and KV) for ``n_tokens`` tokens."""
    return n_tokens * (4 + layout.bytes_per_token)


def decode_chunk(
    buffer: Any, *, namespace: str, ident: bytes, prev: bytes, start: int, layout: KVLayout, verify: bool = True,
) -> tuple[TokenArray, KVSegment]:
    """Decode a chunk file and check it is the chunk the caller expects; views into ``buffer``.

    The caller checks the returned tokens against the state's; the id is recomputed from them here,
    so a chunk with the right id cannot hold other tokens.

    Raises:
        CorruptStateError: damaged, or not the expected chunk.
    """
    header, payload = _open(buffer, verify=verify, kind=KIND_CHUNK)
    try:
        n_tokens = _field(header, "n_tokens", int)
        fields = (_field(header, "namespace", str), _field(header, "id", str), _field(header, "prev", str),
                  _field(header, "start", int))
        found_layout = header["layout"]
    except (KeyError, TypeError) as error:
        raise CorruptStateError(f"bad chunk header: {error}") from None
    if fields != (namespace, ident.hex(), prev.hex(), start):
        raise CorruptStateError("not the expected chunk")
    # Equal to the JSON of a valid layout, so valid itself: no need to validate it field by field.
    if found_layout != _layout_json(layout):
        raise CorruptStateError("chunk of another KV layout")
    if not 0 < n_tokens <= MAX_CHUNK_FILE_TOKENS or payload.nbytes != chunk_size(layout, n_tokens):
        raise CorruptStateError("chunk length does not match its header")
    data = np.frombuffer(payload, dtype=np.uint8)
    tokens = data[: 4 * n_tokens].view("<i4")
    if (tokens < 0).any() or chunk_id(namespace, prev, tokens) != ident:
        raise CorruptStateError("chunk tokens do not match its id")
    offset = 4 * n_tokens
    k: list[Bytes] = []
    v: list[Bytes] = []
    for row in layout.k_row_bytes:
        k.append(data[offset : offset + n_tokens * row].reshape(n_tokens, row))
        offset += n_tokens * row
    for i, row in enumerate(layout.v_row_bytes):
        block = data[offset : offset + n_tokens * row]
        if layout.v_trans:
            v.append(block.reshape(layout.n_embd_v[i], n_tokens * layout.v_elem_bytes[i]))
        else:
            v.append(block.reshape(n_tokens, row))
        offset += n_tokens * row
    return tokens, KVSegment(data, n_tokens, tuple(k), tuple(v))


# ----------------------------------------------------------------------------------------- heads

@dataclass(frozen=True, slots=True)
class Head:
    """A decoded chain head: everything of a state but its KV."""

    fingerprint: str
    seed: int
    tokens: TokenArray
    logits: npt.NDArray[np.float32] | None
    chunk_tokens: int
    layout: KVLayout


def encode_head(state: LlamaState, chunk_tokens: int) -> list[memoryview]:
    """Encode what a chunked entry keeps besides its chunks: tokens, logits, seed, layout.

    Raises:
        ValueError: the state is not a segmented state with a fingerprint.
    """
    if state.layout is None or not isinstance(state.fingerprint, str) or not state.fingerprint:
        raise ValueError("only segmented states with a fingerprint are chunked")
    header = json.dumps(
        {
            "fingerprint": state.fingerprint,
            "seed": int(state.seed),
            "n_tokens": state.n_tokens,
            "n_vocab": 0 if state.logits is None else len(state.logits),
            "chunk_tokens": chunk_tokens,
            "layout": layout_to_json(state.layout),
        },
        sort_keys=True,
    ).encode()
    parts = [memoryview(np.ascontiguousarray(state.tokens, dtype="<i4")).cast("B")]
    if state.logits is not None:
        parts.append(memoryview(np.ascontiguousarray(state.logits, dtype="<f4")).cast("B"))
    return _framed(KIND_CHUNKED, header, parts)


def decode_head(buffer: Any, *, verify: bool = True) -> Head:
    """Decode a chain head (views into ``buffer``).

    Raises:
        CorruptStateError: damaged.
    """
    header, payload = _open(buffer, verify=verify, kind=KIND_CHUNKED)
    try:
        fingerprint = _field(header, "fingerprint", str)
        seed = _field(header, "seed", int)
        n_tokens = _field(header, "n_tokens", int)
        n_vocab = _field(header, "n_vocab", int)
        chunk_tokens = _field(header, "chunk_tokens", int)
        layout = layout_from_json(header["layout"])
    except (KeyError, TypeError) as error:
        raise CorruptStateError(f"bad head: {error}") from None
    if not fingerprint or n_tokens <= 0 or n_vocab < 0 or not 0 < chunk_tokens <= 1 << 20:
        raise CorruptStateError("bad head values")
    if payload.nbytes != 4 * (n_tokens + n_vocab):
        raise CorruptStateError("head length does not match its header")
    data = np.frombuffer(payload, dtype=np.uint8)
    tokens = data[: 4 * n_tokens].view("<i4")
    if (tokens < 0).any():
        raise CorruptStateError("negative token ids")
    logits = data[4 * n_tokens :].view("<f4") if n_vocab else None
    return Head(fingerprint, seed, tokens, logits, chunk_tokens, layout)


def assemble(head: Head, segments: Sequence[KVSegment], n_tokens: int) -> LlamaState:
    """The state of the first ``n_tokens`` of ``head``'s tokens from its chunks' segments (no copy).

    The segments must be the chain's chunks in order, covering at least ``n_tokens`` positions; the
    last is cut as needed. Logits come with the state only when it holds all of ``head``'s tokens.
    """
    kept: list[KVSegment] = []
    remaining = n_tokens
    for segment in segments:
        if remaining <= 0:
            break
        take = min(remaining, segment.n_tokens)
        kept.append(segment.head(take, head.layout))
        remaining -= take
    if remaining > 0:
        raise ValueError("the chunks do not cover the tokens")
    logits = head.logits if n_tokens == len(head.tokens) else None
    return LlamaState(head.tokens[:n_tokens], logits, head.seed, head.fingerprint, layout=head.layout,
                      segments=tuple(kept))
