"""Scale-out benchmark (issue #21): 1, 2 and 3 servers behind nginx round-robin, conversations moving between them.

    tools/run python benchmarks/scale.py                        # the whole comparison, 2 rounds (~10 min, 2 quiet cores)
    tools/run python benchmarks/scale.py --rounds 3             # more rounds, tighter medians
    tools/run python benchmarks/scale.py --servers llama-cache --instances 2 --rounds 1   # a quick check

Setups, each started afresh for every run (no run begins with another's cache), all on loopback:

- ``llama-cache xN``: N ``llama-cache serve --parallel 1 --threads 1`` instances sharing one fresh
  ``redis-server`` (``--redis``; :class:`llama_cache.testing.redis_server.RedisServer`);
- ``llama-server xN``: N llama.cpp ``llama-server -np 1 -t 1`` instances, each with its own prompt cache
  (``cache_prompt`` is on by default, ``--cache-ram`` keeps the prompts of other conversations in host
  memory); nothing is shared between them. The binary is found as ``benchmarks/serve.py`` finds it
  (``$LLAMA_SERVER`` or ``~/.cache/llama-cache/llama-server/llama-server``; its docstring says how to build
  it); without it those setups are skipped with a message;

for N = 1, 2, 3 (``--instances``), each behind Debian's nginx with the configuration the serving docs
show (:class:`llama_cache.testing.deployment.Nginx`: round-robin, ``proxy_next_upstream``), plus one
``add_header X-Upstream $upstream_addr`` so that the client knows which instance served each response.
Both servers get the same model, context size (``--n-ctx``), threads, batch and flash attention, with the
flags ``benchmarks/servers.py`` gives them (``server_command``).

Workload: ``--conversations`` conversations (2), each on a system document of its own of
``--system-tokens`` tokens (1,500: turn 1 is cold for every conversation), ``--turns`` questions (4),
``--max-tokens`` tokens per answer (8), temperature 0, streamed chat completions, one request in flight.
The conversations are interleaved in serpentine order (turn 1: A, B; turn 2: B, A; turn 3: A, B; ...):
every request is sent right after the previous answer, as agents send their next call, and at each turn's
boundary a conversation sends its next turn right after its own answer (the case where the shared tier
must already hold the state that answer ended with). Round-robin alone would keep two interleaved
conversations on two instances each on its own instance; so before a turn that round-robin would send
back to the instance that served the conversation's previous turn, one ``GET /health`` goes through nginx
(standing for other clients' traffic), and every later turn moves to another instance. Which instance
served each turn is checked from ``X-Upstream``, and the table counts the turns that moved.

Measured per setup, client-side: time to first token (TTFT: from sending the request to the first
non-empty content delta) of turn 1 (cold), of turn 2 (on another instance) and of every later turn
(turns 2 to 4: median, min-max); the prompt tokens each instance was asked for and those it did not
evaluate (its hit rate: ``llama-cache``'s ``/metrics``, ``llama_cache_prompt_tokens_cached_total`` over
``llama_cache_prompt_tokens_total``; ``llama-server``'s per-response ``timings``, ``cache_n`` over
``cache_n + prompt_n``); the whole workload's wall time (start-up not included). Setups run in rotating
order from round to round (``--rounds``, default 2), so that a slow spell of this shared machine falls on
each in turn; TTFTs are pooled over the rounds, the wall time is the rounds' median (min-max). The load
average is recorded before and after every run.

Targets (a verdict for each):

- through the balancer, ``llama-cache``'s later-turn TTFT (median) is at most 1.5x a single instance's;
- turn 2 takes ``< 1 s`` (median), every turn 2 on another instance than turn 1 (the load average is shown);
- ``llama-server`` behind the same nginx pays the full prefill on every move: each turn landing on an
  instance its conversation has not visited evaluates at least 90% of its prompt. Its turn-2 and
  later-turn TTFTs are printed beside ours.

Prints a table and writes ``benchmarks/results/scale.json`` (machine, versions, settings, commands, every
request, medians, spreads and verdicts).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.servers import (
    DEFAULT_LLAMA_SERVER,
    REPO,
    Settings,
    cache_metrics,
    filler_text,
    find_llama_server,
    llama_server_version,
    server_command,
)
from benchmarks.machine import machine
from benchmarks.sse import read_stream
from llama_cache import default_model_path
from llama_cache.native_log import route_llama_cpp_logs
from llama_cache.server.config import on_off
from llama_cache.testing.deployment import Nginx, ServeProcess, nginx_config
from llama_cache.testing.redis_server import RedisServer

SERVERS = ("llama-cache", "llama-server")
QUESTIONS = [
    "Summarise the notes above in one sentence.",
    "Which word appears most often in them?",
    "Give the notes a short title.",
    "Name one thing the notes do not mention.",
    "Are the notes cheerful or sad?",
    "List two nouns from the notes.",
]
UPSTREAM_HEADER = "X-Upstream"
LATER_TARGET = 1.5  # later-turn TTFT through the balancer over a single instance's, at most
TURN2_TARGET_S = 1.0  # turn 2 on another instance, at most (median)
FULL_PREFILL = 0.9  # llama-server on an instance new to the conversation evaluates at least this share


class TracingNginx(Nginx):
    """:class:`Nginx` whose responses carry ``X-Upstream: host:port``, the instance that served them.

    The configuration is :func:`nginx_config`'s plus that one header; nginx reloads it (``SIGHUP``) once
    started, and the constructor returns when responses carry the header.
    """

    def __init__(self, upstreams: Sequence[str]) -> None:
        super().__init__(upstreams)
        config = nginx_config(upstreams, self.port, self.directory)
        proxy = "proxy_pass http://llama_cache;\n"
        if proxy not in config:
            self.stop()
            raise RuntimeError("nginx_config() has no 'proxy_pass http://llama_cache;' line to add a header to")
        header = f"            add_header {UPSTREAM_HEADER} $upstream_addr always;\n"
        (self.directory / "nginx.conf").write_text(config.replace(proxy, proxy + header))
        self.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while UPSTREAM_HEADER not in httpx.get(self.url + "/health", timeout=10).headers:
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("nginx did not reload its configuration")
            time.sleep(0.05)


@dataclass(frozen=True)
class Setup:
    server: str
    instances: int

    @property
    def name(self) -> str:
        return f"{self.server} x{self.instances}"


@dataclass
class Measure:
    """One turn as the client saw it."""

    conversation: int
    turn: int  # 1-based
    instance: int  # index of the instance that served it
    moved: bool  # served by another instance than the conversation's previous turn
    first_visit: bool  # the conversation had not been on this instance before
    ttft: float
    total: float
    prompt_tokens: int
    cached_tokens: int


def documents(model: Path, conversations: int, tokens: int) -> list[str]:
    """One system document per conversation, each at least ``tokens`` tokens long in the model's vocabulary."""
    import llama_cpp

    route_llama_cpp_logs()  # llama-cpp-python would print llama.cpp's warnings despite verbose=False
    vocab = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
    rng = random.Random(20261201)
    texts = []
    for number in range(conversations):
        text = f"Notes number {number + 1}, to read before answering."
        while len(vocab.tokenize(text.encode(), add_bos=False)) < tokens:
            text += " " + filler_text(rng, 12)
        texts.append(text)
    return texts


def _upstream(response: httpx.Response) -> str:
    # After a retry on the next instance nginx lists both ("a, b"): the last one answered.
    return response.headers[UPSTREAM_HEADER].split(",")[-1].strip()


def _ask(client: httpx.Client, url: str, messages: list[dict[str, str]], max_tokens: int
         ) -> tuple[str, str, float, float, int, int]:
    """One streamed chat completion: (reply, upstream, TTFT, total seconds, prompt tokens, cached tokens)."""
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=900) as response:
        response.raise_for_status()
        upstream = _upstream(response)
        stream = read_stream(response.iter_lines(), start)
    end = time.perf_counter() - start
    if stream.timings:  # llama-server: cache_n reused, prompt_n evaluated
        timings = stream.timings
        prompt, cached = int(timings["cache_n"]) + int(timings["prompt_n"]), int(timings["cache_n"])
    else:
        usage = stream.usage or {}
        prompt, cached = int(usage["prompt_tokens"]), int(usage["prompt_tokens_details"]["cached_tokens"])
    first = stream.first_content
    return stream.text, upstream, end if first is None else first, end, prompt, cached


def round_robin_cycle(client: httpx.Client, url: str, instances: int) -> list[str]:
    """The order in which nginx hands requests to the instances, read from ``instances`` probes."""
    return [_upstream(client.get(url + "/health")) for _ in range(instances)]


def converse(url: str, upstreams: list[str], texts: list[str], turns: int, max_tokens: int
             ) -> tuple[list[Measure], float, int]:
    """The workload through nginx at ``url``: (every turn, wall seconds, probes sent to move conversations)."""
    conversations = [[{"role": "system", "content": text}] for text in texts]
    visited: list[list[int]] = [[] for _ in texts]
    measures: list[Measure] = []
    probes = 0
    with httpx.Client(timeout=60) as client:
        cycle = round_robin_cycle(client, url, len(upstreams))
        last = cycle[-1]
        start = time.perf_counter()
        for turn in range(turns):
            order = range(len(texts)) if turn % 2 == 0 else reversed(range(len(texts)))
            for number in order:
                messages = conversations[number]
                previous = visited[number][-1] if visited[number] else None
                if previous is not None and len(cycle) > 1 and last in cycle:
                    following = cycle[(cycle.index(last) + 1) % len(cycle)]
                    if upstreams.index(following) == previous:
                        last = _upstream(client.get(url + "/health"))
                        probes += 1
                messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
                reply, last, ttft, total, prompt, cached = _ask(client, url, messages, max_tokens)
                messages.append({"role": "assistant", "content": reply})
                instance = upstreams.index(last)
                measures.append(Measure(number, turn + 1, instance, previous is not None and instance != previous,
                                        instance not in visited[number], ttft, total, prompt, cached))
                visited[number].append(instance)
        elapsed = time.perf_counter() - start
    return measures, elapsed, probes


def _command(server: str, model: Path, settings: Settings, llama_server: Path | None) -> list[str]:
    """``benchmarks/servers.py``'s command for ``server`` without its ``--port`` (ServeProcess adds one)."""
    command = server_command(server, model, settings, 0, llama_server)
    assert command is not None
    at = command.index("--port")
    return command[:at] + command[at + 2:]


def _start(count: int, arguments: list[str], command: list[str]) -> list[ServeProcess]:
    """``count`` servers started side by side; all stopped if one fails."""
    environment = {"PYTHONPATH": str(REPO)}
    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(ServeProcess, arguments, command=command, environment=environment, timeout=600)
                   for _ in range(count)]
    errors = [error for future in futures if (error := future.exception()) is not None]
    started = [future.result() for future in futures if future.exception() is None]
    if errors:
        for instance in started:
            instance.stop()
        raise errors[0]
    return started


def run_setup(setup: Setup, model: Path, settings: Settings, llama_server: Path | None, texts: list[str],
              turns: int, max_tokens: int) -> dict[str, Any]:
    """One run of the workload on a fresh deployment of ``setup``; its measures, hit rates and wall time."""
    redis = RedisServer() if setup.server == "llama-cache" else None
    command = _command(setup.server, model, settings, llama_server)
    instances: list[ServeProcess] = []
    nginx = None
    try:
        instances = _start(setup.instances, ["--redis", redis.url] if redis else [], command)
        upstreams = [f"127.0.0.1:{instance.port}" for instance in instances]
        nginx = TracingNginx(upstreams)
        load_before = os.getloadavg()[0]
        measures, elapsed, probes = converse(nginx.url, upstreams, texts, turns, max_tokens)
        load_after = os.getloadavg()[0]
        hits = []
        for index, instance in enumerate(instances):
            served = [m for m in measures if m.instance == index]
            if setup.server == "llama-cache":
                counters = cache_metrics(instance.url) or {}
                prompt = counters.get("llama_cache_prompt_tokens_total", 0.0)
                cached = counters.get("llama_cache_prompt_tokens_cached_total", 0.0)
            else:
                prompt = float(sum(m.prompt_tokens for m in served))
                cached = float(sum(m.cached_tokens for m in served))
            hits.append({"requests": len(served), "prompt_tokens": prompt, "cached_tokens": cached})
    finally:
        if nginx is not None:
            nginx.stop()
        for instance in instances:
            instance.stop()
        if redis is not None:
            redis.stop()
    return {"setup": setup.name, "command": command, "whole_run_s": elapsed, "probes": probes,
            "load_average": [round(load_before, 2), round(load_after, 2)], "instances": hits,
            "measures": [asdict(m) for m in measures]}


# -- summary ----------------------------------------------------------------------------------------


def _spread(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One setup's runs: TTFTs pooled over the rounds, the wall time's median and range, hit rates per instance."""
    measures = [m for run in runs for m in run["measures"]]
    later = [m for m in measures if m["turn"] > 1]
    instances = len(runs[0]["instances"])
    per_instance = []
    for index in range(instances):
        prompt = sum(run["instances"][index]["prompt_tokens"] for run in runs)
        cached = sum(run["instances"][index]["cached_tokens"] for run in runs)
        per_instance.append(cached / prompt if prompt else None)
    new_instance = [m for m in later if m["first_visit"]]
    return {
        "ttft_turn1": _spread([m["ttft"] for m in measures if m["turn"] == 1]),
        "ttft_turn2": _spread([m["ttft"] for m in measures if m["turn"] == 2]),
        "ttft_later": _spread([m["ttft"] for m in later]),
        "ttft_turns3plus": _spread([m["ttft"] for m in measures if m["turn"] > 2]),
        "whole_run_s": _spread([run["whole_run_s"] for run in runs]),
        "hit_rate_per_instance": per_instance,
        "later_moved": [sum(m["moved"] for m in later), len(later)],
        "turn2_moved": [sum(m["moved"] for m in measures if m["turn"] == 2), sum(m["turn"] == 2 for m in measures)],
        # The share of its prompt a later turn evaluated on an instance new to its conversation (worst one).
        "new_instance_evaluated_min": min(((m["prompt_tokens"] - m["cached_tokens"]) / m["prompt_tokens"]
                                           for m in new_instance), default=None),
        "new_instance_turns": len(new_instance),
        "prompt_tokens_turn1": _spread([float(m["prompt_tokens"]) for m in measures if m["turn"] == 1]),
        "load_average": [min(run["load_average"][0] for run in runs), max(run["load_average"][1] for run in runs)],
    }


def verdicts(summary: dict[str, dict[str, Any]], instances: list[int]) -> list[dict[str, Any]]:
    """The issue's targets, each with its measured value and whether it is met (None: not measured)."""
    out: list[dict[str, Any]] = []
    single = summary.get("llama-cache x1", {}).get("ttft_later", {}).get("median")
    # On a loaded machine a turn takes long even where it started: a single instance's turn 2 says how long.
    single_turn2 = summary.get("llama-cache x1", {}).get("ttft_turn2", {}).get("median")
    for n in instances:
        if n == 1:
            continue
        ours = summary.get(f"llama-cache x{n}")
        if ours is None:
            continue
        later = ours["ttft_later"]["median"]
        ratio = later / single if later is not None and single else None
        out.append({"target": f"llama-cache x{n}: later-turn TTFT <= {LATER_TARGET}x a single instance's",
                    "value": ratio, "unit": "x", "met": None if ratio is None else ratio <= LATER_TARGET})
        turn2 = ours["ttft_turn2"]
        moved, count = ours["turn2_moved"]
        out.append({"target": f"llama-cache x{n}: turn 2 on another instance < {TURN2_TARGET_S:g} s (median)",
                    "value": turn2["median"], "max": turn2["max"], "unit": "s", "moved": [moved, count],
                    "load_average": ours["load_average"], "single_instance": single_turn2,
                    "met": None if turn2["median"] is None else turn2["median"] < TURN2_TARGET_S and moved == count})
        theirs = summary.get(f"llama-server x{n}")
        if theirs is not None:
            evaluated = theirs["new_instance_evaluated_min"]
            out.append({"target": f"llama-server x{n}: full prefill on every move to an instance new to the "
                                  f"conversation (>= {FULL_PREFILL:.0%} of the prompt evaluated)",
                        "value": evaluated, "unit": "share", "turns": theirs["new_instance_turns"],
                        "turn2_vs_ours": _ratio(theirs["ttft_turn2"]["median"], turn2["median"]),
                        "later_vs_ours": _ratio(theirs["ttft_later"]["median"], later),
                        "met": None if evaluated is None else evaluated >= FULL_PREFILL})
    return out


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if not numerator or not denominator else numerator / denominator


# -- printing ---------------------------------------------------------------------------------------


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _range(spread: dict[str, Any]) -> str:
    return "-" if spread["median"] is None else f"{spread['median']:.2f} ({spread['min']:.2f}-{spread['max']:.2f})"


def table(results: dict[str, Any]) -> str:
    lines = [
        f"{results['conversations']} conversations x {results['turns']} turns on ~{results['system_tokens']}-token "
        f"documents, {results['max_tokens']} tokens per answer, {results['rounds']} round(s), model "
        f"{results['model']}; every instance: --parallel 1, {results['threads']} thread(s), n_ctx "
        f"{results['n_ctx']}, flash attention {'on' if results['flash_attn'] else 'off'}; nginx round-robin",
        "TTFT in seconds: median (min-max) over every turn of every round; whole run: median (min-max) of rounds",
        f"{'setup':<16} {'turn 1 (cold)':>19} {'turn 2 (moved)':>19} {'later turns 2-4':>19} {'moved':>6} "
        f"{'hit rate per instance':>22} {'whole run s':>20} {'load':>9}",
    ]
    for name, row in results["summary"].items():
        hits = "/".join("-" if h is None else f"{h:.0%}" for h in row["hit_rate_per_instance"])
        moved = f"{row['later_moved'][0]}/{row['later_moved'][1]}"
        lines.append(
            f"{name:<16} {_range(row['ttft_turn1']):>19} {_range(row['ttft_turn2']):>19} "
            f"{_range(row['ttft_later']):>19} {moved:>6} {hits:>22} {_range(row['whole_run_s']):>20} "
            f"{row['load_average'][0]:>4.1f}-{row['load_average'][1]:<4.1f}")
    lines += ["", "side by side, turn 2 and later turns (median TTFT, s): llama-cache | llama-server"]
    for n in results["instance_counts"]:
        ours = results["summary"].get(f"llama-cache x{n}")
        theirs = results["summary"].get(f"llama-server x{n}")
        if ours and theirs:
            lines.append(f"  x{n}: turn 2 {_s(ours['ttft_turn2']['median'])} | {_s(theirs['ttft_turn2']['median'])}"
                         f"   later {_s(ours['ttft_later']['median'])} | {_s(theirs['ttft_later']['median'])}")
    lines += ["", "targets:"]
    for verdict in results["verdicts"]:
        met = {True: "met", False: "NOT met", None: "not measured"}[verdict["met"]]
        value = verdict["value"]
        shown = "-" if value is None else (f"{value:.0%}" if verdict["unit"] == "share" else f"{value:.2f} {verdict['unit']}")
        extra = ""
        if "moved" in verdict and verdict["max"] is not None:
            low, high = verdict["load_average"]
            extra = (f", max {verdict['max']:.2f} s, {verdict['moved'][0]}/{verdict['moved'][1]} on another "
                     f"instance; load average {low:.1f}-{high:.1f} on {os.cpu_count()} CPUs; a single instance's "
                     f"turn 2: {_s(verdict['single_instance'])} s")
        if "turn2_vs_ours" in verdict:
            extra = (f" ({verdict['turns']} such turns; its turn 2 {_s(verdict['turn2_vs_ours'])}x ours, later turns "
                     f"{_s(verdict['later_vs_ours'])}x ours)")
        lines.append(f"  {verdict['target']}: {shown}{extra} - {met}")
    return "\n".join(lines)


def _version(command: list[str]) -> str | None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    return (done.stdout + done.stderr).strip().splitlines()[0] if (done.stdout + done.stderr).strip() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--instances", default="1,2,3", help="instance counts behind nginx")
    parser.add_argument("--rounds", type=int, default=2, help="runs of every setup, in rotating order")
    parser.add_argument("--conversations", type=int, default=2)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1500, help="tokens of each conversation's document")
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads per instance")
    parser.add_argument("--flash-attn", type=on_off, default=True, help="on or off, for every server (default on)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "scale.json")
    args = parser.parse_args(argv)
    if args.turns < 2 or args.rounds < 1 or args.conversations < 1:
        parser.error("at least 2 turns, 1 round and 1 conversation")
    started = time.perf_counter()
    model = default_model_path()
    llama_server = find_llama_server()
    servers = [name for name in args.servers.split(",") if name]
    if "llama-server" in servers and llama_server is None:
        print(f"llama-server: skipped: no llama-server binary (set $LLAMA_SERVER or build it into "
              f"{DEFAULT_LLAMA_SERVER}; see benchmarks/serve.py's docstring)", file=sys.stderr)
        servers.remove("llama-server")
    counts = [int(n) for n in args.instances.split(",")]
    # Same instance count side by side, then the next count: a slow spell hits both servers alike.
    setups = [Setup(server, n) for n in counts for server in servers]
    settings = Settings(args.n_ctx, 1, args.threads, args.flash_attn)
    texts = documents(model, args.conversations, args.system_tokens)
    results: dict[str, Any] = {
        "model": model.name, "n_ctx": args.n_ctx, "parallel": 1, "threads": args.threads,
        "n_batch": settings.n_batch, "flash_attn": args.flash_attn, "conversations": args.conversations,
        "turns": args.turns, "max_tokens": args.max_tokens, "system_tokens": args.system_tokens,
        "rounds": args.rounds, "instance_counts": counts, "balancer": "nginx round-robin",
        "machine": machine(), "llama_server_version": llama_server_version(llama_server),
        "nginx_version": _version(["nginx", "-v"]), "redis_version": _version(["redis-server", "--version"]),
        "runs": {},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    shift = -(-len(setups) // args.rounds)  # each round starts a fraction of the list further on
    for round_number in range(args.rounds):
        offset = (round_number * shift) % len(setups)
        for setup in setups[offset:] + setups[:offset]:
            print(f"round {round_number + 1}/{args.rounds}: {setup.name} (load {os.getloadavg()[0]:.1f})...",
                  file=sys.stderr, flush=True)
            run = run_setup(setup, model, settings, llama_server, texts, args.turns, args.max_tokens)
            run["round"] = round_number
            results["runs"].setdefault(setup.name, []).append(run)
    results["summary"] = {setup.name: summarise(results["runs"][setup.name]) for setup in setups}
    results["verdicts"] = verdicts(results["summary"], counts)
    results["wall_s"] = time.perf_counter() - started
    results["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    print(f"\nthe whole benchmark: {results['wall_s']:.0f} s; load average at the start "
          f"{results['machine']['load_average_start']}, at the end {results['load_average_end']}")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
