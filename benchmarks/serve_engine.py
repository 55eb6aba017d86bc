"""The serving engine against llama.cpp's ``llama-server`` and llama-cpp-python's batched example server.

    tools/run python benchmarks/serve_engine.py --example-server PATH/TO/examples/server/server.py
    tools/run python benchmarks/serve_engine.py --rounds 1 --max-tokens 32 --turns 1   # a quick look

``llama-server`` is found as ``benchmarks/serve.py`` finds it (its docstring says how to build it; the
same build gives ``llama-batched-bench``, looked for beside it). The example server is
``examples/server/server.py`` of the abetlen/llama-cpp-python repository (0.3.35), kept outside this
repository and given by path; it runs on this environment's llama-cpp-python 0.3.36, started with a
JSON config (``model.path``, ``n_ctx``, ``n_seq_max``, ``n_batch``, ``n_ubatch``, ``threads``,
``threads_batch``, ``kv_unified``, ``flash_attn``). A server that cannot be found is skipped and said so.

Every server gets the default model, ``--threads`` (2), ``--parallel`` sequences (as many as the
clients), ``--n-ctx`` tokens per sequence (4,096) as one pool (llama-server's ``-c`` is that times the
slots; ours ``--n-ctx`` the same, the example server's ``n_ctx`` too), the same flash attention
(``--flash-attn``, default: what ``llama-cache serve``'s ``auto`` picks, on; see below), batch 512. The
two caching servers get the same host-memory prompt cache budget (``--cache-ram``: llama-server's in
MiB, ours in bytes). A fresh server per run; the servers run one after another in an order rotated
each round (``--rounds``, default 3), and the table shows medians with their spread.

Flash attention: which setting generates faster depends on the CPU (docs/engine.md, "Flash
attention"); ``llama-cache serve``'s ``auto`` is on, as llama-server's and the example server's. So
that no anchor is measured at its worse setting only, the decode scenario also runs llama-server and
the example server with the other setting (the sides ``llama-server+nofa`` and
``example-server+nofa`` with ``--flash-attn on``, ``llama-server+fa`` and ``example-server+fa`` with
it off), and the throughput verdicts take each anchor's better side.

Scenarios, each a run per server:

- **decode** (issue #26's decode-heavy table): ``--clients`` (8) conversations at once, ``--turns`` (2)
  turns of ``--max-tokens`` (256) tokens each, streamed at temperature 0, on one ~``--system-tokens``
  (700) token system prompt and a short question of their own. Measured: generated tokens per second
  (completion tokens over the run's wall time), the first turn's time to first token (p50), later
  turns' (p50 and p95), the gap between a stream's tokens (p50 over every gap), peak RSS (the
  server's ``VmHWM`` since it started) and peak RSS while serving (``VmHWM`` restarted once the server
  answers, Linux's ``clear_refs``: what the workload needed, without what starting took).
- **burst**: ``--clients`` requests sent together on one ~``--burst-tokens`` (1,500) token system
  prompt, 32 tokens each. Measured: time to first token p50, peak RSS, and for llama-cache the prompt
  tokens evaluated against the system prompt's (``llama_cache_prompt_tokens_total`` less the cached
  ones; issue target: at most 1.5x the system prompt, it is read about once) and the KV cells its
  sequences hold afterwards against the unique tokens they hold (``llama_cache_kv_cells_in_use``; the
  unique tokens are every request's prompt and answer less the heads shared,
  ``llama_cache_engine_shared_tokens_total``; target at most 1.05x).

In this process, on the engine itself (``llama_cache.Engine``), **step**: ``--clients`` sequences
decoding together, against ``llama-batched-bench``'s time for the same batch (``-npl 1,4,8``, the same
threads and flash attention, its KV split in a stream per sequence, its default, and unified with
``-kvu``, the engine's layout; issue target: our step at most 1.15x the faster of the two), with the
Python around each
decode (step time less decode time); measured as the difference of two runs of 128 and 1 generated
tokens, so that the prompts' evaluation cancels out and the steps left are every decode of the 128
tokens, over the same cells in use as ``llama-batched-bench``'s ``-ntg 128`` (each step's attention
grows with them: the last 64 steps alone cost more than the average). The three are run alternated
(the machine's speed drifts by more than the target's margin between runs a minute apart),
``--step-rounds`` times (default 5: a round takes about a minute, and one slow spell moves a median of
three), and the round with the median ratio is reported (``step_ratios``: every round's). And **deterministic**: the same 8 sequences in
deterministic mode, the throughput it costs.

Prints the tables with the issue's targets, met or not, and writes
``benchmarks/results/serve_engine.json``. The machine may be shared: the load average is recorded at
the start and the end, and each ratio is of runs made side by side.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from benchmarks.machine import finish, machine, write  # noqa: E402
from benchmarks.servers import (  # noqa: E402
    REPO,
    Settings,
    cache_metrics,
    filler_text,
    find_llama_server,
    free_port,
    llama_server_version,
    percentile,
    rotation,
    running_process,
    server_command,
)
from benchmarks.sse import read_stream  # noqa: E402
from llama_cache import Engine, default_model_path  # noqa: E402
from llama_cache.engine.context import flash_attention_for  # noqa: E402
from llama_cache.engine.sequences import LogitBias  # noqa: E402
from llama_cache.native_log import route_llama_cpp_logs  # noqa: E402
from llama_cache.server.config import on_off  # noqa: E402

SERVERS = ("llama-cache", "llama-server", "example-server", "llama-server+fa", "example-server+fa",
           "llama-server+nofa", "example-server+nofa")
LABELS = {
    "llama-cache": "llama-cache serve: the engine, RAM prompt cache",
    "llama-server": "llama.cpp's llama-server (the build vendored in llama-cpp-python 0.3.36), host-memory cache",
    "example-server": "llama-cpp-python's batched example server (examples/server/server.py, 0.3.35)",
    "llama-server+fa": "llama-server with flash attention on (its default on the CPU), decode scenario only",
    "example-server+fa": "the example server with flash attention on, decode scenario only",
    "llama-server+nofa": "llama-server with flash attention off, decode scenario only",
    "example-server+nofa": "the example server with flash attention off, decode scenario only",
}
FLASH_SIDES = {"llama-server+fa": ("llama-server", True), "example-server+fa": ("example-server", True),
               "llama-server+nofa": ("llama-server", False), "example-server+nofa": ("example-server", False)}
"""The anchors' sides with the other flash-attention setting, run when ``--flash-attn`` is not that
setting: side -> (its server, flash attention)."""
# Issue #26's targets.
THROUGHPUT_VS_LLAMA_SERVER = 1.4
THROUGHPUT_VS_EXAMPLE = 1.2
FIRST_TTFT_VS_EXAMPLE = 0.9
BURST_EVALUATED = 1.5
CELLS_VS_UNIQUE = 1.05
STEP_VS_BATCHED_BENCH = 1.15
CACHE_RAM_MIB = 2048
QUESTION_WORDS = ["rivers", "mountains", "harbours", "deserts", "forests", "glaciers", "islands", "valleys",
                  "canyons", "lagoons", "meadows", "volcanoes"]


# -- servers -----------------------------------------------------------------------------------------

def command_for(name: str, model: Path, settings: Settings, port: int, llama_server: Path | None,
                example_server: Path | None, scratch: Path) -> list[str] | None:
    """The command starting ``name`` (None: not available here); a ``+fa`` (``+nofa``) side is its
    server with flash attention on (off)."""
    if name in FLASH_SIDES:
        server, flash = FLASH_SIDES[name]
        other = Settings(settings.n_ctx, settings.parallel, settings.threads, flash, settings.n_batch)
        return command_for(server, model, other, port, llama_server, example_server, scratch)
    if name == "example-server":
        if example_server is None:
            return None
        config = {
            "server": {"host": "127.0.0.1", "port": port},
            "model": {"path": str(model), "n_ctx": settings.n_ctx * settings.parallel, "n_seq_max": settings.parallel,
                      "n_batch": settings.n_batch, "n_ubatch": settings.n_batch, "threads": settings.threads,
                      "threads_batch": settings.threads, "kv_unified": True, "flash_attn": settings.flash_attn},
        }
        path = scratch / f"example-server-{port}.json"
        path.write_text(json.dumps(config))
        return [sys.executable, str(example_server), "--config-file", str(path)]
    command = server_command(name, model, settings, port, llama_server)
    if command is None:
        return None
    if name == "llama-cache":
        return [*command, "--cache-ram", str(CACHE_RAM_MIB << 20)]
    if name == "llama-server":
        return [*command, "--cache-ram", str(CACHE_RAM_MIB), "--metrics"]
    return command


def peak_rss(pid: int) -> int | None:
    """The process's peak resident set in bytes (``VmHWM``: since it started, or since
    :func:`reset_peak_rss`), or None if it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_rss(pid: int) -> bool:
    """Start the process's ``VmHWM`` again from its resident set now (Linux's ``clear_refs`` 5)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


ENGINE_METRICS = ("llama_cache_prompt_tokens_total", "llama_cache_prompt_tokens_cached_total",
                  "llama_cache_engine_shared_tokens_total", "llama_cache_kv_cells_in_use")


# -- the workloads -----------------------------------------------------------------------------------

@functools.cache
def vocabulary() -> Any:
    """The default model's vocabulary alone (``vocab_only``), loaded once."""
    import llama_cpp

    route_llama_cpp_logs()  # llama-cpp-python would print llama.cpp's warnings despite verbose=False
    return llama_cpp.Llama(model_path=str(default_model_path()), vocab_only=True, verbose=False)


def system_prompt(tokens: int, seed: int) -> str:
    """A system prompt of about ``tokens`` tokens of the default model (filler prose)."""
    vocab = vocabulary()
    rng = random.Random(seed)
    words = tokens * 3 // 4
    while True:
        text = "You are a patient assistant who writes long, detailed answers. " + filler_text(rng, words)
        n = len(vocab.tokenize(text.encode()))
        if n >= tokens * 0.97:
            return text
        words += max(8, (tokens - n) * 3 // 4)
        rng = random.Random(seed)


def ask(client: httpx.Client, url: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """One streamed chat completion: its reply, time to first token, token gaps and completion tokens."""
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=1200) as response:
        response.raise_for_status()
        stream = read_stream(response.iter_lines(), started)
    times = stream.content_times
    usage = stream.usage or {}
    tokens = usage.get("completion_tokens") or len(times)
    return {"reply": stream.text, "ttft": stream.first_content, "gaps": [b - a for a, b in zip(times, times[1:])],
            "tokens": int(tokens), "done": stream.done}


def run_decode(url: str, system: str, clients: int, turns: int, max_tokens: int) -> dict[str, Any]:
    """``clients`` conversations at once, ``turns`` turns each (see the module's docstring)."""
    rows: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def conversation(index: int) -> None:
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": f"Write a long essay about {QUESTION_WORDS[index % 12]}, "
                                                f"client {index}."}]
        try:
            with httpx.Client() as client:
                for turn in range(turns):
                    if turn:
                        messages.append({"role": "user", "content": "Go on, in more detail."})
                    row = ask(client, url, messages, max_tokens)
                    messages.append({"role": "assistant", "content": row.pop("reply")})
                    with lock:
                        rows.append({"turn": turn, **row})
        except BaseException as error:  # noqa: BLE001 - reported after the join
            errors.append(error)

    started = time.perf_counter()
    threads = [threading.Thread(target=conversation, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise errors[0]
    first = sorted(r["ttft"] for r in rows if r["turn"] == 0 and r["ttft"] is not None)
    later = sorted(r["ttft"] for r in rows if r["turn"] > 0 and r["ttft"] is not None)
    gaps = sorted(g for r in rows for g in r["gaps"])
    tokens = sum(r["tokens"] for r in rows)
    return {"seconds": elapsed, "tokens": tokens, "tokens_per_s": tokens / elapsed,
            "ttft_first_p50": percentile(first, 50), "ttft_later_p50": percentile(later, 50),
            "ttft_later_p95": percentile(later, 95), "gap_p50": percentile(gaps, 50),
            "interrupted": sum(1 for r in rows if not r["done"])}


def run_burst(url: str, system: str, clients: int) -> dict[str, Any]:
    """``clients`` requests sent together on one system prompt, 32 tokens each."""
    rows: list[dict[str, Any]] = []
    barrier = threading.Barrier(clients)

    def one(index: int) -> None:
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": f"In one sentence: what are {QUESTION_WORDS[index % 12]}?"}]
        with httpx.Client() as client:
            barrier.wait()
            rows.append(ask(client, url, messages, 32))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ttfts = sorted(r["ttft"] for r in rows if r["ttft"] is not None)
    return {"ttft_p50": percentile(ttfts, 50), "requests": len(rows), "tokens": sum(r["tokens"] for r in rows)}


# -- on the engine itself ----------------------------------------------------------------------------

def batched_bench(binary: Path | None, threads: int, flash_attn: bool, unified: bool) -> dict[str, Any] | None:
    """``llama-batched-bench``'s generation step for 1, 4 and 8 sequences: {npl: (tokens/s, step s)};
    ``unified``: one KV pool for every sequence (``-kvu``), else a stream per sequence (its default)."""
    if binary is None:
        return None
    command = [str(binary), "-m", str(default_model_path()), "-c", "8192", "-b", "512", "-ub", "512",
               "-npp", "32", "-ntg", "128", "-npl", "1,4,8", "-t", str(threads), "-fa", "on" if flash_attn else "off",
               *(["-kvu"] if unified else [])]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    steps: dict[str, Any] = {}
    for line in done.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        # |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
        if len(cells) >= 8 and cells[0].isdigit():
            npl, ntg, t_tg, s_tg = int(cells[2]), int(cells[1]), float(cells[6]), float(cells[7])
            steps[str(npl)] = {"tokens_per_s": s_tg, "step_s": t_tg / ntg}
    return {"command": command, "steps": steps} if steps else None


def engine_steps(sequences: int, threads: int, flash_attn: bool, deterministic: bool) -> dict[str, Any]:
    """The engine's decode step with ``sequences`` sequences generating, from two runs of 128 and 1
    tokens (their difference: the decode steps of 128 tokens after the prompts, as
    ``llama-batched-bench -npp 32 -ntg 128`` times them)."""
    runs = {}
    for tokens in (128, 1):
        # No prompt waits for the step budget (prompt_rows_per_step holds them all), so both runs read
        # the prompts in the same steps and their difference is decode steps only.
        with Engine(n_ctx=8192, parallel=sequences, n_threads=threads, flash_attn=flash_attn,
                    deterministic=deterministic, prompt_rows_per_step=512) as engine:
            # Never ending early: every sequence generates all its tokens.
            ends = [t for t in range(engine.model.n_vocab) if engine.model.is_end(t)]
            bias = LogitBias(dict.fromkeys(ends, -1e9))
            started = time.perf_counter()
            requests = [engine.submit(f"Sequence {i}: " + "a b c d e f g h " * 3, max_tokens=tokens, temperature=0,
                                      logits_processor=[bias]) for i in range(sequences)]
            generated = sum(r.result()["usage"]["completion_tokens"] for r in requests)
            elapsed = time.perf_counter() - started
            stats = engine.scheduler.stats
            runs[tokens] = {"steps": stats.steps, "step_s": stats.step_seconds, "decode_s": stats.decode_seconds,
                            "generated": generated, "seconds": elapsed}
    long, short = runs[128], runs[1]
    steps = long["steps"] - short["steps"]
    step = (long["step_s"] - short["step_s"]) / steps
    decode = (long["decode_s"] - short["decode_s"]) / steps
    return {"sequences": sequences, "deterministic": deterministic, "runs": runs, "step_s": step, "decode_s": decode,
            "python_s": step - decode,
            "tokens_per_s": (long["generated"] - short["generated"]) / (long["seconds"] - short["seconds"])}


# -- the run -------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--example-server", type=Path, default=os.environ.get("LLAMA_CPP_PYTHON_EXAMPLE_SERVER"),
                        help="llama-cpp-python's examples/server/server.py (or $LLAMA_CPP_PYTHON_EXAMPLE_SERVER)")
    parser.add_argument("--scenarios", default="decode,burst,step,deterministic")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-rounds", type=int, default=5, help="rounds of the step scenario (default 5)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--system-tokens", type=int, default=700)
    parser.add_argument("--burst-tokens", type=int, default=1500)
    parser.add_argument("--n-ctx", type=int, default=4096, help="tokens per sequence (the pool is that x clients)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--flash-attn", type=on_off, default=flash_attention_for(None, False),
                        help="on or off, for every server (default: llama-cache serve's auto here; the anchors "
                        "also run with the other setting in the decode scenario)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "serve_engine.json")
    args = parser.parse_args(argv)
    model = default_model_path()
    llama_server = find_llama_server()
    batched = llama_server.with_name("llama-batched-bench") if llama_server is not None else None
    example = args.example_server if args.example_server and Path(args.example_server).is_file() else None
    names = [n for n in args.servers.split(",")
             if n and not (n in FLASH_SIDES and FLASH_SIDES[n][1] == args.flash_attn)]
    found = {"llama-server": llama_server is not None, "example-server": example is not None}
    for name in list(names):
        if not found.get(FLASH_SIDES[name][0] if name in FLASH_SIDES else name, True):
            print(f"{name}: skipped: not found (see this script's docstring)", file=sys.stderr)
            names.remove(name)
    scenarios = [s for s in args.scenarios.split(",") if s]
    settings = Settings(args.n_ctx, args.clients, args.threads, args.flash_attn)
    results: dict[str, Any] = {
        "model": model.name, "machine": machine(), "llama_server_version": llama_server_version(llama_server),
        "settings": {"n_ctx_per_sequence": args.n_ctx, "parallel": args.clients, "threads": args.threads,
                     "n_batch": settings.n_batch, "flash_attn": args.flash_attn, "clients": args.clients, "turns": args.turns,
                     "max_tokens": args.max_tokens, "system_tokens": args.system_tokens,
                     "burst_tokens": args.burst_tokens, "rounds": args.rounds,
                     "step_rounds": args.step_rounds, "cache_ram_mib": CACHE_RAM_MIB},
        "sides": {name: LABELS[name] for name in names}, "commands": {}, "runs": {}}
    systems = {"decode": system_prompt(args.system_tokens, 1), "burst": system_prompt(args.burst_tokens, 2)}
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with tempfile.TemporaryDirectory() as scratch:
        for round_number in range(args.rounds):
            for scenario in [s for s in scenarios if s in ("decode", "burst")]:
                for name in rotation([n for n in names if scenario == "decode" or n not in FLASH_SIDES], round_number):
                    port = free_port()
                    command = command_for(name, model, settings, port, llama_server, example, Path(scratch))
                    assert command is not None
                    results["commands"][name] = command
                    print(f"round {round_number + 1}/{args.rounds}: {scenario}, {name}...", file=sys.stderr, flush=True)
                    log = args.out.parent / f"serve_engine-{name}.log"
                    with running_process(command, port, env, log) as (url, process):
                        started = peak_rss(process.pid)
                        reset = reset_peak_rss(process.pid)
                        if scenario == "decode":
                            row = run_decode(url, systems["decode"], args.clients, args.turns, args.max_tokens)
                        else:
                            row = run_burst(url, systems["burst"], args.clients)
                        serving = peak_rss(process.pid)
                        row["serving_peak_rss"] = serving if reset else None
                        row["peak_rss"] = max(started or 0, serving or 0) or None
                        row["metrics"] = (cache_metrics(url, names=ENGINE_METRICS) or {}) if name == "llama-cache" else {}
                    row["round"] = round_number
                    row["load_average"] = round(os.getloadavg()[0], 2)
                    results["runs"].setdefault(scenario, {}).setdefault(name, []).append(row)
                    write(args.out, results)
    if "step" in scenarios:
        print("step: llama-batched-bench and the engine...", file=sys.stderr, flush=True)
        binary = batched if batched and batched.is_file() else None
        rounds = []
        for _ in range(args.step_rounds):  # alternated: the machine's speed drifts by more than the target's margin
            rounds.append({"batched_bench": batched_bench(binary, args.threads, args.flash_attn, False),
                           "batched_bench_unified": batched_bench(binary, args.threads, args.flash_attn, True),
                           "engine_step": engine_steps(8, args.threads, args.flash_attn, False)})
        ratios = [step_ratio(r) for r in rounds]
        results["step_ratios"] = ratios
        known = sorted((ratio, i) for i, ratio in enumerate(ratios) if ratio is not None)
        results.update(rounds[known[(len(known) - 1) // 2][1]] if known else rounds[0])  # the median round
        write(args.out, results)
    if "deterministic" in scenarios:
        print("deterministic: the engine in deterministic mode...", file=sys.stderr, flush=True)
        # Deterministic mode runs flash attention on (its guarantee rests on that path).
        results["engine_step_deterministic"] = engine_steps(8, args.threads, True, True)
    results["summary"] = summarise(results, systems)
    results["targets"] = targets(results)
    finish(results)
    write(args.out, results)
    print(report(results))
    print(f"\nwritten to {args.out}")
    return 0


def _median(rows: list[dict[str, Any]], key: str) -> dict[str, float] | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(results: dict[str, Any], systems: dict[str, str]) -> dict[str, Any]:
    """Per scenario and server, each measure's median over the rounds with its min and max; for
    llama-cache's bursts, the prompt tokens evaluated per system-prompt token and the cells held per
    unique token."""
    summary: dict[str, Any] = {}
    for scenario, servers in results.get("runs", {}).items():
        for name, rows in servers.items():
            keys = ("tokens_per_s", "ttft_first_p50", "ttft_later_p50", "ttft_later_p95", "gap_p50", "peak_rss",
                    "serving_peak_rss", "ttft_p50", "seconds")
            summary.setdefault(scenario, {})[name] = {k: _median(rows, k) for k in keys if _median(rows, k)}
    bursts = results.get("runs", {}).get("burst", {}).get("llama-cache", [])
    if bursts:
        system_tokens = len(vocabulary().tokenize(systems["burst"].encode()))
        evaluated, cells = [], []
        for row in bursts:
            m = row["metrics"]
            prompt = m.get("llama_cache_prompt_tokens_total", 0.0)
            reused = m.get("llama_cache_prompt_tokens_cached_total", 0.0)
            evaluated.append((prompt - reused) / system_tokens)
            held = prompt + row["tokens"] - row["requests"]  # every prompt and answer, the last token not evaluated
            unique = held - m.get("llama_cache_engine_shared_tokens_total", 0.0)
            if m.get("llama_cache_kv_cells_in_use") is not None and unique > 0:
                cells.append(m["llama_cache_kv_cells_in_use"] / unique)
        summary["burst_llama_cache"] = {"system_tokens": system_tokens,
                                        "evaluated_per_system_token": statistics.median(evaluated),
                                        "cells_per_unique_token": statistics.median(cells) if cells else None}
    return summary


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def targets(results: dict[str, Any]) -> dict[str, Any]:
    """Issue #26's targets with their measures and verdicts."""
    summary = results["summary"]
    decode = summary.get("decode", {})

    def med(server: str, key: str, scenario: dict[str, Any] = decode) -> float | None:
        value = scenario.get(server, {}).get(key)
        return None if value is None else value["median"]

    out: dict[str, Any] = {}

    def target(name: str, value: float | None, bound: float, higher_is_better: bool) -> None:
        met = None if value is None else (value >= bound if higher_is_better else value <= bound)
        out[name] = {"value": value, "target": bound, "met": met}

    def best(server: str) -> float | None:
        """The anchor's better throughput of its sides (flash attention as ours, and the other way)."""
        sides = [med(s, "tokens_per_s") for s in (server, *(f for f, (of, _) in FLASH_SIDES.items() if of == server))]
        found = [v for v in sides if v is not None]
        return max(found) if found else None

    target("throughput_vs_llama_server", _ratio(med("llama-cache", "tokens_per_s"), best("llama-server")),
           THROUGHPUT_VS_LLAMA_SERVER, True)
    target("throughput_vs_example_server",
           _ratio(med("llama-cache", "tokens_per_s"), best("example-server")), THROUGHPUT_VS_EXAMPLE, True)
    target("first_ttft_vs_example_server",
           _ratio(med("llama-cache", "ttft_first_p50"), med("example-server", "ttft_first_p50")),
           FIRST_TTFT_VS_EXAMPLE, False)
    burst = summary.get("burst_llama_cache", {})
    target("burst_evaluated_per_system_token", burst.get("evaluated_per_system_token"), BURST_EVALUATED, False)
    target("burst_cells_per_unique_token", burst.get("cells_per_unique_token"), CELLS_VS_UNIQUE, False)
    peaks = summary.get("burst", {})
    target("burst_peak_rss_vs_llama_server",
           _ratio(med("llama-cache", "peak_rss", peaks), med("llama-server", "peak_rss", peaks)), 1.0, False)
    if med("llama-cache", "serving_peak_rss", peaks) is not None:
        target("burst_serving_peak_rss_vs_llama_server",
               _ratio(med("llama-cache", "serving_peak_rss", peaks), med("llama-server", "serving_peak_rss", peaks)),
               1.0, False)
    target("step_vs_batched_bench", step_ratio(results), STEP_VS_BATCHED_BENCH, False)
    return out


def step_ratio(run: dict[str, Any]) -> float | None:
    """The engine's step with 8 sequences over ``llama-batched-bench``'s, the faster of its two KV
    layouts, in one round of the step scenario (None: either is missing)."""
    step = run.get("engine_step")
    benches = [(run.get(k) or {}).get("steps", {}).get("8", {}).get("step_s")
               for k in ("batched_bench", "batched_bench_unified")]
    bench_step = min((b for b in benches if b is not None), default=None)
    return _ratio(step["step_s"] if step else None, bench_step)


def report(results: dict[str, Any]) -> str:
    """The tables and verdicts, as printed."""
    lines = []
    for scenario, servers in results["summary"].items():
        if scenario == "burst_llama_cache":
            continue
        lines.append(f"\n{scenario}:")
        for name, row in servers.items():
            cells = ", ".join(f"{k} {v['median']:.4g} ({v['min']:.4g}-{v['max']:.4g})" for k, v in row.items())
            lines.append(f"  {name}: {cells}")
    for key in ("engine_step", "engine_step_deterministic"):
        step = results.get(key)
        if step:
            lines.append(f"\n{key}: step {step['step_s'] * 1000:.1f} ms (decode {step['decode_s'] * 1000:.1f} ms, "
                         f"Python {step['python_s'] * 1000:.2f} ms), {step['tokens_per_s']:.1f} tokens/s")
    for key, layout in (("batched_bench", "a KV stream per sequence"), ("batched_bench_unified", "unified KV")):
        bench = results.get(key)
        if bench:
            lines.append(f"llama-batched-bench, {layout}: " + ", ".join(
                f"{npl} sequences {v['tokens_per_s']:.1f} tokens/s ({v['step_s'] * 1000:.1f} ms a step)"
                for npl, v in bench["steps"].items()))
    lines.append("\ntargets:")
    for name, t in results["targets"].items():
        verdict = "not measured" if t["met"] is None else "met" if t["met"] else "NOT MET"
        value = "-" if t["value"] is None else f"{t['value']:.3g}"
        lines.append(f"  {name}: {value} (target {t['target']}): {verdict}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
