"""Fixtures shared by the test modules: the tokenizer source, the tiny recurrent/hybrid models, disk caches.

Also the suite's set-up:

- ``LLAMA_CACHE_HOME`` points at a temporary folder for the whole session (and the processes tests
  start), so no test reads or writes the user's ``~/.cache/llama-cache/file-identities.json``.
- Redis: tests needing ``redis-server`` skip without it, unless ``LLAMA_CACHE_REQUIRE_REDIS=1`` or
  ``CI`` is set: then the session stops at once, saying so (CI never skips them silently).
- ``LLAMA_CACHE_TEST_SHUFFLE=<seed>`` runs the modules, and the tests within each, in an order shuffled
  by ``seed`` (printed in the header, so an order-dependent failure can be replayed); ``random`` picks
  a seed.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from llama_cache import LlamaDiskCache, default_model_path
from llama_cache.testing.redis_server import redis_available
from llama_cache.testing.tiny_models import TINY_ARCHITECTURES, write_tiny_model


@pytest.fixture(scope="session", autouse=True)
def _isolated_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A ``LLAMA_CACHE_HOME`` of the session's own, for this process and the ones its tests start."""
    home = tmp_path_factory.mktemp("llama-cache-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLAMA_CACHE_HOME", str(home))
        yield home


def _redis_required() -> bool:
    ci = os.environ.get("CI", "").strip().lower()
    return os.environ.get("LLAMA_CACHE_REQUIRE_REDIS") == "1" or ci not in ("", "0", "false", "no")


def _shuffle_seed() -> int | None:
    value = os.environ.get("LLAMA_CACHE_TEST_SHUFFLE", "").strip()
    if not value:
        return None
    if value == "random":
        seed = random.SystemRandom().randrange(1 << 32)
        os.environ["LLAMA_CACHE_TEST_SHUFFLE"] = str(seed)  # the same seed for the whole session
        return seed
    try:
        return int(value)
    except ValueError:
        raise pytest.UsageError(f"LLAMA_CACHE_TEST_SHUFFLE must be an integer seed or 'random', got {value!r}") from None


def pytest_configure(config: pytest.Config) -> None:
    if _redis_required() and not redis_available():
        raise pytest.UsageError(
            "redis-server and redis-cli are required (LLAMA_CACHE_REQUIRE_REDIS=1 or CI is set) but not on PATH: "
            "install them (Debian: apt-get install redis-server) or unset both to skip the Redis tests"
        )


def pytest_report_header(config: pytest.Config) -> str | None:
    seed = _shuffle_seed()
    return None if seed is None else f"test order shuffled: LLAMA_CACHE_TEST_SHUFFLE={seed}"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    seed = _shuffle_seed()
    if seed is not None:  # the header is not printed under -q
        terminalreporter.write_line(f"test order shuffled: LLAMA_CACHE_TEST_SHUFFLE={seed}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Shuffle the modules, then the tests within each (as pytest-randomly does: a module's fixtures are
    still set up once, not once per test)."""
    seed = _shuffle_seed()
    if seed is None:
        return
    rng = random.Random(seed)
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    groups = list(modules.values())
    rng.shuffle(groups)
    for group in groups:
        rng.shuffle(group)
    items[:] = [item for group in groups for item in group]


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
    """A factory of disk caches in ``tmp_path / "cache"`` (or ``cache_dir=``), all closed at teardown.

    ``capacity_bytes`` is the room for the entries' files (``cache_size``, what the shared cache
    contract budgets): each cache is given that plus what an empty cache takes
    (:meth:`LlamaDiskCache.minimum_capacity`: its index and folders). A capacity that is not a
    positive int is passed on as it is, to be refused.
    """
    caches: list[LlamaDiskCache] = []

    def factory(capacity_bytes: int = 10**7, **kwargs: Any) -> LlamaDiskCache:
        directory = kwargs.pop("cache_dir", tmp_path / "cache")
        if isinstance(capacity_bytes, int) and not isinstance(capacity_bytes, bool) and capacity_bytes > 0:
            capacity_bytes += LlamaDiskCache.minimum_capacity(directory)
        cache = LlamaDiskCache(directory, capacity_bytes, **kwargs)
        caches.append(cache)
        return cache

    yield factory
    for cache in caches:
        cache.close()
