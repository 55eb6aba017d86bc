"""An agent loop over the Responses API: ``previous_response_id`` against re-sending the whole history.

Workload: an agent of ``--steps`` steps (default 10) under one set of instructions (``--system-words``,
default 300 words): each step sends a tool's result (``--observation-words``, default 60 words) and
streams the model's next ``--max-tokens`` tokens (default 16), temperature 0. Sides, each on a fresh
server started as a subprocess (``benchmarks/serve.py``'s commands and settings):

- ``responses-chained``: ``llama-cache serve``'s ``/v1/responses``, each step naming the last response as
  ``previous_response_id`` and sending only its new input (the server renders the conversation);
- ``responses-history``: ours, ``/v1/responses`` with ``store: false``, the whole history sent each step;
- ``chat-history``: ours, ``/v1/chat/completions``, the whole history sent each step;
- ``llama-server-responses``: llama.cpp's ``llama-server`` ``/v1/responses``, the whole history sent each
  step (it refuses ``previous_response_id``); skipped with a message when no binary is found
  (``$LLAMA_SERVER`` or ``~/.cache/llama-cache/llama-server/llama-server``: see ``benchmarks/serve.py``).

Measured per step, by the client: the time to first token (from sending the request to the first text
delta: ``response.output_text.delta`` or a chat content delta) and the request body's bytes; and the
prompt tokens and cached tokens the server reports. The sides run interleaved over ``--rounds`` rounds
(default 3), their order rotated each round; the result holds every run and, per side and step, the
median over the rounds.

Prints a table and writes ``benchmarks/results/responses_agent.json`` (the machine, the versions, the
settings, every run, the medians), rewritten after every run::

    tools/run python benchmarks/responses_agent.py [--sides responses-chained,chat-history,...] [--rounds R]
    tools/run python benchmarks/responses_agent.py --steps 3 --rounds 1 --out /tmp/responses_agent.json  # a quick check
"""

from __future__ import annotations

import argparse
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

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import finish, machine, write  # noqa: E402
from benchmarks.servers import (  # noqa: E402
    DEFAULT_LLAMA_SERVER,
    REPO,
    Settings,
    filler_text,
    find_llama_server,
    free_port,
    llama_server_version,
    rotation,
    running_server,
    server_command,
)
from benchmarks.sse import read_stream  # noqa: E402
from llama_cache import default_model_path  # noqa: E402
from llama_cache.server.config import on_off, physical_cores  # noqa: E402

SIDES = ("responses-chained", "responses-history", "chat-history", "llama-server-responses")
LABELS = {
    "responses-chained": "llama-cache serve, /v1/responses with previous_response_id: only the new input sent",
    "responses-history": "llama-cache serve, /v1/responses with store false: the whole history sent",
    "chat-history": "llama-cache serve, /v1/chat/completions: the whole history sent",
    "llama-server-responses": "llama.cpp's llama-server, /v1/responses: the whole history sent",
}
SERVER_OF = {"responses-chained": "llama-cache", "responses-history": "llama-cache", "chat-history": "llama-cache",
             "llama-server-responses": "llama-server"}


@dataclass(frozen=True)
class Workload:
    instructions: str
    observations: list[str]
    max_tokens: int

    @classmethod
    def make(cls, steps: int, system_words: int, observation_words: int, max_tokens: int) -> Workload:
        rng = random.Random(20261201)
        instructions = ("You are an agent that reads tool results and decides the next step. "
                        + filler_text(rng, system_words))
        return cls(instructions, [f"Tool result {i + 1}: {filler_text(rng, observation_words)}" for i in range(steps)],
                   max_tokens)


@dataclass
class Step:
    ttft: float
    total: float
    sent_bytes: int
    prompt_tokens: int | None
    cached_tokens: int | None
    text: str


def _responses_step(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[Step, str | None]:
    """One streamed ``/v1/responses`` request: its step and the response's id."""
    raw = json.dumps(body).encode()
    start = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    completed: dict[str, Any] | None = None
    with client.stream("POST", url + "/v1/responses", content=raw, timeout=600,
                       headers={"Content-Type": "application/json"}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            kind = event.get("type")
            if kind == "response.output_text.delta" and event.get("delta"):
                first = first if first is not None else time.perf_counter() - start
                parts.append(event["delta"])
            elif kind in ("response.completed", "response.incomplete"):
                completed = event["response"]
                break
    total = time.perf_counter() - start
    usage = (completed or {}).get("usage") or {}
    step = Step(first if first is not None else total, total, len(raw), usage.get("input_tokens"),
                (usage.get("input_tokens_details") or {}).get("cached_tokens"), "".join(parts))
    return step, (completed or {}).get("id")


def _chat_step(client: httpx.Client, url: str, body: dict[str, Any]) -> Step:
    raw = json.dumps(body).encode()
    start = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", content=raw, timeout=600,
                       headers={"Content-Type": "application/json"}) as response:
        response.raise_for_status()
        stream = read_stream(response.iter_lines(), start)
    total = time.perf_counter() - start
    usage = stream.usage or {}
    first = stream.first_content
    return Step(total if first is None else first, total, len(raw), usage.get("prompt_tokens"),
                (usage.get("prompt_tokens_details") or {}).get("cached_tokens"), stream.text)


def _item(message: dict[str, str]) -> dict[str, Any]:
    """A chat message as a Responses input item, typed in full (llama-server asks for every ``type``)."""
    part = "output_text" if message["role"] == "assistant" else "input_text"
    return {"type": "message", "role": message["role"], "content": [{"type": part, "text": message["content"]}]}


def run_side(side: str, url: str, workload: Workload) -> list[Step]:
    """The agent loop of ``side`` against the server at ``url``."""
    steps: list[Step] = []
    history: list[dict[str, str]] = []
    previous: str | None = None
    with httpx.Client() as client:
        for observation in workload.observations:
            history.append({"role": "user", "content": observation})
            common = {"model": "default", "temperature": 0, "stream": True}
            if side == "chat-history":
                step = _chat_step(client, url, {
                    **common, "max_tokens": workload.max_tokens, "stream_options": {"include_usage": True},
                    "messages": [{"role": "system", "content": workload.instructions}, *history]})
            elif side == "responses-chained":
                body = {**common, "max_output_tokens": workload.max_tokens, "instructions": workload.instructions,
                        "input": [_item(history[-1])]}
                if previous is not None:
                    body["previous_response_id"] = previous
                step, previous = _responses_step(client, url, body)
            else:
                step, _ = _responses_step(client, url, {
                    **common, "max_output_tokens": workload.max_tokens, "instructions": workload.instructions,
                    "input": [_item(message) for message in history], "store": False})
            history.append({"role": "assistant", "content": step.text})
            steps.append(step)
    return steps


def _summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per side: per step, the medians over the rounds; and the totals' medians."""
    summary: dict[str, dict[str, Any]] = {}
    for side, rounds in runs.items():
        steps = min(len(run["steps"]) for run in rounds)
        per_step = []
        for index in range(steps):
            each = [run["steps"][index] for run in rounds]
            per_step.append({key: _median([s[key] for s in each]) for key in
                             ("ttft", "sent_bytes", "prompt_tokens", "cached_tokens")})
        later = [step["ttft"] for step in per_step[1:] if step["ttft"] is not None]
        summary[side] = {
            "rounds": len(rounds), "steps": per_step,
            "ttft_first": per_step[0]["ttft"] if per_step else None,
            "ttft_later_mean": statistics.fmean(later) if later else None,
            "sent_bytes_total": sum(step["sent_bytes"] or 0 for step in per_step),
            "sent_bytes_last": per_step[-1]["sent_bytes"] if per_step else None,
        }
    return summary


def _median(values: list[Any]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _table(results: dict[str, Any]) -> str:
    def s(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f}"

    summary = results["summary"]
    sides = list(summary)
    lines = [f"{results['steps']} steps, {results['max_tokens']} tokens per answer, model {results['model']}, "
             f"{results['rounds']} round(s); TTFT ms per step (median), then bytes sent per step",
             f"{'step':<5}" + "".join(f"{side:>24}" for side in sides)]
    for index in range(min(len(summary[side]["steps"]) for side in sides)):
        cells = []
        for side in sides:
            step = summary[side]["steps"][index]
            cached = step["cached_tokens"]
            cells.append(f"{s(step['ttft'])} ms {step['sent_bytes']:.0f} B"
                         + (f" {cached:.0f}/{step['prompt_tokens']:.0f}" if cached is not None else ""))
        lines.append(f"{index + 1:<5}" + "".join(f"{cell:>24}" for cell in cells))
    lines.append(f"{'mean TTFT after step 1':<24}" + "".join(
        f"{s(summary[side]['ttft_later_mean']):>20} ms" for side in sides))
    lines.append(f"{'bytes sent in all':<24}" + "".join(f"{summary[side]['sent_bytes_total']:>21.0f} B"
                                                         for side in sides))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--system-words", type=int, default=300)
    parser.add_argument("--observation-words", type=int, default=60)
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--parallel", type=int, default=1, help="contexts/slots of every server (default 1)")
    parser.add_argument("--threads", type=int, default=physical_cores())
    parser.add_argument("--flash-attn", type=on_off, default=True)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "responses_agent.json")
    args = parser.parse_args(argv)
    model = default_model_path()
    llama_server = find_llama_server()
    sides = [side for side in args.sides.split(",") if side]
    unknown = sorted(set(sides) - set(SIDES))
    if unknown:
        parser.error(f"unknown sides: {', '.join(unknown)}")
    if llama_server is None and "llama-server-responses" in sides:
        print(f"llama-server-responses: skipped: no llama-server binary (set $LLAMA_SERVER or build it into "
              f"{DEFAULT_LLAMA_SERVER}; see benchmarks/serve.py)", file=sys.stderr)
        sides.remove("llama-server-responses")
    settings = Settings(args.n_ctx, args.parallel, args.threads, args.flash_attn)
    workload = Workload.make(args.steps, args.system_words, args.observation_words, args.max_tokens)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    results: dict[str, Any] = {
        "model": model.name, "steps": args.steps, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "system_words": args.system_words, "observation_words": args.observation_words,
        "servers_settings": {"n_ctx": settings.n_ctx, "parallel": settings.parallel, "threads": settings.threads,
                             "n_batch": settings.n_batch, "flash_attn": settings.flash_attn},
        "machine": machine(), "llama_server_version": llama_server_version(llama_server),
        "sides": {side: LABELS[side] for side in sides}, "commands": {}, "runs": {}}
    for round_number in range(args.rounds):
        for side in rotation(sides, round_number):
            command = server_command(SERVER_OF[side], model, settings, free_port(), llama_server)
            assert command is not None
            port = int(command[command.index("--port") + 1])
            results["commands"][side] = command
            log = args.out.parent / f"responses_agent-{side}.log"
            args.out.parent.mkdir(parents=True, exist_ok=True)
            print(f"round {round_number + 1}/{args.rounds}: {side}...", file=sys.stderr, flush=True)
            load = os.getloadavg()[0]
            with running_server(command, port, env, log) as url:  # a fresh server: no run starts with another's cache
                steps = run_side(side, url, workload)
            results["runs"].setdefault(side, []).append({
                "round": round_number, "load_average": [round(load, 2), round(os.getloadavg()[0], 2)],
                "steps": [{"ttft": round(s.ttft, 4), "total": round(s.total, 4), "sent_bytes": s.sent_bytes,
                           "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens} for s in steps]})
            write(args.out, results)
    results["summary"] = _summary(results["runs"])
    finish(results)
    write(args.out, results)
    print(_table(results))
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
