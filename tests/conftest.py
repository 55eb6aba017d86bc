"""Fixtures shared by the test modules: the tokenizer source, the tiny recurrent/hybrid models, disk caches."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from llama_cache import LlamaDiskCache, default_model_path
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


@pytest.fixture
def open_cache(tmp_path: Path) -> Iterator[Callable[..., LlamaDiskCache]]:
    """A factory of disk caches in ``tmp_path / "cache"`` (or ``cache_dir=``), all closed at teardown."""
    caches: list[LlamaDiskCache] = []

    def factory(capacity_bytes: int = 10**7, **kwargs: Any) -> LlamaDiskCache:
        cache = LlamaDiskCache(kwargs.pop("cache_dir", tmp_path / "cache"), capacity_bytes, **kwargs)
        caches.append(cache)
        return cache

    yield factory
    for cache in caches:
        cache.close()
