"""Structured outputs: llama-cache's llguidance constraint against llama-cpp-python's GBNF grammar path.

    tools/run python benchmarks/constraints.py [--rounds 3] [--max-tokens 48] [--gbnf-timeout 180]

Cases (each a chat prompt on the default model, greedy, ``--max-tokens`` tokens at most):

- ``object``: a small object schema (a string with ``maxLength`` 40, an integer in 1..14);
- ``maxLength 100000``: ``{"text": {"type": "string", "maxLength": 100000}}``;
- ``pattern c{1,2000}``: ``{"c": {"type": "string", "pattern": "^c{1,2000}$"}}``;
- ``enum 50000``: one property whose value is one of 50,000 strings;
- ``json_object``: any JSON object (``response_format: {"type": "json_object"}``).

Ours (in this process, ``llama_cache.Llama``): the compile time (:meth:`ConstraintCompiler.compile`,
which includes the first token mask; median of ``--rounds``), the longest the compiling thread held
the GIL meanwhile (the largest gap seen by a thread that wakes every millisecond), the constraint's own
CPU time per generated token (consuming the sampled token, computing the mask, applying it to the
logits), and the time per generated token with and without the constraint, over ``--rounds`` interleaved runs:
the median and the largest wall-time gap between successive sampled tokens, and the median in the
process's CPU time (less sensitive to other processes on a shared machine, though llama.cpp's OpenMP
threads spin while one of them waits for a core, and that counts).

llama-cpp-python's path (a subprocess per case, plain ``llama_cpp.Llama``, killed after
``--gbnf-timeout`` seconds): ``LlamaGrammar.from_json_schema`` (``LlamaGrammar.from_string(JSON_GBNF)``
for ``json_object``), then llama.cpp's grammar parse (``llama_sampler_init_grammar``), then the same
generation without and with ``grammar=`` (as llama-cpp-python does, even when llama.cpp refused the
grammar: the chain then holds a null sampler); a crash (the process killed by a signal) or a timeout is
reported with the phase it happened in and, for the constrained generation, the tokens it had sampled.

Prints a table and writes ``benchmarks/results/constraints.json`` with the machine, the versions and
the settings.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
import llguidance
import numpy as np
import numpy.typing as npt

from benchmarks.machine import finish, machine, write
from llama_cache import default_model_path
from llama_cache.llama import Llama
from llama_cache.server.config import ServerConfig
from llama_cache.server.constraints import ConstraintCompiler, SequenceConstraint
from llama_cache.server.prompts import prompt_tokens_for_chat

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "constraints.json"
N_CTX = 1024

CASES: dict[str, tuple[dict[str, Any] | None, str]] = {  # name -> (schema, None for json_object; prompt)
    "object": ({"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                 "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                "required": ["city", "days"]}, "What is the weather in Rome for the next 3 days?"),
    "maxLength 100000": ({"type": "object", "properties": {"text": {"type": "string", "maxLength": 100000}},
                          "required": ["text"]}, "Write one sentence about the sea."),
    "pattern c{1,2000}": ({"type": "object", "properties": {"c": {"type": "string", "pattern": "^c{1,2000}$"}},
                           "required": ["c"]}, "Write the letter c a few times."),
    "enum 50000": ({"type": "object", "properties": {"choice": {"enum": [f"item-{i}" for i in range(50_000)]}},
                    "required": ["choice"]}, "Pick an item."),
    "json_object": (None, "Reply in JSON: an object with the name and age of a person called Ada, aged 36."),
}


class _Stamps:
    """A stopping criterion that records when each token was sampled (it never stops the generation)."""

    def __init__(self, report: Any = None) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self._report = report

    def __call__(self, input_ids: npt.NDArray[np.intc], logits: npt.NDArray[np.float32]) -> bool:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())
        if self._report is not None:
            self._report(len(self.wall))
        return False


@dataclass
class _Run:
    """One generation: its text and the wall and process CPU milliseconds between successive tokens."""

    text: str
    wall_ms: list[float]
    cpu_ms: list[float]


class _Timed:
    """A logits processor around a constraint that adds up the CPU time its thread spends in it."""

    def __init__(self, constraint: SequenceConstraint) -> None:
        self.constraint = constraint
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, input_ids: npt.NDArray[np.intc], scores: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        started = time.thread_time()
        result = self.constraint(input_ids, scores)
        self.seconds += time.thread_time() - started
        self.calls += 1
        return result


def _generate(llama: llama_cpp.Llama, prompt: list[int], max_tokens: int, report: Any = None,
              **options: Any) -> _Run:
    stamps = _Stamps(report)
    reply = llama.create_completion(prompt=prompt, max_tokens=max_tokens, temperature=0,
                                    stopping_criteria=llama_cpp.StoppingCriteriaList([stamps]), **options)

    def gaps(times: list[float]) -> list[float]:
        return [(b - a) * 1e3 for a, b in zip(times, times[1:])]

    return _Run(reply["choices"][0]["text"], gaps(stamps.wall), gaps(stamps.cpu))


def _max_gil_gap_ms(work: Any) -> tuple[Any, float]:
    """Run ``work()`` in this thread while another wakes every millisecond; the longest it waited, in ms."""
    stop = threading.Event()
    gaps: list[float] = []

    def tick() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        result = work()
    finally:
        stop.set()
        ticker.join()
    return result, max(gaps, default=0.0) * 1e3


def _schema_of(name: str) -> dict[str, Any]:
    schema = CASES[name][0]
    return schema if schema is not None else {"type": "object"}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def ours(llama: Llama, prompts: dict[str, list[int]], rounds: int, max_tokens: int) -> dict[str, Any]:
    """Compile and generate every case with the llguidance constraint, interleaved with unconstrained runs."""
    started = time.perf_counter()
    compiler = ConstraintCompiler.for_llama(llama)
    results: dict[str, Any] = {"compiler_build_s": time.perf_counter() - started, "cases": {}}
    keys = ("compile_ms", "compile_cpu_ms", "gil_gap_ms", "constraint_us", "constrained_ms", "constrained_cpu_ms",
            "plain_ms", "plain_cpu_ms")
    per_case: dict[str, dict[str, list[float]]] = {name: {key: [] for key in keys} for name in CASES}
    texts: dict[str, str] = {}
    for round_index in range(rounds):
        for name in CASES:
            row = per_case[name]
            wall, cpu = time.perf_counter(), time.process_time()
            constraint, gap = _max_gil_gap_ms(lambda: compiler.compile(_schema_of(name)))
            row["compile_ms"].append((time.perf_counter() - wall) * 1e3)
            row["compile_cpu_ms"].append((time.process_time() - cpu) * 1e3)
            row["gil_gap_ms"].append(gap)
            timed = _Timed(constraint)
            runs = [("plain", {}), ("constrained", {"logits_processor": llama_cpp.LogitsProcessorList([timed])})]
            for label, options in runs if round_index % 2 == 0 else runs[::-1]:
                run = _generate(llama, prompts[name], max_tokens, **options)
                row[f"{label}_ms"].extend(run.wall_ms)
                row[f"{label}_cpu_ms"].extend(run.cpu_ms)
                if label == "constrained":
                    texts[name] = run.text
            row["constraint_us"].append(timed.seconds / max(timed.calls, 1) * 1e6)
        print(f"ours: round {round_index + 1}/{rounds} done", file=sys.stderr)
    for name, row in per_case.items():
        median = {key: statistics.median(values) for key, values in row.items()}
        results["cases"][name] = {
            "compile_ms": median["compile_ms"],
            "compile_cpu_ms": median["compile_cpu_ms"],
            "max_gil_gap_ms": max(row["gil_gap_ms"]),
            "constraint_cpu_us_per_token": median["constraint_us"],
            "ms_per_token": {"constrained": median["constrained_ms"], "unconstrained": median["plain_ms"]},
            "worst_token_ms": {"constrained": max(row["constrained_ms"]), "unconstrained": max(row["plain_ms"])},
            "cpu_ms_per_token": {"constrained": median["constrained_cpu_ms"], "unconstrained": median["plain_cpu_ms"]},
            "cpu_ratio": median["constrained_cpu_ms"] / median["plain_cpu_ms"],
            "text": texts[name],
            "valid_json": _is_json(texts[name]),
        }
    return results


def gbnf_child(name: str, prompt: list[int], max_tokens: int) -> None:
    """llama-cpp-python's own path for one case; prints a JSON line per phase reached (then may crash)."""
    def phase(**fields: Any) -> None:
        print(json.dumps(fields), flush=True)

    llama = llama_cpp.Llama(model_path=str(default_model_path()), verbose=False,
                            **ServerConfig(n_ctx=N_CTX).context_options())
    phase(phase="loaded")
    schema = CASES[name][0]
    started = time.perf_counter()
    if schema is None:
        grammar = llama_cpp.LlamaGrammar.from_string(llama_cpp.llama_grammar.JSON_GBNF, verbose=False)
    else:
        grammar = llama_cpp.LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)
    phase(phase="converted", seconds=time.perf_counter() - started, gbnf_bytes=len(grammar._grammar))
    started = time.perf_counter()
    sampler = llama_cpp.llama_sampler_init_grammar(llama._model.vocab, grammar._grammar.encode(), b"root")
    phase(phase="parsed", seconds=time.perf_counter() - started, accepted=bool(sampler))
    if sampler:
        llama_cpp.llama_sampler_free(sampler)
    plain = _generate(llama, prompt, max_tokens)
    phase(phase="unconstrained", ms_per_token=statistics.median(plain.wall_ms), worst_token_ms=max(plain.wall_ms),
          cpu_ms_per_token=statistics.median(plain.cpu_ms))
    started = time.perf_counter()

    def sampled(n: int) -> None:
        phase(phase="sampling", tokens=n, seconds=time.perf_counter() - started)

    run = _generate(llama, prompt, max_tokens, report=sampled, grammar=grammar)
    phase(phase="generated", seconds=time.perf_counter() - started, ms_per_token=statistics.median(run.wall_ms),
          worst_token_ms=max(run.wall_ms), cpu_ms_per_token=statistics.median(run.cpu_ms), tokens=len(run.wall_ms) + 1,
          text=run.text, valid_json=_is_json(run.text))


def gbnf(prompts: dict[str, list[int]], max_tokens: int, timeout: float) -> dict[str, Any]:
    """Every case on llama-cpp-python's GBNF path, a subprocess each."""
    results: dict[str, Any] = {}
    for name in CASES:
        command = [sys.executable, __file__, "--gbnf-child", name, "--prompt", json.dumps(prompts[name]),
                   "--max-tokens", str(max_tokens)]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True)
        started = time.monotonic()
        try:
            out, _ = process.communicate(timeout=timeout)
            outcome = "ok" if process.returncode == 0 else (
                f"crashed ({signal.Signals(-process.returncode).name})" if process.returncode < 0
                else f"failed (exit {process.returncode})")
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, _ = process.communicate()
            outcome = f"timeout ({timeout:g} s)"
        phases = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        results[name] = {"outcome": outcome, "wall_s": time.monotonic() - started,
                         "last_phase": phases[-1]["phase"] if phases else None,
                         "phases": {p["phase"]: p for p in phases}}
        print(f"gbnf {name}: {outcome}, last phase {results[name]['last_phase']}", file=sys.stderr)
    return results


def _gbnf_cell(other: dict[str, Any]) -> str:
    phases = other["phases"]
    done = [f"{p} {phases[p]['seconds'] * 1e3:.1f} ms" for p in ("converted", "parsed") if p in phases]
    if "parsed" in phases and not phases["parsed"]["accepted"]:
        done.append("llama.cpp refused the grammar")
    if other["outcome"] == "ok":
        generated, plain = phases["generated"], phases["unconstrained"]
        done.append(f"{generated['tokens']} tokens in {generated['seconds']:.2f} s, {generated['cpu_ms_per_token']:.1f} "
                    f"CPU ms/tok (plain {plain['cpu_ms_per_token']:.1f}, "
                    f"{generated['cpu_ms_per_token'] / plain['cpu_ms_per_token']:.2f}x), worst token "
                    f"{generated['worst_token_ms']:.0f} ms (plain {plain['worst_token_ms']:.0f})")
        done.append(f"json {'yes' if generated['valid_json'] else 'no'}")
        return ", ".join(done)
    if "sampling" in phases:
        done.append(f"{phases['sampling']['tokens']} tokens sampled in {phases['sampling']['seconds']:.0f} s")
    else:
        done.append(f"in the phase after '{other['last_phase']}'")
    return f"{other['outcome'].upper()}: " + ", ".join(done)


def report(result: dict[str, Any]) -> str:
    cases, theirs = result["ours"]["cases"], result["gbnf"]
    settings = result["settings"]
    lines = [f"default model, greedy, at most {settings['max_tokens']} tokens, {settings['n_threads']} threads; "
             f"ours: medians of {settings['rounds']} rounds; the llguidance compiler (once per model) was built in "
             f"{result['ours']['compiler_build_s']:.2f} s; load average {result['load_average']['before'][0]:.1f} "
             f"before, {result['load_average']['after'][0]:.1f} after", ""]
    header = (f"{'case':<19}{'compile ms':>11}{'(CPU)':>8}{'GIL gap ms':>11}{'mask us/tok':>12}"
              f"{'ms/tok':>8}{'plain':>7}{'worst':>7}{'plain':>7}{'CPU ms/tok':>11}{'plain':>7}{'CPU ratio':>10}"
              f"{'json':>6}")
    lines += ["llama-cache (llguidance constraint as the logits processor):", header, "-" * len(header)]
    for name, row in cases.items():
        wall, worst, cpu = row["ms_per_token"], row["worst_token_ms"], row["cpu_ms_per_token"]
        lines.append(f"{name:<19}{row['compile_ms']:>11.1f}{row['compile_cpu_ms']:>8.1f}{row['max_gil_gap_ms']:>11.1f}"
                     f"{row['constraint_cpu_us_per_token']:>12.0f}{wall['constrained']:>8.1f}"
                     f"{wall['unconstrained']:>7.1f}{worst['constrained']:>7.0f}{worst['unconstrained']:>7.0f}"
                     f"{cpu['constrained']:>11.1f}{cpu['unconstrained']:>7.1f}"
                     f"{row['cpu_ratio']:>9.2f}x{'yes' if row['valid_json'] else 'no':>6}")
    lines += ["", "llama-cpp-python's GBNF path (LlamaGrammar.from_json_schema, llama.cpp's grammar sampler):"]
    lines += [f"{name:<19}{_gbnf_cell(theirs[name])}" for name in cases]
    lines += ["", result["verdict"]]
    return "\n".join(lines)


def verdict(result: dict[str, Any]) -> str:
    cases, theirs = result["ours"]["cases"], result["gbnf"]
    failed = [f"{name}: {row['outcome']}" for name, row in theirs.items() if row["outcome"] != "ok"]
    ratios = [row["cpu_ratio"] for row in cases.values()]
    slowest = max(cases.items(), key=lambda item: item[1]["compile_ms"])
    invalid = [name for name, row in cases.items() if not row["valid_json"]]
    return (f"ours: every case compiled (slowest: {slowest[0]}, {slowest[1]['compile_ms']:.0f} ms) and generated at "
            f"{min(ratios):.2f}-{max(ratios):.2f}x the unconstrained CPU time per token"
            + (f", output not JSON for {', '.join(invalid)}" if invalid else ", valid JSON every time")
            + "; llama-cpp-python's GBNF path: " + ("; ".join(failed) if failed else "every case ran"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--gbnf-timeout", type=float, default=180.0, help="seconds per GBNF case (default 180)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--gbnf-child", choices=list(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--prompt", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gbnf_child:
        gbnf_child(args.gbnf_child, json.loads(args.prompt), args.max_tokens)
        return 0

    options = ServerConfig(n_ctx=N_CTX).context_options()
    llama = Llama(model_path=str(default_model_path()), verbose=False, **options)
    prompts = {name: prompt_tokens_for_chat(llama, [{"role": "user", "content": prompt}])
               for name, (_, prompt) in CASES.items()}
    load_before = os.getloadavg()
    result: dict[str, Any] = {
        "benchmark": "constraints",
        "command": "tools/run python benchmarks/constraints.py",
        "machine": machine(),
        "versions": {"llama_cpp_python": llama_cpp.__version__, "llguidance": llguidance.__version__,
                     "numpy": np.__version__, "python": platform.python_version()},
        "settings": {"model": default_model_path().name, "rounds": args.rounds, "max_tokens": args.max_tokens,
                     "gbnf_timeout_s": args.gbnf_timeout, "temperature": 0, **options},
    }
    result["ours"] = ours(llama, prompts, args.rounds, args.max_tokens)
    llama.close()
    write(args.out, result)  # what is done so far, if llama-cpp-python's side fails
    result["gbnf"] = gbnf(prompts, args.max_tokens, args.gbnf_timeout)
    result["load_average"] = {"before": load_before, "after": os.getloadavg()}
    result["verdict"] = verdict(result)
    finish(result)
    write(args.out, result)
    print(report(result))
    print(f"\nJSON written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
