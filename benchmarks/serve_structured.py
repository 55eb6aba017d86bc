"""Structured outputs and ``n`` > 1 on loopback: ``llama-cache serve`` beside llama.cpp's ``llama-server``.

Both servers are started as ``benchmarks/serve.py`` starts them (``llama-server`` found as its docstring
says; skipped with a message when absent), with the same model, context per request, slots, threads,
batch and flash attention. Each round starts every server afresh, in an order that rotates from round
to round (``--rounds``, default 3), and measures two things on it:

1. **Structured-output overhead.** Five cases, each a chat prompt asking for JSON, answered greedily
   (temperature 0, ``seed`` 42, ``--max-tokens`` 64) with and without a constraint, streamed:
   ``small_object`` (two required properties), ``nested_arrays`` (an object holding an array of objects
   and an array of strings, both bounded), ``enum`` (an enum and an array of enums), ``pattern`` (three
   strings with ``pattern``), as ``response_format: {"type": "json_schema", "json_schema": {"name",
   "schema", "strict": true}}``, and ``json_object`` (``response_format: {"type": "json_object"}``).
   ``--repeats`` times (default 2), for every case, the request without and with the constraint
   (which goes first alternates), each right after the same prompt with ``max_tokens`` 1 (not measured),
   so that every measured request finds the same state cached: its prompt evaluated, one token sampled.
   One constrained request with another prompt (not measured) comes first, so that no measure pays for
   what a server sets up on its first constrained request. The client measures, on both servers
   alike, the time to first token (from sending the request to the first non-empty content delta) and
   the time per generated token, (last content delta - first content delta) / (content deltas - 1).
   ``llama-server``'s own ``timings`` (``predicted_per_token_ms``, ``prompt_ms``) are recorded beside
   them; the verdicts use the client's measures, the same for both servers. An answer is counted valid
   when it parses as a JSON object (a greedy answer cut at ``--max-tokens`` does not).

   Targets, per case, on the medians over rounds (each round's value the median of its repeats): ours
   constrained at most 1.2x ours unconstrained per token, and at most 1.0x ``llama-server``'s
   constrained per token.

2. **n = 4 against 4 separate requests**, on prompts of about ``--prompt-tokens`` (1000) tokens, every
   measure on a fresh prompt (a document of random words drawn for it alone, so nothing but the chat
   template's opening is cached), temperature 0.8, ``top_p`` 0.95, ``seed`` 7, ``--n-max-tokens`` (32)
   per choice with the end-of-generation tokens banned (``logit_bias``), so every choice runs to its
   limit. Per server and round:

   - ``prompt``: one request with ``max_tokens`` 1 (one prompt evaluation);
   - ``single``: one request with ``--n-max-tokens`` on ``prompt``'s prompt, which it finds cached: one
     generation (measured directly rather than as the difference of two noisy wall times);
   - ``n4``: one request with ``n`` 4;
   - ``separate4``: 4 requests one after another on one prompt, with seeds 7, 8, 9, 10 (choice ``i``'s
     seed in ``n4``): the first evaluates the prompt, the others find it cached.

   Prompt tokens evaluated: from each server's ``/metrics``, read before and after each measure (ours:
   ``llama_cache_prompt_tokens_total - llama_cache_prompt_tokens_cached_total``; ``llama-server``,
   started with ``--metrics`` for this: ``llamacpp:prompt_tokens_total``, the tokens it processed).
   Targets (ours): ``n4`` evaluates at most the request's prompt tokens (the prompt once), in every
   round; and its wall time is at most ``prompt + 4 x single`` plus 10% (the median over rounds of each
   round's ratio). ``llama-server`` answers ``n`` up to its slots (``-np``; 4 here) with that many
   choices, generated in as many slots.

A request the server refuses (4xx: a server or a checkout without the feature) is recorded as
"unsupported" with the server's message, and its targets as "not measured".
Prints a table and writes ``benchmarks/results/serve_structured.json`` (machine, versions, settings of
every side, every round's numbers, the summary and the verdicts); interrupted (Ctrl-C), it summarises
the runs finished::

    tools/run python benchmarks/serve.py --scenario structured [--rounds 3] [--servers llama-cache,llama-server]
    tools/run python benchmarks/serve_structured.py --rounds 1 --cases small_object,json_object   # a quick check
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.machine import machine
from benchmarks.servers import (
    DEFAULT_LLAMA_SERVER,
    REPO,
    Settings,
    filler_text,
    find_llama_server,
    free_port,
    llama_server_version,
    running_server,
    server_command,
)
from benchmarks.sse import read_stream
from llama_cache import default_model_path
from llama_cache.native_log import route_llama_cpp_logs
from llama_cache.server.config import on_off, physical_cores

SERVERS = ("llama-cache", "llama-server")
OVERHEAD_TARGET = 1.2  # ours constrained over ours unconstrained, per token
VS_LLAMA_SERVER_TARGET = 1.0  # ours constrained over llama-server's constrained, per token
N = 4
N_WALL_TARGET = 1.1  # n4's wall time over one prompt evaluation plus N generations
STRUCTURED_SEED = 42
N_SEED = 7


def _schema(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _json_schema(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


CASES: dict[str, tuple[str, dict[str, Any]]] = {  # name -> (prompt, response_format)
    "small_object": ("Describe a person called Ada, aged 36, as JSON with her name and age.",
                     _json_schema("person", _schema({"name": {"type": "string"}, "age": {"type": "integer"}}))),
    "nested_arrays": ("Describe a book as JSON: its title, its authors (name and birth year of each) and a few tags.",
                      _json_schema("book", _schema({
                          "title": {"type": "string"},
                          "authors": {"type": "array", "minItems": 1, "maxItems": 3,
                                      "items": _schema({"name": {"type": "string"}, "born": {"type": "integer"}})},
                          "tags": {"type": "array", "maxItems": 5, "items": {"type": "string"}},
                      }))),
    "enum": ("Classify this review as JSON, its sentiment and the aspects it mentions: 'The soup was cold, the "
             "waiter rude and the bill too high.'",
             _json_schema("review", _schema({
                 "sentiment": {"enum": ["positive", "negative", "neutral", "mixed"]},
                 "aspects": {"type": "array", "maxItems": 5,
                             "items": {"enum": ["food", "service", "price", "ambience", "location"]}},
             }))),
    "pattern": ("Give a shipment record as JSON: its date, its tracking code and the phone number of its sender.",
                _json_schema("shipment", _schema({
                    "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                    "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
                    "phone": {"type": "string", "pattern": "^\\+[0-9]{1,3} [0-9]{3} [0-9]{4}$"},
                }))),
    "json_object": ("List three fruits and their colours as JSON.", {"type": "json_object"}),
}


# -- requests ------------------------------------------------------------------------------------------


def _error(response: httpx.Response) -> str:
    """The error message of a refused request, as the server gave it."""
    try:
        error = response.json().get("error", {})
        return str(error.get("message", error) if isinstance(error, dict) else error)
    except (ValueError, AttributeError):
        return response.text[:300]


@dataclass
class Streamed:
    """One streamed chat completion, measured by the client.

    ``per_token``: (last content delta - first) / (content deltas - 1), None with fewer than two deltas;
    ``timings``: the server's own (llama-server's last chunk), None when it sends none.
    """

    status: int
    error: str | None = None
    ttft: float | None = None
    per_token: float | None = None
    total: float | None = None
    deltas: int = 0
    completion_tokens: int | None = None
    valid_json: bool | None = None
    timings: dict[str, float] | None = None


def stream_chat(client: httpx.Client, url: str, body: dict[str, Any]) -> Streamed:
    """Send ``body`` streamed to ``/v1/chat/completions`` and time its content deltas."""
    body = {**body, "model": "default", "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            return Streamed(response.status_code, error=_error(response))
        stream = read_stream(response.iter_lines(), start)
    end = time.perf_counter()
    stamps, usage, timings = stream.content_times, stream.usage, stream.timings
    try:
        valid = isinstance(json.loads(stream.text), dict)
    except ValueError:
        valid = False
    return Streamed(
        200, ttft=stamps[0] - start if stamps else None,
        per_token=(stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None,
        total=end - start, deltas=len(stamps), completion_tokens=usage and usage.get("completion_tokens"),
        valid_json=valid,
        timings=timings and {k: timings[k] for k in ("predicted_per_token_ms", "predicted_n", "prompt_ms", "prompt_n")
                             if k in timings},
    )


def structured_round(client: httpx.Client, url: str, cases: list[str], max_tokens: int,
                     repeats: int) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """``repeats`` x every case without and with its constraint, each after its prompt with ``max_tokens`` 1."""
    def body(case: str, constrained: bool) -> dict[str, Any]:
        prompt, response_format = CASES[case]
        extra = {"response_format": response_format} if constrained else {}
        return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
                "seed": STRUCTURED_SEED, **extra}

    # A server's first constrained request may set up what every later one shares (a tokenizer's tables).
    stream_chat(client, url, {"messages": [{"role": "user", "content": "Say hello in JSON."}], "max_tokens": 4,
                              "response_format": _json_schema("warm_up", {"type": "object"})})
    measured: dict[str, dict[str, list[dict[str, Any]]]] = {
        case: {"unconstrained": [], "constrained": []} for case in cases}
    for repeat in range(repeats):
        for case in cases:
            for constrained in (repeat % 2 == 0, repeat % 2 == 1):
                # The same cache state before every measure: the prompt just evaluated, one token sampled.
                stream_chat(client, url, {**body(case, False), "max_tokens": 1})
                mode = "constrained" if constrained else "unconstrained"
                measured[case][mode].append(dataclasses.asdict(stream_chat(client, url, body(case, constrained))))
    return measured


@dataclass
class NPrompts:
    """Fresh ~``tokens``-token prompts for the n measures; ``no_end``: a ``logit_bias`` banning end tokens."""

    words: int
    no_end: dict[str, int]
    rng: random.Random

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": "Document:\n" + filler_text(self.rng, self.words)
                 + "\n\nWrite a story inspired by the document above."}]


def n_prompts(tokens: int, seed: int) -> NPrompts:
    """Prompts of about ``tokens`` tokens of the default model's chat template (counted with its vocabulary)."""
    import llama_cpp

    from llama_cache.server.prompts import prompt_tokens_for_chat

    route_llama_cpp_logs()  # llama-cpp-python would print llama.cpp's warnings despite verbose=False
    probe = llama_cpp.Llama(str(default_model_path()), vocab_only=True, verbose=False)
    prompts = NPrompts(1000, {}, random.Random(0))
    per_word = len(prompt_tokens_for_chat(probe, prompts.messages())) / 1000
    end_tokens = {probe.token_eos(), *probe.tokenize(b"<|im_end|>", add_bos=False, special=True)}
    return NPrompts(int(tokens / per_word), {str(t): -100 for t in end_tokens if t >= 0}, random.Random(seed))


def _evaluated_so_far(client: httpx.Client, url: str) -> float | None:
    """Prompt tokens the server has evaluated since it started, from its ``/metrics``; None without them.

    Ours: ``llama_cache_prompt_tokens_total - llama_cache_prompt_tokens_cached_total``; llama-server's
    (started with ``--metrics``): ``llamacpp:prompt_tokens_total``, its tokens processed.
    """
    response = client.get(url + "/metrics")
    if response.status_code != 200:
        return None
    values: dict[str, float] = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    if "llama_cache_prompt_tokens_total" in values:
        return values["llama_cache_prompt_tokens_total"] - values["llama_cache_prompt_tokens_cached_total"]
    return values.get("llamacpp:prompt_tokens_total")


def _post(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One non-streamed chat completion: status, wall time, choices, usage, prompt tokens evaluated."""
    before = _evaluated_so_far(client, url)
    start = time.perf_counter()
    response = client.post(url + "/v1/chat/completions", json={**body, "model": "default"})
    wall = time.perf_counter() - start
    after = _evaluated_so_far(client, url)
    if response.status_code != 200:
        return {"status": response.status_code, "error": _error(response), "wall": wall}
    answer = response.json()
    usage = answer.get("usage") or {}
    timings = answer.get("timings") or {}
    choices = answer.get("choices") or []
    return {"status": 200, "wall": wall, "choices": len(choices),
            "distinct_choices": len({c.get("message", {}).get("content") for c in choices}),
            "finish_reasons": sorted({str(c.get("finish_reason")) for c in choices}),
            "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            "evaluated": None if before is None or after is None else after - before,
            "server_prompt_ms": timings.get("prompt_ms")}


def n_round(client: httpx.Client, url: str, prompts: NPrompts, max_tokens: int) -> dict[str, Any]:
    """``prompt``, ``single``, ``n4`` and ``separate4`` (see the module's docstring): ``single`` on ``prompt``'s
    prompt, the others each on a fresh one."""
    def body(messages: list[dict[str, str]], tokens: int, **extra: Any) -> dict[str, Any]:
        return {"messages": messages, "max_tokens": tokens, "temperature": 0.8, "top_p": 0.95, "seed": N_SEED,
                "logit_bias": prompts.no_end, **extra}

    cold = prompts.messages()
    measures = {"prompt": _post(client, url, body(cold, 1)),
                "single": _post(client, url, body(cold, max_tokens)),
                "n4": _post(client, url, body(prompts.messages(), max_tokens, n=N))}
    messages = prompts.messages()
    separate = [_post(client, url, body(messages, max_tokens, seed=N_SEED + i)) for i in range(N)]
    failed = next((m for m in separate if m["status"] != 200), None)
    measures["separate4"] = failed or {
        "status": 200, "wall": sum(m["wall"] for m in separate), "choices": N,
        "distinct_choices": len(separate), "prompt_tokens": separate[0]["prompt_tokens"],
        "completion_tokens": sum(m["completion_tokens"] or 0 for m in separate),
        "evaluated": None if any(m["evaluated"] is None for m in separate) else sum(m["evaluated"] for m in separate),
        "each": separate}
    return measures


# -- the run ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", type=lambda text: [c for c in text.split(",") if c], default=list(CASES),
                        help=f"structured-output cases (default: all, {','.join(CASES)})")
    parser.add_argument("--repeats", type=int, default=2, help="measures of every case and mode per round")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per structured-output answer")
    parser.add_argument("--prompt-tokens", type=int, default=1000, help="prompt length of the n measures")
    parser.add_argument("--n-max-tokens", type=int, default=32, help="tokens per choice of the n measures")
    parser.add_argument("--skip-n", action="store_true", help="measure structured outputs only")
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--parallel", type=int, default=4, help="contexts/slots of every server")
    parser.add_argument("--threads", type=int, default=physical_cores())
    parser.add_argument("--flash-attn", type=on_off, default=True)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "serve_structured.json")
    args = parser.parse_args(argv)
    if not args.cases or set(args.cases) - set(CASES):
        parser.error(f"--cases: choose among {','.join(CASES)}")
    model = default_model_path()
    llama_server = find_llama_server()
    names = [name for name in args.servers.split(",") if name]
    if set(names) - set(SERVERS):
        parser.error(f"--servers: choose among {','.join(SERVERS)}")
    if llama_server is None and "llama-server" in names:
        print(f"llama-server: skipped: no llama-server binary (set $LLAMA_SERVER or build it into "
              f"{DEFAULT_LLAMA_SERVER}; see benchmarks/serve.py's docstring)", file=sys.stderr)
        names.remove("llama-server")
    prompts = n_prompts(args.prompt_tokens, seed=20261201)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    settings = Settings(args.n_ctx, args.parallel, args.threads, args.flash_attn)
    results: dict[str, Any] = {
        "scenario": "structured", "model": model.name, "machine": machine(),
        "llama_server_version": llama_server_version(llama_server),
        "servers_settings": dataclasses.asdict(settings),
        "structured": {"cases": {c: CASES[c][1] for c in args.cases}, "prompts": {c: CASES[c][0] for c in args.cases},
                       "max_tokens": args.max_tokens, "temperature": 0, "seed": STRUCTURED_SEED,
                       "repeats": args.repeats, "stream": True},
        "n": None if args.skip_n else {
            "n": N, "prompt_words": prompts.words, "max_tokens": args.n_max_tokens, "temperature": 0.8,
            "top_p": 0.95, "seed": N_SEED, "banned_end_tokens": sorted(prompts.no_end)},
        "rounds": args.rounds, "commands": {}, "runs": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        for round_number in range(args.rounds):
            shift = round_number % len(names)
            for name in names[shift:] + names[:shift]:  # a different server first in every round
                command = server_command(name, model, settings, free_port(), llama_server)
                assert command is not None
                command += ["--metrics"] if name == "llama-server" else []  # its prompt tokens evaluated
                port = int(command[command.index("--port") + 1])
                results["commands"][name] = command
                log = args.out.parent / f"serve-structured-{name}.log"
                print(f"round {round_number + 1}/{args.rounds}: {name}...", file=sys.stderr, flush=True)
                load = os.getloadavg()[0]
                run: dict[str, Any] = {"round": round_number, "server": name}
                with running_server(command, port, env, log) as url, httpx.Client(timeout=600) as client:
                    run["structured"] = structured_round(client, url, args.cases, args.max_tokens, args.repeats)
                    if not args.skip_n:
                        run["n"] = n_round(client, url, prompts, args.n_max_tokens)
                run["load_average"] = [round(load, 2), round(os.getloadavg()[0], 2)]
                results["runs"].append(run)
                args.out.write_text(json.dumps(results, indent=2) + "\n")  # what is done so far, if a later run fails
    except KeyboardInterrupt:  # on a slow machine: the runs finished are summarised
        results["interrupted"] = True
        print(f"interrupted: the summary covers the {len(results['runs'])} run(s) finished", file=sys.stderr)
        if not results["runs"]:
            return 1
    results["summary"] = _summary(results["runs"], args.cases)
    results["targets"] = _targets(results["summary"])
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(_table(results))
    print(f"\nwritten to {args.out}")
    return 0


# -- summary, targets, table ---------------------------------------------------------------------------------


def _spread(values: list[float]) -> dict[str, float] | None:
    """The median and the spread (min, max) of ``values``; None when there are none."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None


def _refusal(rows: list[dict[str, Any]]) -> str | None:
    """The first refusal among ``rows`` ("unsupported: <status> <message>"), or None."""
    refused = next((r for r in rows if r["status"] != 200), None)
    return f"unsupported: {refused['status']} {refused['error']}" if refused else None


def _structured_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One case and mode of one server over the rounds; ``rows``: every round's list of measures."""
    measures = [m for round_rows in rows for m in round_rows]
    refused = _refusal(measures)
    if refused:
        return {"refused": refused}

    def per_round(key: str, scale: float = 1.0) -> list[float]:
        medians = []
        for round_rows in rows:
            values = [m[key] for m in round_rows if m[key] is not None]
            if values:
                medians.append(statistics.median(values) * scale)
        return medians

    def server_timing(key: str) -> list[float]:
        return [statistics.median(v) for round_rows in rows
                if (v := [m["timings"][key] for m in round_rows if m["timings"] and key in m["timings"]])]

    return {"refused": None, "ttft_ms": _spread(per_round("ttft", 1000)),
            "per_token_ms": _spread(per_round("per_token", 1000)),
            "deltas": _spread(per_round("deltas")),
            "valid_json": f"{sum(1 for m in measures if m['valid_json'])}/{len(measures)}",
            "server_per_token_ms": _spread(server_timing("predicted_per_token_ms")),
            "server_prompt_ms": _spread(server_timing("prompt_ms"))}


def _n_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The n measures of one server over the rounds, and each round's bound for ``n4``."""
    summary: dict[str, Any] = {}
    for kind in ("prompt", "single", "n4", "separate4"):
        measures = [r[kind] for r in rows]
        refused = _refusal(measures)
        summary[kind] = {"refused": refused} if refused else {
            "refused": None, "wall_s": _spread([m["wall"] for m in measures]),
            "prompt_tokens": _spread([m["prompt_tokens"] for m in measures if m["prompt_tokens"] is not None]),
            "evaluated": _spread([m["evaluated"] for m in measures if m["evaluated"] is not None]),
            "choices": _spread([m["choices"] for m in measures]),
            "distinct_choices": _spread([m["distinct_choices"] for m in measures]),
            "completion_tokens": _spread([m["completion_tokens"] for m in measures
                                          if m["completion_tokens"] is not None])}
    if summary["prompt"]["refused"] is None and summary["single"]["refused"] is None:
        bounds = [r["prompt"]["wall"] + N * r["single"]["wall"] for r in rows]
        summary["bound_s"] = _spread(bounds)
        for kind in ("n4", "separate4"):
            if summary[kind]["refused"] is None:
                summary[kind]["over_bound"] = _spread([r[kind]["wall"] / b for r, b in zip(rows, bounds)])
        if summary["n4"]["refused"] is None:
            # At most the request's prompt tokens evaluated: the prompt once, however many choices.
            summary["n4"]["evaluated_once_rounds"] = sum(
                1 for r in rows if r["n4"]["evaluated"] is not None and r["n4"]["prompt_tokens"] is not None
                and r["n4"]["evaluated"] <= r["n4"]["prompt_tokens"])
    summary["rounds"] = len(rows)
    return summary


def _summary(runs: list[dict[str, Any]], cases: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for name in dict.fromkeys(run["server"] for run in runs):
        mine = [run for run in runs if run["server"] == name]
        summary[name] = {
            "structured": {case: {mode: _structured_summary([run["structured"][case][mode] for run in mine])
                                  for mode in ("unconstrained", "constrained")} for case in cases},
            "n": _n_summary([run["n"] for run in mine]) if all("n" in run for run in mine) else None,
            "load_average": [min(r["load_average"][0] for r in mine), max(r["load_average"][1] for r in mine)]}
    return summary


def _median(row: dict[str, Any] | None, key: str) -> float | None:
    return None if row is None or row.get("refused") or not row.get(key) else row[key]["median"]


def _verdict(ratio: float | None, target: float) -> str:
    return "not measured" if ratio is None else "met" if ratio <= target else "missed"


def _targets(summary: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets for ours, each with its ratio(s), the target and the verdict."""
    ours = summary.get("llama-cache")
    theirs = summary.get("llama-server")
    if ours is None:
        return {}
    targets: dict[str, Any] = {"structured": {}}
    for case, modes in ours["structured"].items():
        constrained = _median(modes["constrained"], "per_token_ms")
        unconstrained = _median(modes["unconstrained"], "per_token_ms")
        other = _median(theirs["structured"][case]["constrained"], "per_token_ms") if theirs else None
        overhead = None if constrained is None or not unconstrained else constrained / unconstrained
        versus = None if constrained is None or not other else constrained / other
        ttft = _median(modes["constrained"], "ttft_ms")
        ttft_plain = _median(modes["unconstrained"], "ttft_ms")
        ttft_other = _median(theirs["structured"][case]["constrained"], "ttft_ms") if theirs else None
        targets["structured"][case] = {
            "per_token_overhead": {"ratio": overhead, "target": OVERHEAD_TARGET,
                                   "verdict": _verdict(overhead, OVERHEAD_TARGET)},
            "per_token_vs_llama_server": {"ratio": versus, "target": VS_LLAMA_SERVER_TARGET,
                                          "verdict": _verdict(versus, VS_LLAMA_SERVER_TARGET)},
            # No target: the constraint's compile shows here.
            "ttft_overhead": None if ttft is None or not ttft_plain else ttft / ttft_plain,
            "ttft_vs_llama_server": None if ttft is None or not ttft_other else ttft / ttft_other,
        }
    n = ours["n"]
    if n is not None:
        n4 = n["n4"]
        once = None if n4["refused"] else f"{n4['evaluated_once_rounds']}/{n['rounds']} rounds"
        over = _median(n4, "over_bound")
        wall = _median(n4, "wall_s")
        separate = _median(n["separate4"], "wall_s")
        other = _median(theirs["n"]["n4"], "wall_s") if theirs and theirs["n"] else None
        targets["n"] = {
            "prompt_evaluated_once": {"rounds": once, "verdict": "not measured" if once is None else
                                      "met" if n4["evaluated_once_rounds"] == n["rounds"] else "missed"},
            "wall_vs_prompt_plus_4_generations": {"ratio": over, "target": N_WALL_TARGET,
                                                  "verdict": _verdict(over, N_WALL_TARGET)},
            # No targets: n4's wall time over 4 separate requests' and over llama-server's n4.
            "wall_vs_separate4": None if wall is None or not separate else wall / separate,
            "wall_vs_llama_server": None if wall is None or not other else wall / other,
        }
    return targets


def _table(results: dict[str, Any]) -> str:
    def ms(row: dict[str, Any], key: str) -> str:
        value = row.get(key)
        return "-" if not value else f"{value['median']:.1f} ({value['min']:.1f}-{value['max']:.1f})"

    def x(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    settings = results["servers_settings"]
    structured = results["structured"]
    lines = [
        f"structured outputs and n on model {results['model']}, {results['rounds']} round(s)"
        f"{' (interrupted: ' + str(len(results['runs'])) + ' run(s) finished)' if results.get('interrupted') else ''}"
        f"; every server: n_ctx "
        f"{settings['n_ctx']} per request, {settings['parallel']} slots, {settings['threads']} threads, batch "
        f"{settings['n_batch']}, flash attention {'on' if settings['flash_attn'] else 'off'}; machine "
        f"{results['machine']['cpu']}, {results['machine']['logical_cpus']} CPUs; load average "
        + ", ".join(f"{name} {s['load_average'][0]:.1f}-{s['load_average'][1]:.1f}"
                    for name, s in results["summary"].items()),
        "",
        f"structured outputs: greedy, max_tokens {structured['max_tokens']}, streamed; milliseconds, median over "
        "rounds (min-max); TTFT and per token measured by the client; 'srv': llama-server's own timings",
        f"{'server':<13} {'case':<14} {'mode':<13} {'TTFT ms':>20} {'per token ms':>20} {'deltas':>6} "
        f"{'JSON':>5} {'srv per token':>20} {'srv prompt':>20}",
    ]
    for name, s in results["summary"].items():
        for case, modes in s["structured"].items():
            for mode, row in modes.items():
                if row["refused"]:
                    lines.append(f"{name:<13} {case:<14} {mode:<13} {row['refused'][:90]}")
                    continue
                deltas = row["deltas"]["median"] if row["deltas"] else 0
                lines.append(f"{name:<13} {case:<14} {mode:<13} {ms(row, 'ttft_ms'):>20} "
                             f"{ms(row, 'per_token_ms'):>20} {deltas:>6.0f} {row['valid_json']:>5} "
                             f"{ms(row, 'server_per_token_ms'):>20} {ms(row, 'server_prompt_ms'):>20}")
    n_settings = results["n"]
    if n_settings:
        lines += ["", f"n = {N} against {N} separate requests: fresh prompts of ~{n_settings['prompt_words']} words, "
                  f"{n_settings['max_tokens']} tokens per choice (end tokens banned), temperature "
                  f"{n_settings['temperature']}; seconds, median (min-max); 'evaluated': prompt tokens evaluated",
                  f"{'server':<13} {'measure':<10} {'wall s':>20} {'prompt tok':>10} {'evaluated':>10} "
                  f"{'choices':>7} {'distinct':>8} {'over bound':>20}"]
        for name, s in results["summary"].items():
            n = s["n"]
            if n is None:
                continue
            for kind in ("prompt", "single", "n4", "separate4"):
                row = n[kind]
                if row["refused"]:
                    lines.append(f"{name:<13} {kind:<10} {row['refused'][:100]}")
                    continue

                def med(key: str, row: dict[str, Any] = row) -> str:
                    return "-" if not row.get(key) else f"{row[key]['median']:.0f}"

                over = row.get("over_bound")
                over_text = "-" if not over else f"{over['median']:.2f}x ({over['min']:.2f}-{over['max']:.2f})"
                wall = row["wall_s"]
                wall_text = f"{wall['median']:.3f} ({wall['min']:.3f}-{wall['max']:.3f})"
                lines.append(f"{name:<13} {kind:<10} {wall_text:>20} {med('prompt_tokens'):>10} "
                             f"{med('evaluated'):>10} {med('choices'):>7} {med('distinct_choices'):>8} "
                             f"{over_text:>20}")
            if n.get("bound_s"):
                b = n["bound_s"]
                lines.append(f"{name:<13} bound: prompt + {N} x single = {b['median']:.3f} s "
                             f"({b['min']:.3f}-{b['max']:.3f})")
    targets = results["targets"]
    if targets:
        lines += ["", "targets (llama-cache, ratios of medians):"]
        for case, t in targets["structured"].items():
            overhead, versus = t["per_token_overhead"], t["per_token_vs_llama_server"]
            lines.append(f"  {case:<14} per token constrained/unconstrained {x(overhead['ratio'])} (<= "
                         f"{OVERHEAD_TARGET:.1f}x): {overhead['verdict']}; over llama-server's constrained "
                         f"{x(versus['ratio'])} (<= {VS_LLAMA_SERVER_TARGET:.1f}x): {versus['verdict']}; TTFT "
                         f"constrained/unconstrained {x(t['ttft_overhead'])}, over llama-server's "
                         f"{x(t['ttft_vs_llama_server'])}")
        if "n" in targets:
            once, wall = targets["n"]["prompt_evaluated_once"], targets["n"]["wall_vs_prompt_plus_4_generations"]
            lines.append(f"  n = {N}: prompt evaluated once in {once['rounds'] or '-'}: {once['verdict']}; wall time "
                         f"{x(wall['ratio'])} of prompt + {N} generations (<= {N_WALL_TARGET:.1f}x): "
                         f"{wall['verdict']}; "
                         f"{x(targets['n']['wall_vs_separate4'])} of {N} separate requests', "
                         f"{x(targets['n']['wall_vs_llama_server'])} of llama-server's n = {N}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
