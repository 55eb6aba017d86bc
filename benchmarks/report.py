"""What the table renderers of ``benchmarks/tables.py`` share: the result files, formatting, the registry.

A renderer is a function of :class:`Results` returning a block's Markdown, registered under the block's
name with :func:`renders`; ``benchmarks/table_blocks.py`` holds them all.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


class MissingResult(Exception):
    """A result file a table needs is not in ``benchmarks/results/``."""


class Results:
    """The result files, loaded on first use, by script name (``serve`` is ``serve.json``)."""

    def __init__(self, directory: Path = RESULTS) -> None:
        self.directory = directory
        self._loaded: dict[str, dict[str, Any]] = {}

    def __getitem__(self, name: str) -> dict[str, Any]:
        if name not in self._loaded:
            path = self.directory / f"{name}.json"
            if not path.is_file():
                raise MissingResult(f"benchmarks/results/{name}.json is missing: run its script")
            self._loaded[name] = json.loads(path.read_text())
        return self._loaded[name]


# Formatting --------------------------------------------------------------------------------------


def table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def num(value: float | None, places: int | None = None) -> str:
    """``value`` with thousands separators and ``places`` decimals (by default 2 below 10, 1 below 100,
    none above); "-" for None."""
    if value is None:
        return "-"
    if places is None:
        places = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    return f"{value:,.{places}f}"


def ratio(value: float | None, places: int = 2) -> str:
    return "-" if value is None else f"{value:.{places}f}x"


def ms(seconds: float | None) -> str:
    """Seconds shown as milliseconds, without the unit."""
    return "-" if seconds is None else num(seconds * 1000)


def spread(stats: dict[str, float] | None, unit: Callable[[float | None], str] = num, suffix: str = "") -> str:
    """``median (min-max)`` of a ``{"median", "min", "max"}`` summary, each shown by ``unit``, then ``suffix``."""
    if not stats:
        return "-"
    return f"{unit(stats['median'])} ({unit(stats['min'])}-{unit(stats['max'])}){suffix}"


def verdict(met: bool | str | None) -> str:
    """A script's verdict, in bold when a target is not met."""
    if met is None or met == "not measured":
        return "not measured"
    return "met" if met is True or str(met).lower() == "met" else "**NOT MET**"


def conditions(result: dict[str, Any], extra: str = "") -> str:
    """One line: where and when the run was made, from its ``machine`` block."""
    machine = result.get("machine") or {}
    start = machine.get("load_average_start") or [None]
    end = machine.get("load_average_end") or result.get("load_average_end") or [None]
    if start[0] is None:
        load = "load average not recorded"
    elif end[0] is None:
        load = f"load average {start[0]} at start"
    else:
        load = f"load average {start[0]} at start, {end[0]} at end"
    memory = machine.get("memory_bytes")
    parts = [
        f"{machine.get('cpu', 'unknown CPU')}, {machine.get('physical_cores', '?')} cores",
        f"{memory / 2**30:.0f} GiB" if memory else None,
        load,
        f"llama-cpp-python {machine['llama_cpp_python']}" if machine.get("llama_cpp_python") else None,
        f"commit {machine['llama_cache_commit']}" if machine.get("llama_cache_commit") else None,
        machine.get("date", "")[:10] or None,
        extra or None,
    ]
    return "Measured on " + "; ".join(p for p in parts if p) + "."


# The blocks --------------------------------------------------------------------------------------

RENDERERS: dict[str, Callable[[Results], str]] = {}


def renders(name: str) -> Callable[[Callable[[Results], str]], Callable[[Results], str]]:
    def register(function: Callable[[Results], str]) -> Callable[[Results], str]:
        RENDERERS[name] = function
        return function
    return register
