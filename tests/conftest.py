"""Session fixtures shared by the test modules: the tokenizer source and the tiny recurrent/hybrid models."""

from __future__ import annotations

from pathlib import Path

import pytest

from llama_cache import default_model_path
from llama_cache.testing.tiny_models import TINY_ARCHITECTURES, write_tiny_model


@pytest.fixture(scope="session")
def tokenizer_source() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def tiny_model_paths(tmp_path_factory: pytest.TempPathFactory, tokenizer_source: Path) -> dict[str, Path]:
    """All four tiny models, written once per session."""
    directory = tmp_path_factory.mktemp("tiny_models")
    return {
        arch: write_tiny_model(arch, directory / f"tiny-{arch}.gguf", tokenizer_from=tokenizer_source)
        for arch in TINY_ARCHITECTURES
    }
