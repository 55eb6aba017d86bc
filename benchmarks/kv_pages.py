"""What making a context costs in memory and time: the engine's against llama.cpp's alone.

llama.cpp zeroes a context's whole KV buffer when it makes it, so the pool is resident at once; the
engine hands the zeroed pages back while llama.cpp writes them (``llama_cache/engine/kv_pages.py``,
docs/engine.md). Each round makes one context in a fresh process per side, the order alternating:

- ``engine``: ``llama_cache.engine.context.BatchContext`` (the watch, then the final check);
- ``llama.cpp``: ``llama_init_from_model`` with the same parameters, nothing handed back.

Both load the default model the same way first. Measured per side: the process's peak resident set
(``VmHWM``) once the context is made, what making it added to the peak (that peak less the resident set
just before), the seconds it took, and the bytes the engine handed back. Settings: ``--n-ctx`` cells
(default 32,768, the serving benchmark's pool), 16 sequence ids, flash attention on, 2 threads.
Targets: what making the context adds to the peak at most half the KV buffer's size (the pool is
never resident at once), and the time at most 1.1x llama.cpp's alone: the median of the rounds'
ratios, each round's two sides made one after the other (the times of one side spread by 2x on a
shared machine; a round's pair shares its moment).

    python benchmarks/kv_pages.py [--rounds 9] [--n-ctx 32768]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.machine import finish, machine, write  # noqa: E402

SIDES = ("engine", "llama.cpp")
PEAK_TARGET = 0.5  # what making the context adds to the peak / the KV buffer's size
TIME_TARGET = 1.1  # the engine's time / llama.cpp's alone


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def child(side: str, n_ctx: int) -> dict[str, Any]:
    """Make one context in this process; what it cost."""
    import llama_cpp

    from llama_cache._model import default_model_path
    from llama_cache.engine.context import BatchContext, ContextSettings
    from llama_cache.engine.kv_pages import kv_bytes
    from llama_cache.engine.model import Model

    model = Model(default_model_path())
    settings = ContextSettings(n_ctx=n_ctx, n_seq_max=16, n_batch=144, n_threads=2, flash_attn=True, kv_unified=True)
    before = _status("VmRSS")
    start = time.perf_counter()
    released = 0
    if side == "engine":
        context = BatchContext(model, settings)
        seconds = time.perf_counter() - start
        released = context.kv_bytes_released
        n_cells = context.n_ctx
    else:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = settings.n_ctx, settings.n_batch, settings.n_batch
        params.n_seq_max, params.n_threads, params.n_threads_batch = settings.n_seq_max, 2, 2
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.kv_unified = True
        params.no_perf = True
        pointer = llama_cpp.llama_init_from_model(model.pointer, params)
        seconds = time.perf_counter() - start
        if not pointer:
            raise RuntimeError("llama.cpp could not make the context")
        n_cells = int(llama_cpp.llama_n_ctx(pointer))
    return {"side": side, "seconds": seconds, "peak": _status("VmHWM"), "added_to_peak": _status("VmHWM") - before,
            "released": released, "kv_bytes": kv_bytes(model, n_cells), "n_cells": n_cells}


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--n-ctx", type=int, default=32768)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "kv_pages.json")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.n_ctx)))
        return 0
    results: dict[str, Any] = {"machine": machine(), "settings": {"n_ctx": args.n_ctx, "n_seq_max": 16,
                               "flash_attn": True, "threads": 2, "rounds": args.rounds}, "runs": []}
    for round_number in range(args.rounds):
        for side in SIDES if round_number % 2 == 0 else SIDES[::-1]:
            done = subprocess.run([sys.executable, __file__, "--child", side, "--n-ctx", str(args.n_ctx)],
                                  capture_output=True, text=True, check=True)
            row = json.loads(done.stdout.strip().splitlines()[-1])
            row["round"] = round_number
            results["runs"].append(row)
            print(f"round {round_number + 1}/{args.rounds}, {side}: made in {row['seconds']:.3f} s, "
                  f"peak {row['peak'] / 1e6:.0f} MB (+{row['added_to_peak'] / 1e6:.0f})", file=sys.stderr)
    finish(results)
    summary = {side: {key: _summary([r[key] for r in results["runs"] if r["side"] == side])
                      for key in ("seconds", "peak", "added_to_peak", "released")} for side in SIDES}
    kv = results["runs"][0]["kv_bytes"]
    added = summary["engine"]["added_to_peak"]["median"] / kv
    seconds = {(r["round"], r["side"]): r["seconds"] for r in results["runs"]}
    ratios = [seconds[(n, "engine")] / seconds[(n, "llama.cpp")] for n in range(args.rounds)]
    slower = statistics.median(ratios)
    results["summary"] = summary
    results["time_ratios"] = ratios
    results["kv_bytes"] = kv
    results["targets"] = [
        {"what": f"making the context adds at most {PEAK_TARGET}x the KV buffer's size to the peak",
         "value": added, "met": added <= PEAK_TARGET},
        {"what": f"making the context takes at most {TIME_TARGET}x llama.cpp's time alone (median of the "
                 "rounds' ratios)",
         "value": slower, "met": slower <= TIME_TARGET},
    ]
    write(args.out, results)
    for target in results["targets"]:
        print(f"{target['what']}: {target['value']:.2f} ({'met' if target['met'] else 'NOT MET'})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
