"""LlamaState, its KV layout parser and its binary format, on real llama.cpp sequence states."""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Iterator

import llama_cpp
import numpy as np
import pytest

from llama_cache import default_model_path
from llama_cache.llama import Llama
from llama_cache.state import format as state_format
from llama_cache.state.kv_layout import parse_seq_state, serialize_segments, serialize_segments_into
from llama_cache.state.llama_state import RESTORE_STAGING, LlamaState

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


def _canonical(llm: Llama) -> LlamaState:
    """A state holding llama.cpp's own bytes for the evaluated text (a save may share an earlier state's)."""
    tokens = np.array(llm.input_ids[: llm.n_tokens], dtype=np.int32)
    return LlamaState.from_seq_bytes(tokens, None, 0, llm.fingerprint, llm._read_seq_bytes())


def _states(llm: Llama) -> dict[str, LlamaState]:
    """A canonical state, a view of its first tokens, a state of two segments (view + own tokens) with
    llama.cpp's bytes kept beside it, and the same without them ("assembled")."""
    whole = _canonical(llm)
    view = whole.prefix(5, logits=None)
    two = view.extended(5, whole.tokens, whole.logits, whole.seed, llm._read_seq_bytes())
    assert len(two.segments) == 2 and two.segments[0].buffer is whole.segments[0].buffer
    assembled = view.extended(5, whole.tokens, whole.logits, whole.seed, llm._read_seq_bytes())
    assert assembled.restore_copy is not None and assembled.restore_copy.release() > 0
    return {"canonical": whole, "view": view, "two segments": two, "assembled": assembled}


def _llama_cpp_seq_bytes(llm: Llama, seq: np.ndarray, seq_id: int, n_tokens: int) -> np.ndarray:
    """llama.cpp's own bytes for the first ``n_tokens`` of ``seq`` held as sequence ``seq_id``.

    Loaded into a fresh context of the same model, cut back there, and read out by llama.cpp itself:
    independent of this library's assembly. (llama.cpp writes a cell's sequence ids only below the
    context's ``n_seq_max``: the context has ``seq_id + 1`` sequences, in one unified KV.)
    """
    params = llama_cpp.llama_context_params.from_buffer_copy(llm.context_params)
    params.n_seq_max, params.kv_unified = seq_id + 1, True
    ctx = llama_cpp.llama_init_from_model(llm.model, params)
    assert ctx is not None
    try:
        pointer = seq.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        assert llama_cpp.llama_state_seq_set_data(ctx, pointer, len(seq), seq_id) == len(seq)
        assert llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), seq_id, n_tokens, -1)
        size = llama_cpp.llama_state_seq_get_size(ctx, seq_id)
        out = np.empty(size, dtype=np.uint8)
        written = llama_cpp.llama_state_seq_get_data(ctx, out.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size,
                                                     seq_id)
        assert 0 < written <= size
        return out[:written]
    finally:
        llama_cpp.llama_free(ctx)


@pytest.mark.parametrize("kind", ["canonical", "view", "two segments", "assembled"])
@pytest.mark.parametrize("seq_id", [0, 3])
def test_restore_bytes_are_the_assembled_bytes(llm: Llama, kind: str, seq_id: int) -> None:
    state = _states(llm)[kind]
    expected = _llama_cpp_seq_bytes(llm, llm._read_seq_bytes(), seq_id, state.n_tokens)
    assert np.array_equal(state.seq_bytes(seq_id), expected)
    assert state.needs_assembly(seq_id) == (kind in ("view", "assembled") or seq_id != 0)
    for _ in range(2):  # the second time in a reused buffer
        with state.restore_bytes(seq_id) as data:
            assert data.flags.c_contiguous and not data.flags.writeable
            assert np.array_equal(data, expected)


def test_restore_bytes_of_canonical_and_opaque_states_are_lent_without_a_copy(llm: Llama) -> None:
    state = _canonical(llm)
    with state.restore_bytes(0) as data:
        assert np.shares_memory(data, state.segments[0].buffer)
    opaque = LlamaState(state.tokens, None, 0, "f", opaque=state.seq_bytes().copy())
    with opaque.restore_bytes(0) as data:
        assert np.shares_memory(data, opaque.seq_bytes())


def test_assembled_states_are_staged_ahead_and_restored_in_a_reused_buffer(llm: Llama) -> None:
    RESTORE_STAGING.clear()
    states = _states(llm)  # making the view reserves a buffer for it
    states["long"] = states["assembled"].prefix(states["assembled"].n_tokens - 1, None)  # and this one
    allocations = RESTORE_STAGING.allocations
    assert RESTORE_STAGING.idle_nbytes >= states["long"].llama_state_size
    for state in (states["view"], states["long"], states["view"]):
        with state.restore_bytes(0):
            pass
    assert RESTORE_STAGING.allocations == allocations
    assert not np.shares_memory(states["view"].seq_bytes(), RESTORE_STAGING._idle[-1])  # seq_bytes owns its copy


def test_a_staged_state_restores_into_llama_cpp(llm: Llama) -> None:
    """Bytes lent by restore_bytes are read by llama.cpp whole, and it then holds exactly that sequence."""
    view = llm.save_state().prefix(6, logits=None)
    ctx = llm._ctx.ctx
    try:
        with view.restore_bytes(0) as data:
            llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), 0, -1, -1)
            pointer = data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
            assert llama_cpp.llama_state_seq_set_data(ctx, pointer, len(data), 0) == len(data)
        assert np.array_equal(llm._read_seq_bytes(), view.seq_bytes())
    finally:  # the module's model goes back to holding the whole text
        llm.reset()
        llm.eval(llm.tokenize(TEXT))


def test_serialize_into_checks_its_target(llm: Llama) -> None:
    state = llm.save_state()
    assert state.layout is not None
    size = state.llama_state_size
    out = np.full(size + 10, 0xEE, np.uint8)
    written = serialize_segments_into(state.layout, list(state.segments), out)
    assert len(written) == size and np.shares_memory(written, out) and (out[size:] == 0xEE).all()
    assert np.array_equal(written, state.seq_bytes())
    with pytest.raises(ValueError):
        serialize_segments_into(state.layout, list(state.segments), np.empty(size - 1, np.uint8))
    with pytest.raises(ValueError):
        serialize_segments_into(state.layout, list(state.segments), np.empty(size, np.int16))
    with pytest.raises(ValueError):
        serialize_segments_into(state.layout, list(state.segments), np.empty(2 * size, np.uint8)[::2])


def _restore_and_read_back(llm: Llama, data: np.ndarray, keep: int | None) -> np.ndarray:
    ctx = llm._ctx.ctx
    memory = llama_cpp.llama_get_memory(ctx)
    llama_cpp.llama_memory_seq_rm(memory, 0, -1, -1)
    pointer = data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
    assert llama_cpp.llama_state_seq_set_data(ctx, pointer, len(data), 0) == len(data)
    if keep is not None:
        assert llama_cpp.llama_memory_seq_rm(memory, 0, keep, -1)
    return llm._read_seq_bytes()


def test_a_view_close_to_its_parent_restores_from_the_parent_bytes_then_cuts(llm: Llama) -> None:
    whole = _canonical(llm)
    n = whole.n_tokens
    view = whole.prefix(n - 2, logits=None)
    assert not view.needs_assembly(0) and view.needs_assembly(1)
    try:
        with view.restore_source(0) as (data, held):
            assert held == n and np.shares_memory(data, whole.seq_bytes()) and not data.flags.writeable
            restored = _restore_and_read_back(llm, data, view.n_tokens)
        assert np.array_equal(restored, view.seq_bytes())
    finally:
        llm.reset()
        llm.eval(llm.tokenize(TEXT))


@pytest.mark.parametrize("case", ["far from its parent", "another sequence", "two segments"])
def test_other_states_restore_from_assembled_bytes(llm: Llama, case: str) -> None:
    states = _states(llm)
    state, seq_id = {
        "far from its parent": (states["view"], 0),  # 5 of the text's tokens: far more than a quarter cut
        "another sequence": (states["canonical"].prefix(states["canonical"].n_tokens - 1, None), 3),
        "two segments": (states["assembled"], 0),
    }[case]
    with state.restore_source(seq_id) as (data, held):
        assert held == state.n_tokens
        assert np.array_equal(data, state.seq_bytes(seq_id))


def test_an_extended_state_restores_from_the_llama_cpp_bytes_kept_beside_it(llm: Llama) -> None:
    """A chat turn (two segments) restores without assembling, and its KV is the assembled state's."""
    two = _states(llm)["two segments"]
    copy = two.restore_copy
    assert copy is not None and copy.data is not None and copy.n_tokens == two.n_tokens
    assembled = serialize_segments(two.layout, list(two.segments), 0)  # type: ignore[arg-type]
    assert not two.needs_assembly(0) and two.needs_assembly(3)
    assert (copy, copy.nbytes) in two.memory_blocks()
    assert two.nbytes == copy.nbytes + sum({id(s.buffer): s.buffer.nbytes for s in two.segments}.values()) + (
        two.tokens.nbytes + (0 if two.logits is None else two.logits.nbytes)
    )
    try:
        with two.restore_source(0) as (data, held):
            assert held == two.n_tokens and np.shares_memory(data, copy.data) and not data.flags.writeable
            assert np.array_equal(_restore_and_read_back(llm, data, None), assembled)
        nbytes = two.nbytes
        assert copy.release() == len(assembled) and copy.data is None and copy.release() == 0
        assert two.needs_assembly(0) and two.nbytes == nbytes - len(assembled)
        assert all(identity is not copy for identity, _ in two.memory_blocks())
        with two.restore_source(0) as (data, held):
            assert held == two.n_tokens
            assert np.array_equal(_restore_and_read_back(llm, data, None), assembled)
    finally:
        llm.reset()
        llm.eval(llm.tokenize(TEXT))


def test_views_of_an_extended_state_share_its_copy_and_restore_from_it_then_cut(llm: Llama) -> None:
    two = _states(llm)["two segments"]
    view = two.prefix(two.n_tokens - 2, logits=None)
    copy = view.restore_copy
    assert copy is two.restore_copy and copy is not None and copy.data is not None
    assert two.without_logits().restore_copy is copy
    assert not view.needs_assembly(0)
    try:
        with view.restore_source(0) as (data, held):
            assert held == two.n_tokens and np.shares_memory(data, copy.data)
            restored = _restore_and_read_back(llm, data, view.n_tokens)
        assert np.array_equal(restored, serialize_segments(view.layout, list(view.segments), 0))  # type: ignore[arg-type]
    finally:
        llm.reset()
        llm.eval(llm.tokenize(TEXT))
    far = two.prefix(4, logits=None)  # fewer than half the copy's tokens: assembled, as far views are
    assert far.restore_copy is copy and far.needs_assembly(0)


def test_an_extension_without_new_tokens_keeps_no_copy_of_its_own(llm: Llama) -> None:
    whole = _canonical(llm)
    same = whole.extended(whole.n_tokens, whole.tokens, None, 0, llm._read_seq_bytes())
    assert same.restore_copy is None and not same.needs_assembly(0)
    two = _states(llm)["two segments"]
    again = two.extended(two.n_tokens, two.tokens, None, 0, llm._read_seq_bytes())
    assert again.restore_copy is two.restore_copy


@pytest.mark.parametrize("v_trans", [True, False], ids=["values-transposed", "values-by-token"])
def test_cells_written_out_of_position_order_are_parsed_into_position_order(v_trans: bool) -> None:
    # An engine's sequence holds cells all over the pool: llama.cpp writes them in cell order.
    from llama_cache.state.kv_layout import SEQ_STATE_MAGIC

    n, k_row, embd, el = 300, 8, 6, 2
    positions = np.random.default_rng(3).permutation(n)
    cells = np.zeros(n, dtype=[("pos", "<i4"), ("n_seq", "<u4"), ("seq", "<i4")])
    cells["pos"], cells["n_seq"] = positions, 1
    parts = [np.array([SEQ_STATE_MAGIC, 0, 1, n], "<u4").tobytes(), cells.tobytes(),
             np.array([int(v_trans), 2], "<u4").tobytes()]
    for layer in range(2):  # each cell's key row says its position and layer
        rows = np.repeat(((positions * 7 + layer) % 251).astype(np.uint8)[:, None], k_row, axis=1)
        parts += [np.array([1], "<i4").tobytes(), np.array([k_row], "<u8").tobytes(), rows.tobytes()]
    for layer in range(2):  # each value element says its position, dimension and layer
        element = (positions[None, :] * 3 + np.arange(embd)[:, None] * 11 + layer).astype("<u2")  # (embd, n)
        if v_trans:
            parts += [np.array([1], "<i4").tobytes(), np.array([el, embd], "<u4").tobytes(), element.tobytes()]
        else:
            parts += [np.array([1], "<i4").tobytes(), np.array([embd * el], "<u8").tobytes(), element.T.copy().tobytes()]
    parsed = parse_seq_state(np.frombuffer(b"".join(parts), dtype=np.uint8))
    assert parsed is not None
    layout, segment = parsed
    in_order = np.arange(n)
    for layer in range(2):
        assert np.array_equal(segment.k[layer][:, 0], ((in_order * 7 + layer) % 251).astype(np.uint8))
        expected = (in_order[None, :] * 3 + np.arange(embd)[:, None] * 11 + layer).astype("<u2")
        got = segment.v[layer].view("<u2")
        assert np.array_equal(got if v_trans else got.T, expected)
