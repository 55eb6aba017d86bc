"""The package as pip installs it: what ``import llama_cache`` loads, and what pyproject.toml must declare.

The installed wheel itself (its files, its console script, a clean environment) is checked by
``tools/check_wheel``, which CI runs after the suite.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

import llama_cache
from llama_cache.caches import redis_tier

ROOT = Path(__file__).resolve().parent.parent
# What the code under each folder may import: pyproject.toml's groups (`dependencies` or extras), the
# most specific folder first. The package itself only what `pip install llama-cache` installs.
ALLOWED_GROUPS = [
    ("llama_cache/testing", ("dependencies", "testing")),
    ("llama_cache", ("dependencies",)),
    ("tests", ("dependencies", "testing", "dev")),
    ("benchmarks", ("dependencies", "testing", "benchmark")),
]
LOCAL_MODULES = {"llama_cache", "tests", "benchmarks"}


def test_import_does_not_load_redis(tmp_path: Path) -> None:
    probe = "import sys, llama_cache; print(sorted(m for m in ('redis', 'hiredis') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.model
def test_a_server_without_redis_or_structured_outputs_loads_neither(tmp_path: Path) -> None:
    # redis-py and llguidance cost a server about 6 MB of memory it holds for nothing when no Redis tier
    # is configured and no client asks for a schema or grammar: they are imported when first needed.
    probe = ("import sys; from llama_cache.server.app import create_app; from llama_cache.server.config import ServerConfig; "
             "from llama_cache.server.service import load_service; "
             "config = ServerConfig(n_ctx=256, parallel=1); service = load_service(config); create_app(service, config); "
             "print(sorted(m for m in ('redis', 'hiredis', 'llguidance') if m in sys.modules)); "
             "service.constraints.compile({'type': 'integer'}); print('llguidance' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["[]", "True"]


def test_the_redis_tier_is_exported_on_first_access() -> None:
    assert "LlamaRedisCache" in llama_cache.__all__
    assert "LlamaRedisCache" in dir(llama_cache)
    assert llama_cache.LlamaRedisCache is redis_tier.LlamaRedisCache
    assert not hasattr(llama_cache, "LlamaMissingCache")


def test_star_import_includes_the_redis_tier(tmp_path: Path) -> None:
    probe = "from llama_cache import *; print(LlamaRedisCache.__module__)"
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "llama_cache.caches.redis_tier"


def _top_level_imports(source: Path) -> set[str]:
    """Top-level names of the absolute imports anywhere in ``source`` (function bodies included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text(), filename=str(source))):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            names.add(node.module.partition(".")[0])
    return names


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(requirements: list[str]) -> set[str]:
    names = set()
    for requirement in requirements:
        match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
        assert match is not None, requirement
        names.add(_normalized(match.group()))
    return names


def test_every_third_party_import_is_declared() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = {"dependencies": project["dependencies"], **project["optional-dependencies"]}
    distributions = metadata.packages_distributions()
    undeclared = []
    for folder, allowed in ALLOWED_GROUPS:
        declared = set().union(*(_requirement_names(groups[group]) for group in allowed))
        inner = [ROOT / other for other, _ in ALLOWED_GROUPS if other.startswith(folder + "/")]
        for source in sorted((ROOT / folder).rglob("*.py")):
            if any(directory in source.parents for directory in inner):
                continue
            for module in sorted(_top_level_imports(source) - set(sys.stdlib_module_names) - LOCAL_MODULES):
                # A module no installed distribution provides is undeclared too: nothing would install it.
                providers = {_normalized(name) for name in distributions.get(module, [])}
                if not providers & declared:
                    undeclared.append(f"{source.relative_to(ROOT)}: {module} ({sorted(providers) or 'not installed'})")
    assert undeclared == []
