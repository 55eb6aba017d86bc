"""The binary format of a :class:`LlamaState`: versioned, checksummed, no pickle.

Layout (little-endian)::

    8  magic  b"LLCSTATE"
    2  format version (2)
    2  reserved (0)
    4  header length H
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
"""

from __future__ import annotations

import json
import struct

import xxhash
from typing import Any

import numpy as np

from llama_cache.state.llama_state import LlamaState

MAGIC = b"LLCSTATE"
VERSION = 2
_PREFIX = struct.Struct("<8sHHIQQ")
PREFIX_SIZE = _PREFIX.size


class CorruptStateError(ValueError):
    """Bytes that are not a valid encoded state: truncated, tampered, or of another format version."""


def encode(state: LlamaState) -> list[memoryview]:
    """Encode ``state`` as a list of buffers to be written one after another.

    The state's arrays are referenced, not copied (the llama.cpp bytes of a segmented state are
    assembled once). Complexity: one checksum pass over the payload.
    """
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
    digest = xxhash.xxh3_64(header)
    for part in parts:
        digest.update(part)
    payload_length = sum(part.nbytes for part in parts)
    prefix = _PREFIX.pack(MAGIC, VERSION, 0, len(header), payload_length, digest.intdigest())
    return [memoryview(prefix), memoryview(header), *parts]


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
    view = memoryview(buffer).cast("B")
    if view.nbytes < PREFIX_SIZE:
        raise CorruptStateError("truncated: shorter than the fixed prefix")
    magic, version, _, header_length, payload_length, stored_digest = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise CorruptStateError("not a llama-cache state (bad magic)")
    if version != VERSION:
        raise CorruptStateError(f"state format version {version}; this llama-cache reads {VERSION}")
    end = PREFIX_SIZE + header_length + payload_length
    if view.nbytes != end:
        raise CorruptStateError(f"length {view.nbytes} does not match the recorded {end}")
    header_view = view[PREFIX_SIZE : PREFIX_SIZE + header_length]
    payload = view[PREFIX_SIZE + header_length : end]
    if verify and xxhash.xxh3_64_intdigest(view[PREFIX_SIZE:end]) != stored_digest:
        raise CorruptStateError("checksum mismatch")
    try:
        header = json.loads(bytes(header_view))
        fingerprint = str(header["fingerprint"])
        seed = int(header["seed"])
        n_tokens = int(header["n_tokens"])
        n_vocab = int(header["n_vocab"])
        kind = header["kv"]
    except (ValueError, KeyError, TypeError) as error:
        raise CorruptStateError(f"bad header: {error}") from None
    if n_tokens < 0 or n_vocab < 0 or kind not in ("opaque", "segmented"):
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
