"""The binary format of a :class:`LlamaState`: versioned, checksummed, no pickle.

Layout (little-endian)::

    8  magic  b"LLCSTATE"
    2  format version (2)
    2  payload kind: 0 a llama-cache state (below), 1 a llama-cpp-python state (see the end)
    4  header length H (at most 64 KiB)
    8  payload length P
    8  XXH3-64 of header and payload
    H  header: UTF-8 JSON {fingerprint, seed, n_tokens, n_vocab, kv: "segmented" | "opaque"}
    P  payload: tokens (int32 x n_tokens), logits (float32 x n_vocab, absent when n_vocab is 0),
       then llama.cpp's per-sequence state bytes

Decoding checks everything (magic, version, lengths, checksum, JSON fields) before building a state,
and builds it from views into the buffer it was given: decoding a memory-mapped file copies nothing.
Any damage raises :class:`CorruptStateError`.

The checksum is XXH3-64 (the ``xxhash`` package): it verifies a 35 MB state in about 1.3 ms here, where
``zlib.crc32`` takes 8.7 ms, and the check sits on the critical path of every restore from disk.

**llama-cpp-python's states** (``llama_cpp.llama.LlamaState``, what a plain ``llama_cpp.Llama`` saves)
have a second payload kind, written by :func:`encode_upstream` and read by :func:`decode_upstream`. The
same prefix is used with the kind field set to ``KIND_UPSTREAM`` (1); readers of the first
version of this format (which ignored that field) reject such a payload for its header::

    H  header: UTF-8 JSON {kind: "llama_cpp", namespace, fingerprint (str or null), seed, n_tokens,
       n_ids, n_rows, n_vocab, n_stored_rows, state_size}
    P  payload: input_ids (int32 x n_ids), indices of the stored score rows (uint32 x n_stored_rows,
       strictly increasing, < n_rows), those rows (float32 x n_stored_rows x n_vocab), then the
       llama.cpp context state (state_size bytes)

Only score rows holding a non-zero value are stored (with ``logits_all=False`` llama-cpp-python keeps
none); the others are restored as zeros. Decoding validates every length and index against the
buffer and bounds the one allocation not backed by its bytes (the zero score rows) by
``max(DENSE_FLOOR, DENSE_RATIO * len(buffer))`` and ``MAX_VOCAB``.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import llama_cpp
import numpy as np
import xxhash

from llama_cache.state.llama_state import LlamaState

MAGIC = b"LLCSTATE"
VERSION = 2
_PREFIX = struct.Struct("<8sHHIQQ")
PREFIX_SIZE = _PREFIX.size
KIND_LLAMA_CACHE = 0
KIND_UPSTREAM = 1
MAX_HEADER = 1 << 16  # a header is a few hundred bytes
MAX_VOCAB = 1 << 21  # above every known vocabulary
DENSE_FLOOR = 256 << 20  # zero score rows restored without backing bytes: at most this...
DENSE_RATIO = 64  # ...or this many times the encoded size


class CorruptStateError(ValueError):
    """Bytes that are not a valid encoded state: truncated, tampered, or of another format version."""


def encode(state: LlamaState) -> list[memoryview]:
    """Encode ``state`` as a list of buffers to be written one after another.

    The state's arrays are referenced, not copied (the llama.cpp bytes of a segmented state are
    assembled once). Complexity: one checksum pass over the payload.

    Raises:
        TypeError, ValueError: the state has no fingerprint, or token ids outside ``[0, 2**31)``.
    """
    if not isinstance(state.fingerprint, str) or not state.fingerprint:
        raise ValueError("a state without a fingerprint cannot be encoded")
    tokens = np.asarray(state.tokens)
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise TypeError("state tokens must be a 1-D integer array")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= 2**31):
        raise ValueError("state token ids must be in [0, 2**31)")
    header = json.dumps(
        {
            "fingerprint": state.fingerprint,
            "seed": int(state.seed),
            "n_tokens": state.n_tokens,
            "n_vocab": 0 if state.logits is None else len(state.logits),
            "kv": "opaque" if state.layout is None else "segmented",
        },
        sort_keys=True,
    ).encode()
    parts = [memoryview(np.ascontiguousarray(state.tokens, dtype="<i4")).cast("B")]
    if state.logits is not None:
        parts.append(memoryview(np.ascontiguousarray(state.logits, dtype="<f4")).cast("B"))
    parts.append(memoryview(np.ascontiguousarray(state.seq_bytes())).cast("B"))
    return _framed(KIND_LLAMA_CACHE, header, parts)


def _framed(kind: int, header: bytes, parts: list[memoryview]) -> list[memoryview]:
    """The fixed prefix (magic, version, kind, lengths, checksum of header and payload), the header, the parts."""
    digest = xxhash.xxh3_64(header)
    for part in parts:
        digest.update(part)
    payload_length = sum(part.nbytes for part in parts)
    prefix = _PREFIX.pack(MAGIC, VERSION, kind, len(header), payload_length, digest.intdigest())
    return [memoryview(prefix), memoryview(header), *parts]


def _pack_prefix(buffer: memoryview, kind: int, header_length: int, payload_length: int, digest: int) -> None:
    """Write the fixed prefix into the first ``PREFIX_SIZE`` bytes of a buffer framed in place."""
    _PREFIX.pack_into(buffer, 0, MAGIC, VERSION, kind, header_length, payload_length, digest)


def encoded_size(parts: list[memoryview]) -> int:
    return sum(part.nbytes for part in parts)


def decode(buffer: Any, *, verify: bool = True) -> LlamaState:
    """Decode a state from a bytes-like buffer (bytes, memoryview, mmap), without copying it.

    Args:
        buffer: the encoded state; the returned state keeps views into it.
        verify: check the checksum (one pass over the payload). Only skip it for bytes this process
            has just checked or written.

    Raises:
        CorruptStateError: anything about the bytes is wrong.
    """
    header, payload = _open(buffer, verify=verify, kind=KIND_LLAMA_CACHE)
    try:
        fingerprint = _field(header, "fingerprint", str)
        seed = _field(header, "seed", int)
        n_tokens = _field(header, "n_tokens", int)
        n_vocab = _field(header, "n_vocab", int)
        kind = header["kv"]
    except (ValueError, KeyError, TypeError) as error:
        raise CorruptStateError(f"bad header: {error}") from None
    if n_tokens < 0 or n_vocab < 0 or kind not in ("opaque", "segmented") or not fingerprint:
        raise CorruptStateError("bad header values")
    arrays = np.frombuffer(payload, dtype=np.uint8)
    token_bytes, logit_bytes = 4 * n_tokens, 4 * n_vocab
    if token_bytes + logit_bytes > len(arrays):
        raise CorruptStateError("payload shorter than its header says")
    tokens = arrays[:token_bytes].view("<i4")
    logits = arrays[token_bytes : token_bytes + logit_bytes].view("<f4") if n_vocab else None
    seq_bytes = arrays[token_bytes + logit_bytes :]
    if (tokens < 0).any():
        raise CorruptStateError("negative token ids")
    state = LlamaState.from_seq_bytes(tokens, logits, seed, fingerprint, seq_bytes, parse=kind == "segmented")
    if kind == "segmented" and state.layout is None:
        raise CorruptStateError("KV bytes do not parse")
    return state


def _field(header: Any, name: str, kind: type) -> Any:
    """``header[name]``, which must be a JSON value of type ``kind`` (bools are not ints)."""
    value = header[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"{name} is not a {kind.__name__}")
    return value


def _open(buffer: Any, *, verify: bool, kind: int) -> tuple[dict[str, Any], memoryview]:
    """Check a buffer's prefix, length and checksum; return its parsed header and its payload view."""
    view = memoryview(buffer).cast("B")
    magic, version, kind_code, header_length, payload_length, stored_digest = _prefix(view)
    if version != VERSION:
        raise CorruptStateError(f"state format version {version}; this llama-cache reads {VERSION}")
    if kind_code != kind:
        raise CorruptStateError(f"payload kind {kind_code}, expected {kind}")
    if header_length > MAX_HEADER:
        raise CorruptStateError("header too long")
    end = PREFIX_SIZE + header_length + payload_length
    if view.nbytes != end:
        raise CorruptStateError(f"length {view.nbytes} does not match the recorded {end}")
    if verify and xxhash.xxh3_64_intdigest(view[PREFIX_SIZE:end]) != stored_digest:
        raise CorruptStateError("checksum mismatch")
    try:
        header = json.loads(bytes(view[PREFIX_SIZE : PREFIX_SIZE + header_length]))
    except ValueError as error:
        raise CorruptStateError(f"bad header: {error}") from None
    if not isinstance(header, dict):
        raise CorruptStateError("bad header: not an object")
    return header, view[PREFIX_SIZE + header_length : end]


def payload_kind(buffer: Any) -> int:
    """The payload kind recorded in an encoded state's prefix (no validation beyond the prefix's length).

    Raises:
        CorruptStateError: shorter than the prefix or not a llama-cache payload.
    """
    return int(_prefix(memoryview(buffer).cast("B"))[2])


def _prefix(view: memoryview) -> tuple[Any, ...]:
    """The unpacked fixed prefix of an encoded state, its length and magic checked."""
    if view.nbytes < PREFIX_SIZE:
        raise CorruptStateError("truncated: shorter than the fixed prefix")
    fields = _PREFIX.unpack_from(view, 0)
    if fields[0] != MAGIC:
        raise CorruptStateError("not a llama-cache state (bad magic)")
    return fields


def encode_upstream(state: llama_cpp.llama.LlamaState, namespace: str) -> list[memoryview]:
    """Encode a llama-cpp-python ``LlamaState`` filed under ``namespace``, as buffers to write in order.

    Stores ``input_ids``, the score rows holding a non-zero value (with their indices), ``n_tokens``,
    the llama.cpp state bytes and the seed, and the state's ``fingerprint`` attribute when it has a str
    one. Nothing is pickled.

    Raises:
        TypeError, ValueError: the state's fields do not have the shapes llama-cpp-python gives them.
    """
    input_ids = np.asarray(state.input_ids)
    if input_ids.ndim != 1 or input_ids.dtype.kind not in "iu":
        raise TypeError("input_ids must be a 1-D integer array")
    if input_ids.size and (int(input_ids.min()) < -(2**31) or int(input_ids.max()) >= 2**31):
        raise ValueError("input_ids do not fit in int32")
    n_tokens = state.n_tokens
    if not isinstance(n_tokens, (int, np.integer)) or isinstance(n_tokens, bool):
        raise TypeError("n_tokens must be an int")
    n_tokens = int(n_tokens)
    if not 0 <= n_tokens <= len(input_ids):
        raise ValueError(f"n_tokens {n_tokens} outside 0..{len(input_ids)}")
    scores = np.asarray(state.scores)
    if scores.ndim != 2 or scores.dtype.kind != "f":
        raise TypeError("scores must be a 2-D float array")
    n_rows, n_vocab = scores.shape
    if n_rows > n_tokens or n_vocab > MAX_VOCAB:
        raise ValueError(f"scores of shape {scores.shape} for {n_tokens} tokens")
    raw = state.llama_state
    llama_bytes = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw.view(np.uint8)
    state_size = state.llama_state_size
    if isinstance(state_size, bool) or int(state_size) != llama_bytes.nbytes:
        raise ValueError(f"llama_state_size {state_size} differs from the {llama_bytes.nbytes} state bytes")
    seed = int(state.seed)
    fingerprint = getattr(state, "fingerprint", None)
    if not isinstance(fingerprint, str):
        fingerprint = None
    rows = np.flatnonzero(np.any(scores != 0, axis=1)).astype("<u4") if n_rows else np.empty(0, "<u4")
    header = json.dumps(
        {
            "kind": "llama_cpp",
            "namespace": namespace,
            "fingerprint": fingerprint,
            "seed": seed,
            "n_tokens": n_tokens,
            "n_ids": int(len(input_ids)),
            "n_rows": int(n_rows),
            "n_vocab": int(n_vocab),
            "n_stored_rows": int(len(rows)),
            "state_size": int(llama_bytes.nbytes),
        },
        sort_keys=True,
    ).encode()
    parts = [
        memoryview(np.ascontiguousarray(input_ids, dtype="<i4")).cast("B"),
        memoryview(rows).cast("B"),
    ]
    if len(rows):
        parts.append(memoryview(np.ascontiguousarray(scores[rows], dtype="<f4")).cast("B"))
    parts.append(memoryview(np.ascontiguousarray(llama_bytes)).cast("B"))
    return _framed(KIND_UPSTREAM, header, parts)


def decode_upstream(buffer: Any, *, verify: bool = True) -> tuple[llama_cpp.llama.LlamaState, str]:
    """Decode a llama-cpp-python ``LlamaState`` written by :func:`encode_upstream`.

    Returns:
        The state (with a ``fingerprint`` attribute when one was stored) and the namespace it was
        filed under. ``input_ids`` and ``scores`` are fresh arrays (llama-cpp-python copies them on
        load anyway); ``llama_state`` is a copy of its bytes.

    Raises:
        CorruptStateError: anything about the bytes is wrong.
    """
    header, payload = _open(buffer, verify=verify, kind=KIND_UPSTREAM)
    try:
        if header.get("kind") != "llama_cpp":
            raise ValueError("kind is not llama_cpp")
        namespace = _field(header, "namespace", str)
        fingerprint = header.get("fingerprint")
        if fingerprint is not None and not isinstance(fingerprint, str):
            raise TypeError("fingerprint is not a str")
        seed = _field(header, "seed", int)
        n_tokens, n_ids, n_rows, n_vocab, n_stored, state_size = (
            _field(header, name, int)
            for name in ("n_tokens", "n_ids", "n_rows", "n_vocab", "n_stored_rows", "state_size")
        )
    except (ValueError, KeyError, TypeError) as error:
        raise CorruptStateError(f"bad header: {error}") from None
    if min(n_tokens, n_ids, n_rows, n_vocab, n_stored, state_size) < 0 or not -(2**63) <= seed < 2**64:
        raise CorruptStateError("bad header values")
    if n_tokens > n_ids or n_rows > n_tokens or n_stored > n_rows or n_vocab > MAX_VOCAB:
        raise CorruptStateError("header counts are inconsistent")
    expected = 4 * n_ids + 4 * n_stored + 4 * n_stored * n_vocab + state_size
    if expected != payload.nbytes:
        raise CorruptStateError(f"payload is {payload.nbytes} bytes, its header says {expected}")
    if 4 * n_rows * n_vocab > max(DENSE_FLOOR, DENSE_RATIO * memoryview(buffer).nbytes):
        raise CorruptStateError("score matrix too large for its encoded size")
    data = np.frombuffer(payload, dtype=np.uint8)
    offset = 4 * n_ids
    input_ids = data[:offset].view("<i4").astype(np.intc)
    if n_tokens and int(input_ids[:n_tokens].min()) < 0:
        raise CorruptStateError("negative token ids")
    rows = data[offset : offset + 4 * n_stored].view("<u4")
    offset += 4 * n_stored
    if n_stored and (int(rows[-1]) >= n_rows or (n_stored > 1 and bool((np.diff(rows.astype(np.int64)) <= 0).any()))):
        raise CorruptStateError("score row indices out of order or out of range")
    scores = np.zeros((n_rows, n_vocab), dtype=np.single)
    if n_stored:
        scores[rows.astype(np.intp)] = data[offset : offset + 4 * n_stored * n_vocab].view("<f4").reshape(n_stored, n_vocab)
        offset += 4 * n_stored * n_vocab
    llama_state = bytes(data[offset:])
    state = llama_cpp.llama.LlamaState(
        input_ids=input_ids,
        scores=scores,
        n_tokens=n_tokens,
        llama_state=llama_state,
        llama_state_size=state_size,
        seed=seed,
    )
    if fingerprint is not None:
        state.fingerprint = fingerprint  # type: ignore[attr-defined]
    return state, namespace
