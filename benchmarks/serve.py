"""Serving load test on loopback: ``llama-cache serve`` against llama-cpp-python's and llama.cpp's servers.

Workload (the same for every server, in one run): ``--users`` users (default 6), each with a document of
its own (~500 words) in its first message after a shared system prompt (~300 words), ``--turns`` turns
each (default 4), ``--max-tokens`` tokens per answer (default 16), temperature 0, streamed chat
completions. At concurrency 1 the users' turns are interleaved one request at a time (user 1 turn 1,
user 2 turn 1, ..., user 1 turn 2, ...); at concurrency 4 every user runs its turns in sequence and at
most 4 requests are in flight. Time to first token (TTFT) is measured by the client: from sending the
request to the first non-empty content delta. The run stops by itself.

Servers, each started as a subprocess on a free port:

- ``llama-cache serve --parallel 4`` (RAM prompt cache);
- llama-cpp-python's server, ``python -m llama_cpp.server --cache true`` (one request at a time, a new
  request interrupts a running stream), twice: ``llama-cpp-python`` with every setting below equal to the
  others' and ``--logits_all false``, and ``llama-cpp-python-defaults`` with only the context size and the
  cache set, as its users run it (``logits_all`` on, half the logical CPUs generating, flash attention
  off);
- llama.cpp's ``llama-server -np 4`` (host-memory prompt cache), from ``$LLAMA_SERVER`` or
  ``~/.cache/llama-cache/llama-server/llama-server``; skipped with a message when absent. Build it once
  (outside the repository) from the llama.cpp sources vendored in llama-cpp-python's sdist::

      pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
      export CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" CXXFLAGS="$CFLAGS"  # x86_64 only
      cd llama_cpp_python-0.3.36 && cmake -B build vendor/llama.cpp -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
          -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF
      nice -n 19 cmake --build build --target llama-server llama-batched-bench -j2
      mkdir -p ~/.cache/llama-cache/llama-server
      cp build/bin/llama-server build/bin/llama-batched-bench ~/.cache/llama-cache/llama-server/

  (``BUILD_SHARED_LIBS=OFF``: one self-contained binary, llama.cpp and ggml linked in; the AMX flags
  are the ones ``tools/llama_cpp_build`` gives llama-cpp-python's build, so that both run the same
  kernels; ``llama-batched-bench`` is ``serve_engine.py``'s decode limit.)

Like is compared with like: every server but ``llama-cpp-python-defaults`` gets the same model,
context size per request (``--n-ctx``;
llama-server's ``-c`` is split between its slots, so it gets ``n_ctx * parallel``), llama.cpp threads
for prompts and for generation (``--threads``, default one per physical core: llama-server's own
default, which the others are given explicitly, since llama-cpp-python would generate on half the
logical CPUs), batch and micro-batch (512, llama-cpp-python's default) and flash attention
(``--flash-attn``, default: what ``llama-cache serve``'s ``auto`` picks, on; llama-server also runs
with the other setting, ``llama-server+nofa`` (off) or ``llama-server+fa`` (on), and the targets
against llama-server take its better side), and no logits kept for
every token: llama-cpp-python's server defaults to ``logits_all=True`` (its logprobs need it), which
makes every save into and load from its cache copy an n_tokens x n_vocab scores matrix (up to about
400 MB at n_ctx 2048 with the default model); ``--logits_all false`` shrinks that matrix to n_batch
rows, which it still copies. Everything else is each server's own default. Every side's settings and
command line are printed with the table and written to the JSON.

The runs are interleaved (every server at one concurrency, then the next concurrency, then the next
round: ``--rounds``, default 3), so that a slow spell of a shared machine falls on every server alike,
and the order of the servers rotates from round to round, so that none always runs first. The table
shows each measure's median over the rounds and its spread (min-max); the issue's targets are ratios of
those medians, each with the script's verdict (met, not met, or not measured).

``--with-api-key`` adds ``llama-cache-key``: ours started with ``--api-key`` (a random key), every
request carrying ``Authorization: Bearer``, placed right after ``llama-cache`` in the rotation; the
targets then give its times over ours without a key (at most 1.01x: key checking and limits cost at
most 1%). It is skipped with a message when this checkout's ``llama-cache serve`` has no ``--api-key``.

Prints a table and writes ``benchmarks/results/serve.json`` (the machine, the versions, every side's
settings, every run, the medians and spreads, the verdicts), rewritten after every run, so a failure
leaves the runs done so far::

    tools/run python benchmarks/serve.py [--servers llama-cache,llama-server,llama-cpp-python,...]
        [--rounds R] [--threads N] [--flash-attn on|off] [--with-api-key]
    tools/run python benchmarks/serve.py --users 2 --turns 2 --concurrency 1 --rounds 1   # a quick sanity check
    tools/run python benchmarks/serve.py --servers llama-cache --with-api-key --rounds 5   # the key's cost

``--scenario noisy`` runs ``benchmarks/serve_noisy.py`` instead (normal requests' latency beside clients
sending the worst requests the limits accept; see its docstring), with its own options; ``--scenario
structured`` runs ``benchmarks/serve_structured.py`` (structured outputs' cost per token and ``n`` = 4
against 4 separate requests, beside llama-server; see its docstring).
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from benchmarks.machine import finish, machine, write
from benchmarks.servers import (
    DEFAULT_LLAMA_SERVER,
    REPO,
    Settings,
    cache_metrics,
    filler_text,
    find_llama_server,
    free_port,
    llama_server_version,
    percentile,
    rotation,
    running_server,
    serve_takes_api_key,
    server_command,
)
from benchmarks.sse import read_stream
from llama_cache import default_model_path
from llama_cache.engine.context import flash_attention_for
from llama_cache.server.config import on_off, physical_cores

QUESTIONS = [
    "Summarise the document above in one sentence.",
    "Which word appears most often in it?",
    "Give the document a short title.",
    "Name one thing the document does not mention.",
    "Is the document cheerful or sad?",
    "List two nouns from the document.",
]


@dataclass
class Workload:
    system: str
    documents: list[str]
    turns: int
    max_tokens: int

    @classmethod
    def make(cls, users: int, turns: int, max_tokens: int, system_words: int, document_words: int) -> Workload:
        rng = random.Random(20261130)
        system = "You are a careful assistant who answers questions about documents. " + filler_text(rng, system_words)
        return cls(system, [filler_text(rng, document_words) for _ in range(users)], turns, max_tokens)


@dataclass
class Measure:
    user: int
    turn: int
    ttft: float
    total: float
    completed: bool


@dataclass
class Conversation:
    messages: list[dict[str, str]]
    measures: list[Measure] = field(default_factory=list)


def _ask(client: httpx.Client, url: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[str, float, float, bool]:
    """One streamed chat completion: (reply, TTFT, total seconds, ended with [DONE])."""
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        stream = read_stream(response.iter_lines(), start)
    end = time.perf_counter() - start
    first = stream.first_content
    return stream.text, end if first is None else first, end, stream.done


def run_workload(url: str, workload: Workload, concurrency: int,
                 headers: dict[str, str] | None = None) -> dict[str, Any]:
    users = [
        Conversation([{"role": "system", "content": workload.system},
                      {"role": "user", "content": f"Document:\n{doc}\n\n{QUESTIONS[0]}"}])
        for doc in workload.documents
    ]

    def turn(client: httpx.Client, index: int, number: int) -> None:
        conversation = users[index]
        if number > 0:
            conversation.messages.append({"role": "user", "content": QUESTIONS[number % len(QUESTIONS)]})
        reply, ttft, total, done = _ask(client, url, conversation.messages, workload.max_tokens)
        conversation.messages.append({"role": "assistant", "content": reply})
        conversation.measures.append(Measure(index, number, ttft, total, done))

    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    if concurrency == 1:
        with httpx.Client(headers=headers) as client:
            for number in range(workload.turns):
                for index in range(len(users)):
                    turn(client, index, number)
    else:
        gate = threading.Semaphore(concurrency)
        errors: list[BaseException] = []

        def user(index: int) -> None:
            try:
                with httpx.Client(headers=headers) as client:
                    for number in range(workload.turns):
                        with gate:
                            turn(client, index, number)
            except BaseException as error:  # noqa: BLE001 - reported after the join
                errors.append(error)

        threads = [threading.Thread(target=user, args=(i,)) for i in range(len(users))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
    elapsed = time.perf_counter() - start
    measures = [m for c in users for m in c.measures]
    first = sorted(m.ttft for m in measures if m.turn == 0)
    later = sorted(m.ttft for m in measures if m.turn > 0)
    return {
        "concurrency": concurrency,
        "requests": len(measures),
        "ttft_first_p50": percentile(first, 50),
        "ttft_first_p95": percentile(first, 95),
        "ttft_later_p50": percentile(later, 50),
        "ttft_later_p95": percentile(later, 95),
        "ttft_later_mean": statistics.fmean(later) if later else None,
        "whole_run_s": elapsed,
        "interrupted_streams": sum(1 for m in measures if not m.completed),
        # This machine is shared: the 1-minute load average before and after says how much.
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "each": [{"user": m.user, "turn": m.turn, "ttft": round(m.ttft, 4), "total": round(m.total, 4)}
                 for m in sorted(measures, key=lambda m: (m.turn, m.user))],
    }


def main(argv: list[str] | None = None) -> int:
    scenario = argparse.ArgumentParser(add_help=False)
    scenario.add_argument("--scenario", choices=("workload", "noisy", "structured"), default="workload")
    chosen, rest = scenario.parse_known_args(argv)
    if chosen.scenario == "noisy":
        from benchmarks import serve_noisy

        return serve_noisy.main(rest)
    if chosen.scenario == "structured":
        from benchmarks import serve_structured

        return serve_structured.main(rest)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[scenario])
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--with-api-key", action="store_true",
                        help="also run llama-cache with --api-key (llama-cache-key), every request carrying it")
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--rounds", type=int, default=3,
                        help="run every server this many times, interleaved, in a rotating order; the table shows "
                        "medians and spreads (default 3)")
    parser.add_argument("--users", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--system-words", type=int, default=300)
    parser.add_argument("--document-words", type=int, default=500)
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--parallel", type=int, default=4, help="contexts/slots of the servers that have them")
    parser.add_argument("--threads", type=int, default=physical_cores(),
                        help="llama.cpp threads, prompts and generation, for every server (default: physical cores)")
    parser.add_argument("--flash-attn", type=on_off, default=flash_attention_for(None, False),
                        help="on or off, for every server (default: llama-cache serve's auto here; llama-server "
                        "also runs with the other setting)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "serve.json")
    args = parser.parse_args(argv)
    model = default_model_path()
    llama_server = find_llama_server()
    levels = [int(c) for c in args.concurrency.split(",")]
    names = [name for name in args.servers.split(",") if name]
    if llama_server is None and "llama-server" in names:
        print(f"llama-server: skipped: no llama-server binary (set $LLAMA_SERVER or build it into "
              f"{DEFAULT_LLAMA_SERVER}; see this script's docstring)", file=sys.stderr)
        names.remove("llama-server")
    other_flash = "llama-server+nofa" if args.flash_attn else "llama-server+fa"
    if "llama-server" in names and other_flash not in names:
        names.insert(names.index("llama-server") + 1, other_flash)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    api_key = secrets.token_urlsafe(24) if args.with_api_key else None
    if api_key and "llama-cache-key" not in names:
        if not serve_takes_api_key(env):
            print("llama-cache-key: skipped: this checkout's llama-cache serve has no --api-key", file=sys.stderr)
        else:  # right after llama-cache: the two take turns going first (see below)
            names.insert(names.index("llama-cache") + 1 if "llama-cache" in names else 0, "llama-cache-key")
    settings = Settings(args.n_ctx, args.parallel, args.threads, args.flash_attn)
    results: dict[str, Any] = {"model": model.name, "n_ctx": args.n_ctx, "parallel": args.parallel,
                               "threads": settings.threads, "n_batch": settings.n_batch,
                               "n_ubatch": settings.n_batch, "flash_attn": settings.flash_attn,
                               "users": args.users, "turns": args.turns, "max_tokens": args.max_tokens,
                               "rounds": args.rounds, "machine": machine(),
                               "llama_server_version": llama_server_version(llama_server),
                               "sides": {name: LABELS[name] for name in names}, "commands": {}, "servers": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # Interleaved (round, level, server): a slow spell of this shared machine hits every server alike.
    for round_number in range(args.rounds):
        for concurrency in levels:
            for name in rotation(names, round_number):
                if name in ("llama-server+fa", "llama-server+nofa"):
                    command = server_command("llama-server", model, replace(settings, flash_attn=name.endswith("+fa")),
                                             free_port(), llama_server)
                else:
                    command = server_command(name, model, settings, free_port(), llama_server, api_key)
                assert command is not None
                port = int(command[command.index("--port") + 1])
                workload = Workload.make(args.users, args.turns, args.max_tokens, args.system_words,
                                         args.document_words)
                log = args.out.parent / f"serve-{name}-c{concurrency}.log"
                print(f"round {round_number + 1}/{args.rounds}: {name}, concurrency {concurrency}...",
                      file=sys.stderr, flush=True)
                # The last run's (ports differ); the key is a fresh random one per run.
                results["commands"][name] = [c if c != api_key else "KEY" for c in command]
                # A fresh server per run: no run starts with another's cache.
                headers = {"Authorization": f"Bearer {api_key}"} if name.endswith("-key") else None
                with running_server(command, port, env, log, headers) as url:
                    row = run_workload(url, workload, concurrency, headers)
                    row["server_metrics"] = cache_metrics(url, headers)
                row["round"] = round_number
                results["servers"].setdefault(name, []).append(row)
                write(args.out, results)  # what is done so far, if a later run fails
    results["summary"] = _summary(results)
    results["targets"] = _targets(results["summary"])
    finish(results)
    write(args.out, results)
    print(_table(results))
    print(_targets_text(results["targets"]))
    print(f"\nwritten to {args.out}")
    return 0


SERVERS = ("llama-cache", "llama-server", "llama-cpp-python", "llama-cpp-python-defaults")
# What each server is, for the table and the JSON; the exact command lines are in the JSON's "commands".
LABELS = {
    "llama-cache": "llama-cache serve, RAM prompt cache; the shared settings",
    "llama-cache-key": "llama-cache serve with --api-key, every request carrying it; the shared settings",
    "llama-server": "llama.cpp's llama-server, host-memory prompt cache; the shared settings",
    "llama-server+fa": "llama.cpp's llama-server, host-memory prompt cache; the shared settings but flash "
                       "attention on (its default on the CPU)",
    "llama-server+nofa": "llama.cpp's llama-server, host-memory prompt cache; the shared settings but flash "
                         "attention off",
    "llama-cpp-python": "llama-cpp-python's server, cache on; the shared settings, logits_all off",
    "llama-cpp-python-defaults": "llama-cpp-python's server, cache on; its defaults but n_ctx (logits_all on, "
                                 "half the logical CPUs generating, flash attention off)",
}
# Ours with --api-key over ours without (--with-api-key): key checking and limits cost at most 1%.
KEY_COST_TARGET = 1.01
_SUMMARISED = ("ttft_first_p50", "ttft_first_p95", "ttft_later_p50", "ttft_later_p95", "whole_run_s",
               "interrupted_streams")


def _summary(results: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per server and concurrency, each measure's median over the rounds and its spread (``<key>_spread``:
    min and max), the number of rounds, and the lowest and highest load average seen."""
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for name, rows in results["servers"].items():
        for concurrency in sorted({row["concurrency"] for row in rows}):
            runs = [row for row in rows if row["concurrency"] == concurrency]
            row: dict[str, Any] = {"rounds": len(runs)}
            for key in _SUMMARISED:
                values = [r[key] for r in runs if r[key] is not None]
                row[key] = statistics.median(values) if values else None
                row[f"{key}_spread"] = [min(values), max(values)] if values else None
            row["load_average"] = [min(r["load_average"][0] for r in runs), max(r["load_average"][1] for r in runs)]
            summary.setdefault(name, {})[str(concurrency)] = row
    return summary


# (name, numerator's server, denominator's server, measure, at most or at least, target: one for every
# concurrency, or by concurrency): each a ratio of the two servers' medians. Ours over llama-server's time
# (its better side: with flash attention as ours, or the other way); llama-cpp-python's over ours (a speed-up). The
# engine issue's (#26): later turns at 4 users p50 and p95 <= 0.8x llama-server's, one user p50 <= 0.9x.
_TARGETS: tuple[tuple[str, str, str, str, str, float | dict[str, float]], ...] = (
    ("later_vs_llama_server", "llama-cache", "llama-server", "ttft_later_p50", "<=", {"1": 0.9, "4": 0.8}),
    ("later_p95_vs_llama_server", "llama-cache", "llama-server", "ttft_later_p95", "<=", {"4": 0.8}),
    ("whole_vs_llama_server", "llama-cache", "llama-server", "whole_run_s", "<=", 1.1),
    ("later_speedup_over_llama-cpp-python", "llama-cpp-python", "llama-cache", "ttft_later_p50", ">=", 5.0),
    ("whole_speedup_over_llama-cpp-python", "llama-cpp-python", "llama-cache", "whole_run_s", ">=", 2.0),
    ("later_speedup_over_llama-cpp-python-defaults", "llama-cpp-python-defaults", "llama-cache", "ttft_later_p50",
     ">=", 5.0),
    ("whole_speedup_over_llama-cpp-python-defaults", "llama-cpp-python-defaults", "llama-cache", "whole_run_s",
     ">=", 2.0),
    ("key_later_vs_no_key", "llama-cache-key", "llama-cache", "ttft_later_p50", "<=", KEY_COST_TARGET),
    ("key_whole_vs_no_key", "llama-cache-key", "llama-cache", "whole_run_s", "<=", KEY_COST_TARGET),
)


def _targets(summary: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """The issue's targets per concurrency, each ``{"ratio", "target", "verdict"}``.

    The ratio is of the two servers' medians; its range (``ratio_range``: the lowest and highest ratio the
    two spreads allow) says how far the rounds let it move. The verdict is ``met`` or ``not met`` on the
    ratio of medians, ``not measured`` when either server did not run. ``later_vs_llama_server`` (p50:
    at most 0.9 with one user, 0.8 with 4), ``later_p95_vs_llama_server`` (p95 with 4 users: at most
    0.8) and ``whole_vs_llama_server`` (at most 1.1) are our time over llama-server's, at its better
    flash-attention side (``llama-server+fa`` or ``llama-server+nofa`` ran beside it);
    ``later_speedup_over_*`` (at least 5) and ``whole_speedup_over_*`` (at least 2) are
    llama-cpp-python's time over ours; ``key_*_vs_no_key`` (at most :data:`KEY_COST_TARGET`) are ours
    with an API key over ours without.
    """
    targets: dict[str, dict[str, dict[str, Any]]] = {}
    for concurrency in summary.get("llama-cache", {}):
        for name, top, bottom, key, sense, bounds in _TARGETS:
            bound = bounds.get(concurrency) if isinstance(bounds, dict) else bounds
            if bound is None:
                continue
            high = summary.get(top, {}).get(concurrency)
            low = summary.get(bottom, {}).get(concurrency)
            sides = [row for row in (low, *(summary.get(bottom + other, {}).get(concurrency)
                                             for other in ("+fa", "+nofa"))) if row and row[key]]
            if sides:  # an anchor's better side
                low = min(sides, key=lambda row: row[key])
            ratio = _ratio(high and high[key], low and low[key])
            spread = None
            if ratio is not None and high[f"{key}_spread"] and low[f"{key}_spread"]:
                spread = [_ratio(high[f"{key}_spread"][0], low[f"{key}_spread"][1]),
                          _ratio(high[f"{key}_spread"][1], low[f"{key}_spread"][0])]
            met = ratio is not None and (ratio <= bound if sense == "<=" else ratio >= bound)
            targets.setdefault(concurrency, {})[name] = {
                "ratio": ratio, "ratio_range": spread, "target": f"{sense} {bound:.2f}x",
                "verdict": "not measured" if ratio is None else "met" if met else "not met"}
    return targets


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if not numerator or not denominator else numerator / denominator


def _targets_text(targets: dict[str, dict[str, dict[str, Any]]]) -> str:
    def r(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    lines = ["", "the issue's targets (ratios of medians; in brackets the range the rounds' spreads allow):"]
    for concurrency, each in targets.items():
        for name, t in each.items():
            if t["verdict"] == "not measured" and name.startswith("key_"):
                continue  # --with-api-key not given
            within = f" ({r(t['ratio_range'][0])}-{r(t['ratio_range'][1])})" if t["ratio_range"] else ""
            lines.append(f"  concurrency {concurrency}: {name:<45} {r(t['ratio']):>7}{within:<18} target "
                         f"{t['target']:<9} {t['verdict'].upper()}")
    return "\n".join(lines)


def _table(results: dict[str, Any]) -> str:
    def s(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    def spread(row: dict[str, Any], key: str) -> str:
        low_high = row[f"{key}_spread"]
        return f"{s(row[key])} ({s(low_high[0])}-{s(low_high[1])})" if low_high else "-"

    lines = [
        f"{results['users']} users x {results['turns']} turns, {results['max_tokens']} tokens per answer, "
        f"model {results['model']}, {results['rounds']} round(s) in a rotating order; machine "
        f"{results['machine']['cpu']}, {results['machine']['logical_cpus']} CPUs",
        f"shared settings: n_ctx {results['n_ctx']} per request, {results['parallel']} slots where a server has "
        f"them, {results['threads']} threads (prompt and generation), batch {results['n_batch']}/"
        f"{results['n_ubatch']}, flash attention {'on' if results['flash_attn'] else 'off'}",
        *(f"  {name}: {label}" for name, label in results["sides"].items()),
        "seconds, median over rounds (min-max):",
        f"{'server':<25} {'conc':>4} {'TTFT t1 p50':>23} {'later p50':>23} {'later p95':>23} "
        f"{'whole run s':>23} {'cut':>4} {'load':>10}",
    ]
    for name, levels in results["summary"].items():
        for concurrency, row in levels.items():
            lines.append(
                f"{name:<25} {concurrency:>4} {spread(row, 'ttft_first_p50'):>23} {spread(row, 'ttft_later_p50'):>23} "
                f"{spread(row, 'ttft_later_p95'):>23} {spread(row, 'whole_run_s'):>23} "
                f"{row['interrupted_streams']:>4.0f} {row['load_average'][0]:>4.1f}-{row['load_average'][1]:<4.1f}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
