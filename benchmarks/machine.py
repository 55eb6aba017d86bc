"""The conditions a benchmark ran under, and writing its JSON, shared by every script in ``benchmarks/``.

Every result file carries :func:`machine` under ``"machine"`` (CPU, cores, memory, load, versions), so a
number can be read with the conditions it was measured under; :func:`finish` adds the load at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _llama_cache_version() -> str | None:
    """The version ``pyproject.toml`` declares (read from the file: a checkout is run from PYTHONPATH, not
    installed, so package metadata may be absent)."""
    with contextlib.suppress(OSError):
        found = re.search(r'^version\s*=\s*"([^"]+)"', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
        return found.group(1) if found else None
    return None


def machine() -> dict[str, Any]:
    """The CPU model, logical and physical cores, memory, load and software versions of this run."""
    import llama_cpp
    import numpy

    from llama_cache.server.config import physical_cores

    cpu = "unknown"
    memory = None
    with contextlib.suppress(OSError):
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), cpu)
        memory = next((int(line.split()[1]) << 10 for line in Path("/proc/meminfo").read_text().splitlines()
                       if line.startswith("MemTotal:")), None)
    commit = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True,
                            text=True).stdout.strip()
    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "physical_cores": physical_cores(), "memory_bytes": memory,
            "platform": platform.platform(), "python": platform.python_version(), "numpy": numpy.__version__,
            "llama_cpp_python": llama_cpp.__version__, "llama_cache": _llama_cache_version(),
            "llama_cache_commit": commit or None,
            "load_average_start": [round(x, 2) for x in os.getloadavg()]}


def finish(results: dict[str, Any]) -> None:
    """Record the load average at the end of the run in ``results["machine"]``."""
    results["machine"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]


def write(path: Path, results: dict[str, Any]) -> None:
    """Write ``results`` as indented JSON to ``path`` (its directory created), replacing the file whole:
    called after each step, a later failure leaves the steps done so far on disk."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(results, indent=2, default=float) + "\n")
    partial.replace(path)
