"""Chunk values of the Redis tier: every KV layout round-trips, and a damaged value is refused."""

from __future__ import annotations

import numpy as np
import pytest

from llama_cache.caches.redis_frames import HEADER_SIZE, decode_frame, encode_frame, frame_size
from llama_cache.state.chunks import pieces
from llama_cache.state.format import CorruptStateError
from llama_cache.state.kv_layout import SEQ_STATE_MAGIC
from llama_cache.state.llama_state import LlamaState


def state_of(n: int, k_rows: list[int], v_rows: list[int], v_trans: bool, seed: int = 0) -> LlamaState:
    """A llama.cpp sequence state of ``n`` tokens with these per-layer row sizes (bytes; even)."""
    rng = np.random.default_rng(seed)
    cells = np.zeros(n, dtype=[("pos", "<i4"), ("n_seq", "<u4"), ("seq", "<i4")])
    cells["pos"], cells["n_seq"] = np.arange(n), 1
    parts = [np.array([SEQ_STATE_MAGIC, 0, 1, n], "<u4").tobytes(), cells.tobytes(),
             np.array([int(v_trans), len(k_rows)], "<u4").tobytes()]
    for row in k_rows:
        parts += [np.array([1], "<i4").tobytes(), np.array([row], "<u8").tobytes(), rng.bytes(row * n)]
    for row in v_rows:
        header = np.array([2, row // 2], "<u4") if v_trans else np.array([row], "<u8")
        parts += [np.array([1], "<i4").tobytes(), header.tobytes(), rng.bytes(row * n)]
    tokens = np.arange(100, 100 + n, dtype=np.int32)
    state = LlamaState.from_seq_bytes(tokens, None, 0, "test", np.frombuffer(b"".join(parts), dtype=np.uint8))
    assert state.layout is not None
    return state


LAYOUTS = {
    "alike, transposed values": ([64, 64, 64], [64, 64, 64], True),
    "alike, values by token": ([64, 64, 64], [48, 48, 48], False),
    "rows differing by layer, transposed": ([64, 32, 96], [64, 32, 96], True),
    "rows differing by layer, by token": ([64, 32, 96], [16, 48, 80], False),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_layout_round_trips_chunk_by_chunk(name: str) -> None:
    state = state_of(45, *LAYOUTS[name])
    layout = state.layout
    assert layout is not None
    chain = pieces("ns", state.tokens, 16)
    for piece in chain:
        value = bytes(encode_frame("ns", piece, layout, state.segments,
                                   np.empty(frame_size(layout, piece.n_tokens), dtype=np.uint8)))
        tokens, segment = decode_frame(value, namespace="ns", ident=piece.id, prev=piece.prev, start=piece.start,
                                       layout=layout)
        assert np.array_equal(tokens, state.tokens[piece.start : piece.start + piece.n_tokens])
        expected = state.prefix(piece.start + piece.n_tokens, None)
        part = segment.head(piece.n_tokens, layout)
        for mine, theirs in zip(part.k, expected.segments[0].k):
            assert np.array_equal(mine, theirs[piece.start :])
        for i, (mine, theirs) in enumerate(zip(part.v, expected.segments[0].v)):
            if layout.v_trans:
                el = layout.v_elem_bytes[i]
                assert np.array_equal(mine, theirs[:, piece.start * el :])
            else:
                assert np.array_equal(mine, theirs[piece.start :])


def test_a_damaged_or_foreign_value_is_refused() -> None:
    state = state_of(32, *LAYOUTS["alike, transposed values"])
    other = state_of(32, *LAYOUTS["alike, values by token"])
    assert state.layout is not None and other.layout is not None
    piece = pieces("ns", state.tokens, 16)[1]
    value = bytes(encode_frame("ns", piece, state.layout, state.segments,
                               np.empty(frame_size(state.layout, 16), dtype=np.uint8)))
    expect = dict(namespace="ns", ident=piece.id, prev=piece.prev, start=piece.start)
    decode_frame(value, layout=state.layout, **expect)  # whole: taken
    flipped = bytearray(value)
    flipped[HEADER_SIZE + 100] ^= 1
    cases = [value[:HEADER_SIZE - 1], value[:-1], bytes(flipped)]
    for bad in cases:
        with pytest.raises(CorruptStateError):
            decode_frame(bad, layout=state.layout, **expect)
    with pytest.raises(CorruptStateError):
        decode_frame(value, layout=other.layout, **expect)  # another layout, whatever was decoded last
    with pytest.raises(CorruptStateError):
        decode_frame(value, layout=state.layout, **{**expect, "namespace": "elsewhere"})
    assert decode_frame(value, layout=state.layout, verify=False, **expect)[0].tolist() == piece.tokens.tolist()
