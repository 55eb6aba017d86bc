"""LlamaState, its KV layout parser and its binary format, on real llama.cpp sequence states."""

from __future__ import annotations

import struct
from collections.abc import Iterator

import numpy as np
import pytest

from llama_cache import default_model_path
from llama_cache.llama import Llama
from llama_cache.state import format as state_format
from llama_cache.state.kv_layout import parse_seq_state, serialize_segments
from llama_cache.state.llama_state import LlamaState

TEXT = b"The llama hummed softly while the herd crossed the high pass at dawn."


@pytest.fixture(scope="module", params=[False, True], ids=["v-transposed", "flash-attn"])
def llm(request: pytest.FixtureRequest) -> Iterator[Llama]:
    """The default model, with V stored transposed (no flash attention) and not (flash attention)."""
    model = Llama(model_path=str(default_model_path()), n_ctx=512, seed=0, verbose=False, flash_attn=request.param)
    model.eval(model.tokenize(TEXT))
    yield model
    model.close()


def test_parsing_and_serialising_round_trip_bit_for_bit(llm: Llama) -> None:
    seq = llm._read_seq_bytes()
    parsed = parse_seq_state(seq)
    assert parsed is not None
    layout, whole = parsed
    assert whole.n_tokens == llm.n_tokens
    assert layout.serialized_size(whole.n_tokens) == len(seq)
    assert np.array_equal(serialize_segments(layout, [whole]), seq)
    head, tail = whole.head(5, layout), whole.slice_copy(5, layout)
    assert np.array_equal(serialize_segments(layout, [head, tail]), seq)
    assert tail.buffer.nbytes == (whole.n_tokens - 5) * layout.bytes_per_token


def test_unrecognised_bytes_are_not_parsed(llm: Llama) -> None:
    seq = llm._read_seq_bytes()
    assert parse_seq_state(seq[:-1]) is None  # truncated
    assert parse_seq_state(np.concatenate([seq, np.zeros(1, np.uint8)])) is None  # trailing bytes
    bad_magic = seq.copy()
    bad_magic[0] ^= 0xFF
    assert parse_seq_state(bad_magic) is None
    assert parse_seq_state(np.zeros(3, np.uint8)) is None


def test_prefix_and_extension_share_the_kv(llm: Llama) -> None:
    state = llm.save_state()
    prefix = state.prefix(4, logits=None)
    assert prefix.n_tokens == 4
    assert prefix.segments[0].buffer is state.segments[0].buffer
    assert np.array_equal(prefix.seq_bytes(), serialize_segments(state.layout, [state.segments[0].head(4, state.layout)]))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        state.prefix(0, logits=None)
    with pytest.raises(ValueError):
        state.prefix(state.n_tokens + 1, logits=None)


def test_nbytes_counts_what_the_state_owns(llm: Llama) -> None:
    state = llm.save_state()
    seq_size = len(llm._read_seq_bytes())
    logits = 0 if state.logits is None else state.logits.nbytes
    assert state.nbytes == seq_size + state.tokens.nbytes + logits
    assert state.llama_state_size == seq_size
    assert len(state.llama_state) == seq_size


def test_format_round_trips_and_decodes_without_copying(llm: Llama) -> None:
    state = llm.save_state()
    blob = b"".join(bytes(part) for part in state_format.encode(state))
    decoded = state_format.decode(blob)
    assert decoded.fingerprint == state.fingerprint
    assert np.array_equal(decoded.tokens, state.tokens)
    assert np.array_equal(decoded.seq_bytes(), state.seq_bytes())
    assert decoded.layout == state.layout
    buffer = bytearray(blob)
    view_state = state_format.decode(buffer)
    assert np.shares_memory(view_state.tokens, np.frombuffer(buffer, np.uint8))


def _encoded(llm: Llama) -> bytes:
    return b"".join(bytes(part) for part in state_format.encode(llm.save_state()))


@pytest.mark.parametrize(
    "damage",
    ["truncate", "extend", "flip_payload", "flip_header", "magic", "version", "empty"],
)
def test_damaged_bytes_raise_corrupt_state_error(llm: Llama, damage: str) -> None:
    blob = bytearray(_encoded(llm))
    if damage == "truncate":
        blob = blob[:-10]
    elif damage == "extend":
        blob += b"\0"
    elif damage == "flip_payload":
        blob[-1] ^= 0x01
    elif damage == "flip_header":
        blob[state_format.PREFIX_SIZE + 2] ^= 0x01
    elif damage == "magic":
        blob[:8] = b"PICKLE!!"
    elif damage == "version":
        struct.pack_into("<H", blob, 8, 99)
    else:
        blob = bytearray()
    with pytest.raises(state_format.CorruptStateError):
        state_format.decode(bytes(blob))


def test_a_state_needs_kv_segments_covering_its_tokens_or_opaque_bytes(llm: Llama) -> None:
    tokens = np.arange(3, dtype=np.int32)
    with pytest.raises(ValueError):
        LlamaState(tokens, None, 0, "f")
    opaque = LlamaState(tokens, None, 0, "f", opaque=np.zeros(16, np.uint8))
    assert opaque.layout is None and opaque.llama_state_size == 16
    with pytest.raises(ValueError):
        opaque.prefix(1, logits=None)
    state = llm.save_state()
    with pytest.raises(ValueError):
        LlamaState(tokens, None, 0, "f", layout=state.layout, segments=state.segments)
