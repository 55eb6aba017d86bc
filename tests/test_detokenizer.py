"""Every token's exact text: :class:`llama_cache.detokenizer.Detokenizer` and ``llama_cache.Llama.detokenize``.

llama-cpp-python 0.3.36 renders each token into a 32-byte buffer and loses any longer piece; these tests
walk whole vocabularies against llama.cpp's own ``llama_token_to_piece`` with a buffer large enough.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import pytest

from llama_cache import Llama, default_model_path
from llama_cache.detokenizer import Detokenizer
from llama_cache.testing.tiny_models import TINY_ARCHITECTURES

LONG_TEXT = "def f():\n" + " " * 48 + "return 1\n" + "-" * 64 + "\n\n" + "=" * 80


@pytest.fixture(scope="module")
def llm() -> Iterator[Llama]:
    model = Llama(model_path=str(default_model_path()), n_ctx=256, verbose=False)
    yield model
    model.close()


def _llama_cpp_piece(vocab: llama_cpp.llama_vocab_p, token: int, special: bool) -> bytes:
    """llama.cpp's own piece for ``token``, rendered into a buffer as large as it asks for."""
    buffer = ctypes.create_string_buffer(8)
    size = llama_cpp.llama_token_to_piece(vocab, token, buffer, len(buffer), 0, special)
    if size < 0:
        buffer = ctypes.create_string_buffer(-size)
        size = llama_cpp.llama_token_to_piece(vocab, token, buffer, len(buffer), 0, special)
    assert size >= 0
    return buffer.raw[:size]


def _walk_vocabulary(model: llama_cpp.Llama) -> int:
    """Check every token's piece, both renderings, against llama.cpp's; how many pieces exceed 32 bytes."""
    detokenizer = Detokenizer.for_llama(model)
    vocab = llama_cpp.llama_model_get_vocab(model.model)
    long_pieces = 0
    for token in range(model.n_vocab()):
        for special in (False, True):
            expected = _llama_cpp_piece(vocab, token, special)
            assert detokenizer.piece(token, special) == expected, (token, special)
            if token != model.token_bos():
                assert detokenizer.detokenize([token], special=special) == expected
        long_pieces += len(_llama_cpp_piece(vocab, token, True)) > 32
    return long_pieces


def test_every_token_of_the_default_model_renders_as_llama_cpp_s_own_piece(llm: Llama) -> None:
    assert _walk_vocabulary(llm) == 47  # SmolLM2's pieces that llama-cpp-python's 32-byte buffer drops


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_every_token_of_the_tiny_models_renders_as_llama_cpp_s_own_piece(
    tiny_model_paths: dict[str, Path], arch: str
) -> None:
    model = llama_cpp.Llama(model_path=str(tiny_model_paths[arch]), n_ctx=64, verbose=False)
    try:
        _walk_vocabulary(model)
    finally:
        model.close()


def test_long_runs_of_spaces_and_dashes_round_trip_where_llama_cpp_python_drops_them(llm: Llama) -> None:
    tokens = llm.tokenize(LONG_TEXT.encode(), add_bos=False)
    assert llm.detokenize(tokens).decode() == LONG_TEXT
    # The finding this fixes: llama-cpp-python's own rendering loses the long pieces.
    upstream = llama_cpp.Llama.detokenize(llm, tokens).decode()
    assert upstream != LONG_TEXT and "-" * 64 not in upstream


def test_it_renders_as_llama_cpp_python_wherever_a_piece_fits_its_buffer(llm: Llama) -> None:
    text = "<|im_start|>user\nHello, world! Ünïcödé 你好 🙂<|im_end|>\n"
    for add_bos in (False, True):
        tokens = llm.tokenize(text.encode(), add_bos=add_bos, special=True)
        for special in (False, True):
            assert llm.detokenize(tokens, special=special) == llama_cpp.Llama.detokenize(llm, tokens, special=special)
    bos = llm.token_bos()
    space = llm.tokenize(b" x", add_bos=False)
    # The space a BOS token's text starts with is dropped, as llama-cpp-python does.
    assert llm.detokenize([bos, *space]) == llama_cpp.Llama.detokenize(llm, [bos, *space])


def test_a_completion_s_text_keeps_its_long_tokens(llm: Llama) -> None:
    dashes = llm.tokenize(b"-" * 64, add_bos=False)
    assert len(dashes) == 1  # one 64-byte token: forced below with a logit bias
    result = llm.create_completion(prompt="A rule:", max_tokens=3, temperature=0.0,
                                   logit_bias={dashes[0]: 100.0})
    assert result["choices"][0]["text"] == "-" * 64 * 3
    streamed = "".join(chunk["choices"][0]["text"] for chunk in llm.create_completion(
        prompt="A rule:", max_tokens=3, temperature=0.0, logit_bias={dashes[0]: 100.0}, stream=True))
    assert streamed == "-" * 64 * 3


def test_bad_tokens_are_refused_before_llama_cpp_sees_them(llm: Llama) -> None:
    detokenizer = llm.detokenizer
    for bad in (-1, llm.n_vocab(), 2**40):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            detokenizer.piece(bad)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            detokenizer.detokenize([1, bad])
    with pytest.raises(TypeError):
        detokenizer.detokenize(["a"])  # type: ignore[list-item]
    assert detokenizer.detokenize([]) == b""
    with pytest.raises(ValueError):
        Detokenizer(llama_cpp.llama_model_get_vocab(llm.model), 0)


def test_half_a_million_tokens_are_joined_in_one_pass(llm: Llama) -> None:
    tokens = llm.tokenize(LONG_TEXT.encode(), add_bos=False)
    many = tokens * (500_000 // len(tokens))
    assert llm.detokenize(many) == LONG_TEXT.encode() * (500_000 // len(tokens))
