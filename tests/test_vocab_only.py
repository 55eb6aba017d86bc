"""A vocabulary-only ``llama_cache.Llama`` (for tokenizing): made without touching the weights."""

from __future__ import annotations

import pytest

from llama_cache import Llama, default_model_path


@pytest.mark.model
def test_a_vocabulary_only_llama_has_a_fingerprint_and_tokenizes() -> None:
    # llama.cpp aborts the process when asked about the weights of a vocabulary-only model.
    vocabulary = Llama(model_path=str(default_model_path()), vocab_only=True, verbose=False)
    try:
        assert len(vocabulary.model_fingerprint) == 32
        assert vocabulary.tokenize(b"Hello")
    finally:
        vocabulary.close()
