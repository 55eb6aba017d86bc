"""Disk tier I/O before and after it stopped memory-mapping (index and payloads), side by side.

    tools/run python benchmarks/disk_io.py                   # against the last memory-mapped commit
    tools/run python benchmarks/disk_io.py --before <ref>    # against any other commit
    tools/run python benchmarks/disk_io.py --quick           # fewer repeats, for a smoke run

The index used to be SQLite in WAL mode (a memory-mapped ``-shm``) and payloads were memory-mapped;
both made a file truncated by another process a SIGBUS. Now the index is a rollback journal on the
``unix-none`` VFS with ``flock`` on the directory, and payloads are read into private buffers. This
script measures what that costs: ``git archive`` exports the package as of ``--before`` into a
temporary folder, and each side runs the same measurements in fresh processes (``PYTHONPATH`` picks
the package), alternating sides for ``--rounds`` rounds (default 5); the table gives each figure's median over
the rounds. Synthetic transformer states (:func:`llama_cache.testing.states.synthetic_state`) sized
like the default model's KV (about 23 KB per token) keep it model-free:

- stores per second, synchronous (``write_behind=False``): small 20 KB states stored whole (the
  commit dominates) and 512-token states (11.8 MB) stored whole and as chunks;
- ``key in cache`` and ``match_length`` with 1,000 entries (the index's lock and sync);
- a hit (``cache[key]``: lookup, read, checksum, decode, touch) of a small state, and of a 512-token
  state stored whole and as chunks, page cache hot; ``lookup_prefix`` of half the chunked one;
- what a whole-state store costs besides the bytes, counted (not timed) over further stores after the
  timed ones: SQLite statements (``set_trace_callback`` on every connection the package opens), and
  the ``open``, ``mkdir`` and ``stat`` calls of the process (``os.open``, ``os.mkdir``, ``os.stat`` and
  ``os.lstat`` wrapped while counting).

Prints the verdicts of issue #28's targets (whole-state stores at least 0.9x the rate before, at most
6 statements per store) and writes ``benchmarks/results/disk_io.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "disk_io.json"
BEFORE = "5137aeb"  # the last commit whose disk tier memory-mapped its index and payloads
_CHILD = "--child"
ROW = 5_760  # synthetic K/V row bytes: 4 * ROW = 23,040 bytes of KV per token, as the default model
BIG_TOKENS = 512
RATE_TARGET = 0.9  # whole-state stores: after / before
STATEMENTS_TARGET = 6  # SQLite statements per whole-state store
SMALL_COUNTED = 200  # small stores counted (after the timed ones)
BIG_COUNTED = 3  # 512-token whole stores counted


class Counter:
    """Counts SQLite statements and ``open``/``mkdir``/``stat`` calls while :meth:`counting` (nothing
    is wrapped outside it, so that timed loops run as they are). Works with any version of the package:
    it hooks ``sqlite3.connect`` and ``os``, not the package."""

    def __init__(self) -> None:
        self.connections: list[Any] = []
        self.counts = {"statements": 0, "open": 0, "mkdir": 0, "stat": 0}
        real = sqlite3.connect

        def connect(*args: Any, **kwargs: Any) -> Any:
            conn = real(*args, **kwargs)
            self.connections.append(conn)
            return conn

        sqlite3.connect = connect  # type: ignore[assignment]

    def _count(self, what: str) -> None:
        self.counts[what] += 1

    def counting(self, fn: Callable[[], Any], stores: int) -> dict[str, float]:
        """Run ``fn`` (``stores`` stores) counting; the counts per store."""
        self.counts = dict.fromkeys(self.counts, 0)
        wrapped = {name: getattr(os, name) for name in ("open", "mkdir", "stat", "lstat")}

        def wrap(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
            what = "stat" if name in ("stat", "lstat") else name

            def call(*args: Any, **kwargs: Any) -> Any:
                self._count(what)
                return real(*args, **kwargs)
            return call

        for conn in self.connections:
            try:
                conn.set_trace_callback(lambda _sql: self._count("statements"))
            except sqlite3.ProgrammingError:  # closed
                pass
        for name, real in wrapped.items():
            setattr(os, name, wrap(name, real))
        try:
            fn()
        finally:
            for name, real in wrapped.items():
                setattr(os, name, real)
            for conn in self.connections:
                try:
                    conn.set_trace_callback(None)
                except sqlite3.ProgrammingError:  # closed
                    pass
        return {what: n / stores for what, n in self.counts.items()}


def median_time(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(workdir: Path, repeat: int) -> dict[str, float]:
    """One side's figures (run in a fresh process with that side's package first on the path)."""
    from llama_cache.caches.disk import LlamaDiskCache
    from llama_cache.state.llama_state import LlamaState
    from llama_cache.testing.states import synthetic_state

    rng = np.random.default_rng(0)
    out: dict[str, float] = {}
    counter = Counter()

    def small(i: int) -> LlamaState:
        tokens = np.array([1 + i, 2, 3], dtype=np.int32)
        return LlamaState(tokens, None, 0, "bench", opaque=np.full(20_000, i % 251, np.uint8))

    with LlamaDiskCache(workdir / "small", capacity_bytes=1 << 30, write_behind=False, chunk_tokens=0) as cache:
        n = 40 * repeat
        start = time.perf_counter()
        for i in range(n):
            cache[[1 + i, 2, 3]] = small(i)
        out["store small (/s)"] = n / (time.perf_counter() - start)

        def counted_small() -> None:
            for i in range(n, n + SMALL_COUNTED):
                cache[[1 + i, 2, 3]] = small(i)

        for what, per in counter.counting(counted_small, SMALL_COUNTED).items():
            out[f"{what} per small store"] = per
        for i in range(n + SMALL_COUNTED, 1_000):
            cache[[1 + i, 2, 3]] = small(i)
        out["key in cache, 1k entries (us)"] = median_time(lambda: [5, 2, 3] in cache, 50 * repeat) * 1e6
        out["match_length, 1k entries (us)"] = median_time(lambda: cache.match_length([5, 2, 3, 9]), 50 * repeat) * 1e6
        out["hit small (us)"] = median_time(lambda: cache[[5, 2, 3]], 20 * repeat) * 1e6

    big = synthetic_state(rng.integers(0, 49_152, BIG_TOKENS, dtype=np.int32), ROW, rng, fingerprint="bench")
    for label, chunk_tokens in (("whole", 0), ("chunked", None)):
        with LlamaDiskCache(workdir / label, capacity_bytes=1 << 34, write_behind=False,
                            chunk_tokens=chunk_tokens) as cache:
            n = 2 * repeat
            states = []
            for i in range(n + BIG_COUNTED):  # distinct last tokens: a real write each, sharing all earlier chunks
                tokens = big.tokens.copy()
                tokens[-1] = 49_152 + i
                states.append(LlamaState.from_seq_bytes(tokens, None, 0, "bench", big.seq_bytes()))
            start = time.perf_counter()
            for state in states[:n]:
                cache[state.tokens] = state
            out[f"store {BIG_TOKENS} tokens {label} (/s)"] = n / (time.perf_counter() - start)
            if chunk_tokens == 0:

                def counted_big() -> None:
                    for state in states[n:]:
                        cache[state.tokens] = state

                for what, per in counter.counting(counted_big, BIG_COUNTED).items():
                    out[f"{what} per {BIG_TOKENS}-token whole store"] = per
            key = states[0].tokens
            cache[key]  # page cache hot
            out[f"hit {BIG_TOKENS} tokens {label} (ms)"] = median_time(lambda: cache[key], 3 * repeat) * 1e3
            if chunk_tokens is None:
                half = np.concatenate([key[: BIG_TOKENS // 2], np.array([7, 7], np.int32)])
                out[f"lookup_prefix {BIG_TOKENS // 2} tokens (ms)"] = (
                    median_time(lambda: cache.lookup_prefix(half), 3 * repeat) * 1e3
                )
    return out


def targets(medians: dict[str, dict[str, float]], runs: dict[str, list[dict[str, float]]]) -> list[dict[str, Any]]:
    """Issue #28's disk-store targets, met or not. A rate's verdict is the median over the rounds of
    after / before within a round (the two sides ran back to back, so a shared machine's load, which
    moves the rates of a round together, cancels); the ratio of the medians is shown beside it."""
    before, after = medians["before"], medians["after"]
    out: list[dict[str, Any]] = []
    for key in ("store small (/s)", f"store {BIG_TOKENS} tokens whole (/s)"):
        paired = statistics.median(a[key] / b[key] for a, b in zip(runs["after"], runs["before"]))
        out.append({"what": f"{key.replace(' (/s)', '')}: rate >= {RATE_TARGET}x before",
                    "value": f"{paired:.2f}x (median of {len(runs['after'])} rounds' ratios; ratio of the medians "
                             f"{after[key] / before[key]:.2f}x)",
                    "met": paired >= RATE_TARGET})
    for kind in ("small store", f"{BIG_TOKENS}-token whole store"):
        key = f"statements per {kind}"
        if key not in after:
            continue
        was = f" (before: {before[key]:.1f})" if key in before else ""
        out.append({"what": f"SQLite statements per {kind} <= {STATEMENTS_TARGET}",
                    "value": f"{after[key]:.2f}{was}; open {after[f'open per {kind}']:.2f}, "
                             f"mkdir {after[f'mkdir per {kind}']:.2f}, stat {after[f'stat per {kind}']:.2f} per store",
                    "met": after[key] <= STATEMENTS_TARGET})
    return out


def export(ref: str, into: Path) -> None:
    """The package as of ``ref``, extracted under ``into`` (no checkout, no worktree)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "llama_cache"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)


def run_side(package_root: Path, workdir: Path, repeat: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(package_root))
    done = subprocess.run(
        [sys.executable, __file__, _CHILD, str(workdir), str(repeat)],
        env=env, check=True, capture_output=True, text=True, cwd=workdir,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for n, row in enumerate(rows):
        print("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            print("  " + "  ".join("-" * w for w in widths))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == _CHILD:
        print(json.dumps(measure(Path(sys.argv[2]), int(sys.argv[3]))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default=BEFORE, help=f"the commit to compare with (default {BEFORE})")
    parser.add_argument("--rounds", type=int, default=5, help="fresh processes per side, alternating")
    parser.add_argument("--quick", action="store_true", help="fewer repeats per measurement")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    # Here, not at the top: the children run this file with the old commit's tree on PYTHONPATH.
    from benchmarks.machine import finish, machine, write

    repeat = 2 if args.quick else 5
    described = machine()
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="llama-cache-disk-io-") as tmp:
        old = Path(tmp) / "before"
        old.mkdir()
        export(args.before, old)
        for n in range(args.rounds):
            for side in (("before", "after") if n % 2 == 0 else ("after", "before")):
                workdir = Path(tmp) / f"{side}-{n}"
                workdir.mkdir()
                runs[side].append(run_side(old if side == "before" else ROOT, workdir, repeat))
    medians = {side: {k: statistics.median(r[k] for r in rounds) for k in rounds[0]} for side, rounds in runs.items()}
    rows = [["", f"before ({args.before})", "after", "after / before"]]
    for key in medians["before"]:
        before, after = medians["before"][key], medians["after"][key]
        rows.append([key, f"{before:,.1f}", f"{after:,.1f}", f"{after / before:.2f}"])
    print(f"\nDisk tier, memory-mapped ({args.before}) against read and rollback journal (this checkout); "
          f"medians of {args.rounds} processes per side")
    table(rows)
    found = targets(medians, runs)
    print()
    for target in found:
        print(f"  {target['what']}: {target['value']}  {'MET' if target['met'] else 'NOT MET'}")
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    results = {
        "machine": described,
        "settings": {"before": args.before, "after": commit.stdout.strip(), "rounds": args.rounds, "repeat": repeat,
                     "row_bytes": ROW, "big_tokens": BIG_TOKENS},
        "medians": medians,
        "targets": found,
        "runs": runs,
    }
    finish(results)
    write(args.out, results)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
