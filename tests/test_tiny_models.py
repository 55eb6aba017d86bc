"""The tiny random-weight recurrent and hybrid models load and behave like real ones in llama.cpp.

What llama-cache relies on: each model loads, reports the right memory kind, tokenizes like the model whose
tokenizer it copied, gives finite logits that depend on the whole prefix, and a saved sequence state restores
bit-identically. The PARTIAL_ONLY state (the recurrent part alone) is small and independent of the length.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from llama_cache.testing.tiny_models import TINY_ARCHITECTURES, write_tiny_model

# (llama_model_is_recurrent, llama_model_is_hybrid) for each architecture.
EXPECTED_MEMORY_KIND = {
    "mamba": (True, False),
    "mamba2": (True, False),
    "lfm2": (False, True),
    "granitehybrid": (False, True),
}

TEXT = (
    "The history of the lighthouse is, in large part, a history of trade. Long before electric lamps, keepers "
    "burned wood, coal and later whale oil on tall stone towers so that merchant ships could find the harbour "
    "after dark. The Pharos of Alexandria, finished around 280 BC, was counted among the wonders of the ancient "
    "world; medieval travellers described a fire at its top that could be seen from far out at sea. In the "
    "eighteenth century, parabolic reflectors multiplied the light of a single flame, and in 1822 Augustin "
    "Fresnel designed a lens of concentric glass rings that bent scattered rays into one bright beam. Keepers "
    "trimmed wicks every few hours, wound the clockwork that turned the lens, and wrote the weather into a log. "
    "Today most lights are automatic, watched from a distance, and many towers have become museums. Their "
    "lenses, some taller than a person, are polished by volunteers, and the keepers' logbooks, full of storms, "
    "shipwrecks and rescues, are read by historians who study how coastal towns grew around the light."
)
OTHER_TEXT = "Quantum computers store information in qubits, which can be in a superposition of zero and one."
CONTINUATION = " Visitors climb the spiral stairs to see the old lens up close."
N_PREFIX = 200  # tokens evaluated before a state is saved


@pytest.fixture(params=TINY_ARCHITECTURES)
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def llm(arch: str, tiny_model_paths: dict[str, Path]) -> Iterator[llama_cpp.Llama]:
    model = llama_cpp.Llama(model_path=str(tiny_model_paths[arch]), n_ctx=512, verbose=False)
    try:
        yield model
    finally:
        model.close()


def tokens_of(llm: llama_cpp.Llama, text: str) -> list[int]:
    return llm.tokenize(text.encode("utf-8"), add_bos=False)


def clear_memory(llm: llama_cpp.Llama) -> None:
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)


def decode(llm: llama_cpp.Llama, tokens: Sequence[int]) -> np.ndarray:
    """Append ``tokens`` to sequence 0 and return a copy of the last token's logits."""
    array = (llama_cpp.llama_token * len(tokens))(*tokens)
    assert llama_cpp.llama_decode(llm.ctx, llama_cpp.llama_batch_get_one(array, len(tokens))) == 0
    logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(logits, shape=(llm.n_vocab(),)).copy()


def logits_after(llm: llama_cpp.Llama, tokens: Sequence[int]) -> np.ndarray:
    clear_memory(llm)
    return decode(llm, tokens)


def save_seq_state(llm: llama_cpp.Llama, flags: int = 0) -> bytes:
    size = llama_cpp.llama_state_seq_get_size_ext(llm.ctx, 0, flags)
    buffer = (ctypes.c_uint8 * size)()
    assert llama_cpp.llama_state_seq_get_data_ext(llm.ctx, buffer, size, 0, flags) == size
    return bytes(buffer)


def restore_seq_state(llm: llama_cpp.Llama, state: bytes, flags: int = 0) -> None:
    buffer = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
    assert llama_cpp.llama_state_seq_set_data_ext(llm.ctx, buffer, len(state), 0, flags) == len(state)


def test_unknown_architecture_is_rejected(tmp_path: Path, tokenizer_source: Path) -> None:
    with pytest.raises(ValueError, match="llama"):
        write_tiny_model("llama", tmp_path / "x.gguf", tokenizer_from=tokenizer_source)
    assert not (tmp_path / "x.gguf").exists()


def test_same_seed_same_file(tmp_path: Path, tokenizer_source: Path, tiny_model_paths: dict[str, Path]) -> None:
    again = write_tiny_model("mamba", tmp_path / "again.gguf", tokenizer_from=tokenizer_source, seed=0)
    other = write_tiny_model("mamba", tmp_path / "other.gguf", tokenizer_from=tokenizer_source, seed=1)
    assert again.read_bytes() == tiny_model_paths["mamba"].read_bytes()
    assert other.read_bytes() != again.read_bytes()


def test_files_are_small(tiny_model_paths: dict[str, Path]) -> None:
    for path in tiny_model_paths.values():
        assert path.stat().st_size < 12 * 2**20


def test_memory_kind(arch: str, llm: llama_cpp.Llama) -> None:
    is_recurrent = llama_cpp.llama_model_is_recurrent(llm.model)
    is_hybrid = llama_cpp.llama_model_is_hybrid(llm.model)
    assert (is_recurrent, is_hybrid) == EXPECTED_MEMORY_KIND[arch]


def test_tokenizer_copied_from_source(llm: llama_cpp.Llama, tokenizer_source: Path) -> None:
    source = llama_cpp.Llama(model_path=str(tokenizer_source), vocab_only=True, verbose=False)
    try:
        assert llm.n_vocab() == source.n_vocab() == 49152
        for text in (TEXT, OTHER_TEXT, "<|im_start|>user\nhi<|im_end|>"):
            for special in (False, True):
                data = text.encode("utf-8")
                assert llm.tokenize(data, add_bos=True, special=special) == source.tokenize(
                    data, add_bos=True, special=special
                )
        assert llm.token_eos() == source.token_eos()
    finally:
        source.close()


def test_logits_finite_and_input_dependent(llm: llama_cpp.Llama) -> None:
    text_tokens = tokens_of(llm, TEXT)
    other_tokens = tokens_of(llm, OTHER_TEXT)
    first = logits_after(llm, text_tokens)
    second = logits_after(llm, other_tokens)
    assert np.isfinite(first).all() and np.isfinite(second).all()
    assert not np.array_equal(first, second)
    # The same last token after a different prefix: the (recurrent) state, not only the token, shapes the output.
    same_last = logits_after(llm, other_tokens[:-1] + text_tokens[-1:])
    assert not np.array_equal(first, same_last)
    # Evaluation is deterministic.
    assert np.array_equal(first, logits_after(llm, text_tokens))


def test_seq_state_round_trip_is_bit_identical(llm: llama_cpp.Llama) -> None:
    prefix = tokens_of(llm, TEXT)[:N_PREFIX]
    continuation = tokens_of(llm, CONTINUATION)
    assert len(prefix) == N_PREFIX

    logits_after(llm, prefix)
    size = llama_cpp.llama_state_seq_get_size(llm.ctx, 0)
    buffer = (ctypes.c_uint8 * size)()
    assert llama_cpp.llama_state_seq_get_data(llm.ctx, buffer, size, 0) == size
    expected = decode(llm, continuation)

    clear_memory(llm)
    assert llama_cpp.llama_state_seq_set_data(llm.ctx, buffer, size, 0) == size
    restored = decode(llm, continuation)

    assert np.isfinite(expected).all()
    assert np.array_equal(restored, expected)
    assert np.array_equal(restored, logits_after(llm, prefix + continuation))


def test_partial_only_state_is_small_and_length_independent(arch: str, llm: llama_cpp.Llama) -> None:
    partial_flag = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
    prefix = tokens_of(llm, TEXT)[:N_PREFIX]

    logits_after(llm, prefix[:10])
    partial_short = len(save_seq_state(llm, partial_flag))
    full_short = len(save_seq_state(llm))

    logits_after(llm, prefix)
    partial = len(save_seq_state(llm, partial_flag))
    full = len(save_seq_state(llm))
    assert full == llama_cpp.llama_state_seq_get_size(llm.ctx, 0)

    # The recurrent state has a fixed size: 4 layers of conv + SSM state of a 32-wide model, a few KiB each.
    assert 0 < partial == partial_short < 32 * 1024
    is_recurrent, _ = EXPECTED_MEMORY_KIND[arch]
    if is_recurrent:
        assert full == partial and full_short == full  # nothing but the recurrent state
    else:
        assert partial < full_short < full  # the attention KV cache grows with the prefix


@pytest.mark.parametrize("arch", [a for a in TINY_ARCHITECTURES if EXPECTED_MEMORY_KIND[a][0]])
def test_partial_only_round_trip_of_recurrent_model(llm: llama_cpp.Llama) -> None:
    """For a purely recurrent model the PARTIAL_ONLY state is the whole state and restores bit-identically."""
    partial_flag = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
    prefix = tokens_of(llm, TEXT)[:N_PREFIX]
    continuation = tokens_of(llm, CONTINUATION)

    logits_after(llm, prefix)
    state = save_seq_state(llm, partial_flag)
    expected = decode(llm, continuation)

    clear_memory(llm)
    restore_seq_state(llm, state, partial_flag)
    assert np.array_equal(decode(llm, continuation), expected)
