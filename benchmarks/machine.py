"""The conditions a benchmark ran under, and writing its JSON, shared by every script in ``benchmarks/``.

Every result file carries :func:`machine` under ``"machine"`` (CPU, cores, memory, load, versions), so a
number can be read with the conditions it was measured under; :func:`finish` adds the load at the end.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
from pathlib import Path
from typing import Any

from llama_cache.measure import finish_conditions, machine_conditions

REPO = Path(__file__).resolve().parents[1]


def _llama_cache_version() -> str | None:
    """The version ``pyproject.toml`` declares (read from the file: a checkout is run from PYTHONPATH, not
    installed, so package metadata may be absent)."""
    with contextlib.suppress(OSError):
        found = re.search(r'^version\s*=\s*"([^"]+)"', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
        return found.group(1) if found else None
    return None


def machine() -> dict[str, Any]:
    """:func:`llama_cache.measure.machine_conditions`, with the checkout's version and git commit."""
    commit = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True,
                            text=True).stdout.strip()
    return {**machine_conditions(), "llama_cache": _llama_cache_version(), "llama_cache_commit": commit or None}


def finish(results: dict[str, Any]) -> None:
    """Record the load average at the end of the run in ``results["machine"]``."""
    finish_conditions(results["machine"])


def write(path: Path, results: dict[str, Any]) -> None:
    """Write ``results`` as indented JSON to ``path`` (its directory created), replacing the file whole:
    called after each step, a later failure leaves the steps done so far on disk."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(results, indent=2, default=float) + "\n")
    partial.replace(path)
