"""Noisy neighbours on loopback: normal requests' latency while attackers send the worst requests the limits accept.

Normal requests: ``--clients`` clients (default 2), each sending ``--requests`` short streamed chat
completions one after another (default 12): a short question, ``--max-tokens`` tokens (default 8),
temperature 0. The client measures time to first token (to the first non-empty content delta) and
total time (to ``[DONE]``). Each server is measured in two phases, on one fresh server process:

- quiet: the normal clients alone (after one warm-up request);
- attack: ``--attackers`` clients (default 4) in a loop sending the worst requests the server's limits
  still accept, started ``--attack-warmup`` seconds (default 3) before the normal clients; the phase
  ends when the normal clients are done or after ``--attack-timeout`` seconds (default 60), whichever
  comes first, and the requests in flight are then cut (the client closes the connection). A normal
  request cut so is counted at its time so far, a lower bound (marked ``>`` in the table).

The attackers' requests are built by :func:`worst_requests` from :class:`Limits` (one place to adjust
them), different text in every request so that no prompt cache helps. Each attacker goes through the
kinds in turn, attacker ``i`` starting at kind ``i``:

- ``long_prompt``: one message of varied words, about ``--fill`` (90%) of the context in tokens, with
  ``max_tokens`` the rest of the context and the end-of-generation tokens banned (``logit_bias``), so
  the answer runs to its limit;
- ``many_messages``: up to 1000 short messages (fewer when their template does not fit ``--fill`` of
  the context), ``max_tokens`` the rest, end tokens banned;
- ``json_object``: ``response_format`` ``json_object``, ``max_tokens`` 64;
- ``json_schema``: ``response_format`` ``json_schema`` with a schema just inside the limits (an enum of
  ~4000 values, ``maxLength``/``minItems``/``pattern {1,n}`` bounds of ~4000, nested to the depth limit,
  under 64 KiB), ``max_tokens`` 64;
- ``tool_schema``: the same schema as a tool's parameters, the tool named in ``tool_choice`` (llama-server
  takes ``tool_choice`` as a string only: it logs the object as of the wrong type and uses ``auto``);
- ``disconnect``: a ``long_prompt`` request whose client closes the connection once it is sent.

A third phase, flood: ``--flood-attackers`` clients (default 16; 0 skips the phase) in a loop sending
the costliest utility requests the bounds accept, in turn (:func:`flood_requests`): ``tokenize``, a text
as long as a prompt's text may be with a special token every few bytes (llama.cpp's tokenizer copies
the rest of the text at each), and ``detokenize``, a context's worth of token ids.

Every server gets the same requests; their status codes are counted per kind and server (a server that
refuses one kind is recorded as such, not skipped). Servers: ``llama-cache serve`` and llama.cpp's
``llama-server`` (found as ``benchmarks/serve.py`` says; skipped with a message when absent), with the
settings of ``benchmarks/serve.py`` (same context per request, slots, threads, batch, flash attention:
by default ``llama-cache serve``'s auto, on).
The order of the servers rotates from round to round; each round starts every server afresh.

Targets, as ratios of the medians over rounds of each phase's p95 (time to first token and total):
ours under attack over ours quiet at most 2x; ours under attack over llama-server under attack at most
1x; ours under the flood over ours quiet at most 2x. Prints a table and writes ``benchmarks/results/serve_noisy.json`` (machine, versions, settings of
every side, the requests' measured sizes, every round's numbers, the verdicts)::

    tools/run python benchmarks/serve.py --scenario noisy [--rounds 3] [--servers llama-cache,llama-server]
    tools/run python benchmarks/serve_noisy.py --rounds 1 --requests 3 --attack-timeout 30   # a quick check
    tools/run python benchmarks/serve_noisy.py --kinds long_prompt,many_messages,disconnect   # some kinds only
    tools/run python benchmarks/serve_noisy.py --with-api-key   # both servers with --api-key
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import itertools
import json
import math
import os
import random
import re
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.machine import machine
from benchmarks.servers import (
    DEFAULT_LLAMA_SERVER,
    REPO,
    Settings,
    WORDS,
    filler_text,
    find_llama_server,
    free_port,
    llama_server_version,
    percentile,
    running_server,
    serve_takes_api_key,
    server_command,
)
from benchmarks.sse import Stream
from llama_cache import default_model_path
from llama_cache.detokenizer import Detokenizer
from llama_cache.engine.context import flash_attention_for
from llama_cache.native_log import route_llama_cpp_logs
from llama_cache.server.config import DEFAULT_MAX_BODY_BYTES, on_off, physical_cores

SERVERS = ("llama-cache", "llama-server")
QUESTIONS = [
    "What is the capital of France?",
    "Name a colour of the sky.",
    "How many legs does a cat have?",
    "What do bees make?",
    "Which season comes after winter?",
    "What is two plus two?",
    "Name a fruit that is yellow.",
    "What is frozen water called?",
]
KINDS = ("long_prompt", "many_messages", "json_object", "json_schema", "tool_schema", "disconnect")
# The flood phase's kinds, and the endpoint of each (the attack phase's kinds post chat completions).
FLOOD_KINDS = ("tokenize", "detokenize")
UTILITY_PATHS = {"tokenize": "/tokenize", "detokenize": "/detokenize"}
ATTACK_MAX_TOKENS = 64  # the constrained kinds' answers
QUIET_VS_ATTACK_TARGET = 2.0
FLOOD_VS_QUIET_TARGET = 2.0
VS_LLAMA_SERVER_TARGET = 1.0
# Under attack, a share of failed normal requests above this fails the targets whatever the latencies.
FAILED_SHARE = 0.05
NOT_SENT = "not sent before the phase's end"  # not failures: the phase's time ran out


@dataclass(frozen=True)
class Limits:
    """The server's request limits that shape the worst accepted requests.

    ``max_text_bytes_per_token`` times the context size bounds a chat request's total text (set from
    the model: its longest token's length in bytes).
    """

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_messages: int = 1024
    max_schema_bytes: int = 64 << 10
    max_schema_depth: int = 32
    max_enum_values: int = 4096
    max_repetition: int = 100_000  # maxLength, minItems, a pattern's {n,m}...
    max_text_bytes_per_token: int = 0

    @classmethod
    def of_server(cls, max_token_bytes: int) -> Limits:
        """The limits of this checkout's server (``llama_cache.server.limits.RequestLimits``' defaults)."""
        from llama_cache.server.limits import RequestLimits

        server = RequestLimits()
        values = {f.name: getattr(server, f.name, f.default) for f in dataclasses.fields(cls)}
        values["max_text_bytes_per_token"] = max_token_bytes
        return cls(**values)


def _near(limit: int) -> int:
    """A value just inside ``limit`` (4000 for 4096): accepted whether the bound is inclusive or not."""
    return limit * 125 // 128


def _depth(node: Any) -> int:
    """JSON nesting depth: objects and arrays count one level each (a scalar: 0)."""
    if isinstance(node, dict):
        return 1 + max((_depth(v) for v in node.values()), default=0)
    if isinstance(node, list):
        return 1 + max((_depth(v) for v in node), default=0)
    return 0


def big_schema(limits: Limits) -> dict[str, Any]:
    """A JSON schema just inside every schema limit: a huge enum, long repetitions, deep nesting."""
    bound = _near(limits.max_repetition)
    leaf: dict[str, Any] = {
        "type": "object",
        "properties": {
            "choice": {"enum": [f"option-{i:04d}" for i in range(_near(limits.max_enum_values))]},
            "text": {"type": "string", "minLength": 1, "maxLength": bound},
            "code": {"type": "string", "pattern": f"^[a-z]{{1,{bound}}}$"},
            "items": {"type": "array", "items": {"type": "integer"}, "minItems": bound},
        },
        "required": ["choice", "text", "code", "items"],
    }
    schema = leaf
    while _depth(wrapped := {"type": "object", "properties": {"next": schema}, "required": ["next"]}) \
            <= limits.max_schema_depth - 2:
        schema = wrapped
    return schema


def check_accepted(body: dict[str, Any], limits: Limits, prompt_tokens: int, n_ctx: int) -> None:
    """Raise ValueError when ``body`` breaks one of ``limits`` (every attack is checked once before use)."""
    size = len(json.dumps(body).encode())
    text = sum(len(str(m.get("content") or "").encode()) for m in body["messages"])
    schemas = [t["function"]["parameters"] for t in body.get("tools", [])]
    if body.get("response_format", {}).get("type") == "json_schema":
        schemas.append(body["response_format"]["json_schema"]["schema"])
    problems = [
        size > limits.max_body_bytes and f"body {size} bytes",
        len(body["messages"]) > limits.max_messages and f"{len(body['messages'])} messages",
        text > n_ctx * limits.max_text_bytes_per_token and f"text {text} bytes",
        prompt_tokens >= n_ctx and f"prompt {prompt_tokens} tokens",
        prompt_tokens + body["max_tokens"] > n_ctx and f"prompt and answer {prompt_tokens + body['max_tokens']} tokens",
    ]
    for schema in schemas:
        encoded = json.dumps(schema)
        bounds = [int(n) for n in re.findall(r'"(?:maxLength|minLength|minItems|maxItems)": (\d+)', encoded)]
        bounds += [int(n) for pair in re.findall(r"\{(\d+),(\d*)\}", encoded) for n in pair if n]
        enums = [len(v) for v in re.findall(r'"enum": \[([^\]]*)\]', encoded) for v in [v.split(",")]]
        problems += [
            len(encoded.encode()) > limits.max_schema_bytes and f"schema {len(encoded)} bytes",
            _depth(schema) > limits.max_schema_depth and f"schema depth {_depth(schema)}",
            max(enums, default=0) > limits.max_enum_values and f"enum of {max(enums)}",
            max(bounds, default=0) > limits.max_repetition and f"repetition {max(bounds)}",
        ]
    if any(problems):
        raise ValueError("the attack breaks a limit: " + ", ".join(p for p in problems if p))


@dataclass
class Attacks:
    """Per kind, a maker of fresh request bodies; ``sizes``: what a sample of each kind measured."""

    make: dict[str, Callable[[random.Random], dict[str, Any]]]
    sizes: dict[str, dict[str, Any]]


def worst_requests(limits: Limits, n_ctx: int, probe: Any, fill: float, messages: int = 1000) -> Attacks:
    """The worst requests ``limits`` still accept, per kind (see this module's docstring).

    Args:
        limits: the server's limits.
        n_ctx: tokens per request (prompt and answer).
        probe: a vocabulary-only ``llama_cpp.Llama`` of the served model, to count prompt tokens.
        fill: the share of the context the long prompts take.
        messages: the most short messages in a ``many_messages`` request (fewer when they do not fit).
    """
    from llama_cache.server.prompts import prompt_tokens_for_chat

    def tokens(body: dict[str, Any]) -> int:
        return len(prompt_tokens_for_chat(probe, body["messages"], tools=body.get("tools")))

    target = int(fill * n_ctx)
    margin = max(16, n_ctx // 50)  # tokenizations of different random texts differ by a little
    end_tokens = {probe.token_eos(), *probe.tokenize(b"<|im_end|>", add_bos=False, special=True)}
    no_end = {str(t): -100 for t in end_tokens if t >= 0}
    ask = "\n\nRepeat the text above, word for word."
    sample = {"messages": [{"role": "user", "content": filler_text(random.Random(1), 1000) + ask}]}
    bare = {"messages": [{"role": "user", "content": ask}]}
    per_word = (tokens(sample) - tokens(bare)) / 1000
    words = int((target - tokens(bare)) / per_word)

    def long_prompt(rng: random.Random) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": filler_text(rng, words) + ask}],
                "max_tokens": n_ctx - target - margin, "logit_bias": no_end, "temperature": 0}

    def chat(count: int, rng: random.Random) -> list[dict[str, str]]:
        return [{"role": "user" if i % 2 == 0 or i == count - 1 else "assistant",
                 "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))} for i in range(count)]

    one, eleven = (tokens({"messages": chat(n, random.Random(2))}) for n in (1, 11))
    count = min(messages, limits.max_messages, 1 + int((target - one) / ((eleven - one) / 10)))

    def many_messages(rng: random.Random) -> dict[str, Any]:
        return {"messages": chat(count, rng), "max_tokens": n_ctx - target - margin, "logit_bias": no_end,
                "temperature": 0}

    schema = big_schema(limits)
    tool = {"type": "function", "function": {"name": "record", "description": "Record an entry.",
                                             "parameters": schema}}

    def question(rng: random.Random, what: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{what} about {' '.join(rng.choice(WORDS) for _ in range(6))}."}]

    def json_object(rng: random.Random) -> dict[str, Any]:
        return {"messages": question(rng, "Answer in JSON"), "response_format": {"type": "json_object"},
                "max_tokens": ATTACK_MAX_TOKENS, "temperature": 0}

    def json_schema(rng: random.Random) -> dict[str, Any]:
        return {"messages": question(rng, "Answer in JSON"), "max_tokens": ATTACK_MAX_TOKENS, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "record", "schema": schema}}}

    def tool_schema(rng: random.Random) -> dict[str, Any]:
        return {"messages": question(rng, "Record an entry"), "tools": [tool], "max_tokens": ATTACK_MAX_TOKENS,
                "tool_choice": {"type": "function", "function": {"name": "record"}}, "temperature": 0}

    make = {"long_prompt": long_prompt, "many_messages": many_messages, "json_object": json_object,
            "json_schema": json_schema, "tool_schema": tool_schema, "disconnect": long_prompt}
    sizes: dict[str, dict[str, Any]] = {}
    for kind, maker in make.items():
        body = maker(random.Random(3))
        prompt = tokens(body)
        check_accepted(body, limits, prompt, n_ctx)
        sizes[kind] = {"prompt_tokens": prompt, "max_tokens": body["max_tokens"], "messages": len(body["messages"]),
                       "body_bytes": len(json.dumps(body).encode())}
    sizes["json_schema"]["schema_bytes"] = len(json.dumps(schema).encode())
    sizes["json_schema"]["schema_depth"] = _depth(schema)
    return Attacks(make, sizes)


def flood_requests(limits: Limits, n_ctx: int, probe: Any) -> Attacks:
    """The costliest ``/tokenize`` and ``/detokenize`` bodies the server's bounds accept.

    ``tokenize``: a text as long as the bound on a prompt's text allows (``n_ctx`` times the longest
    token's bytes, less a margin), holding ``n_ctx - 2`` special tokens spread through it (llama.cpp's
    tokenizer copies the rest of the text at each one); ``detokenize``: ``n_ctx`` random token ids.
    """
    budget = int(limits.max_text_bytes_per_token * n_ctx * 0.95)
    special = "<|im_end|>"
    count = n_ctx - 2
    gap = max(1, (budget - count * len(special)) // (count + 1))

    def tokenize(rng: random.Random) -> dict[str, Any]:
        filler = filler_text(rng, budget // 4)[: gap * (count + 1)]
        parts = [filler[i * gap : (i + 1) * gap] for i in range(count + 1)]
        return {"content": special.join(parts)}

    def detokenize(rng: random.Random) -> dict[str, Any]:
        return {"tokens": [rng.randrange(probe.n_vocab()) for _ in range(n_ctx)]}

    make = {"tokenize": tokenize, "detokenize": detokenize}
    sample = tokenize(random.Random(3))
    sizes = {"tokenize": {"body_bytes": len(json.dumps(sample).encode()), "special_tokens": count,
                          "tokens": len(probe.tokenize(sample["content"].encode(), add_bos=False, special=True))},
             "detokenize": {"tokens": n_ctx}}
    return Attacks(make, sizes)


# -- clients -------------------------------------------------------------------------------------------


@dataclass
class Phase:
    """One phase's normal requests and, under attack, the attackers' statuses per kind.

    A normal request still running at the phase's end is measured at its time so far, a lower bound:
    ``cut_ttft`` and ``cut_total`` count those values in ``ttft`` and ``total``.
    """

    ttft: list[float] = dataclasses.field(default_factory=list)
    total: list[float] = dataclasses.field(default_factory=list)
    cut_ttft: int = 0
    cut_total: int = 0
    failed: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    attacks: dict[str, collections.Counter[str]] = dataclasses.field(default_factory=dict)


async def _normal(client: httpx.AsyncClient, url: str, rng: random.Random, requests: int, max_tokens: int,
                  phase: Phase) -> None:
    for _ in range(requests):
        body = {"model": "default", "messages": [{"role": "user", "content": rng.choice(QUESTIONS)}],
                "max_tokens": max_tokens, "temperature": 0, "stream": True}
        stream = Stream()
        start = stream.started
        try:
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    phase.failed[str(response.status_code)] += 1
                    continue
                async for line in response.aiter_lines():
                    if not stream.feed(line):
                        break
        except asyncio.CancelledError:  # the phase is over: this request's time so far is a lower bound
            now = time.perf_counter() - start
            first = stream.first_content
            phase.ttft.append(now if first is None else first)
            phase.cut_ttft += first is None
            phase.total.append(now)
            phase.cut_total += 1
            raise
        except httpx.HTTPError as error:
            phase.failed[type(error).__name__] += 1
            continue
        end = time.perf_counter() - start
        if not stream.done:
            phase.failed["no [DONE]"] += 1
            continue
        first = stream.first_content
        phase.ttft.append(end if first is None else first)
        phase.total.append(end)


async def _send_and_leave(url: str, body: bytes, headers: dict[str, str]) -> None:
    """POST ``body`` on a raw connection and close it at once, without reading the answer."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n{head}Connection: close\r\n\r\n".encode() + body)
    await writer.drain()
    writer.close()
    await writer.wait_closed()


async def _attacker(index: int, url: str, headers: dict[str, str], attacks: Attacks, kinds: list[str], seed: int,
                    phase: Phase) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(headers=headers, timeout=None) as client:
        for number in itertools.count():
            kind = kinds[(index + number) % len(kinds)]
            counts = phase.attacks.setdefault(kind, collections.Counter())
            body = attacks.make[kind](rng)
            path = UTILITY_PATHS.get(kind, "/v1/chat/completions")
            if path == "/v1/chat/completions":
                body["model"] = "default"
            try:
                if kind == "disconnect":
                    await _send_and_leave(url, json.dumps(body).encode(), headers)
                    counts["left"] += 1
                    continue
                response = await client.post(url + path, json=body)
                counts[str(response.status_code)] += 1
            except asyncio.CancelledError:
                counts["cut at the phase's end"] += 1
                raise
            except (httpx.HTTPError, OSError) as error:
                counts[type(error).__name__] += 1


async def warm_up(url: str, headers: dict[str, str], max_tokens: int) -> None:
    """One normal request, not measured: a fresh server's first request pays for its start."""
    async with httpx.AsyncClient(headers=headers, timeout=120) as client:
        await _normal(client, url, random.Random(0), 1, max_tokens, Phase())


async def run_phase(url: str, headers: dict[str, str], args: argparse.Namespace, attacks: Attacks | None,
                    seed: int, kinds: list[str] | None = None, count: int = 0) -> tuple[Phase, float]:
    """The normal clients' requests, alone or beside ``count`` attackers sending ``kinds`` in turn;
    returns the phase and its seconds."""
    phase = Phase()
    attackers = [asyncio.ensure_future(_attacker(i, url, headers, attacks, kinds or [], seed * 100 + i, phase))
                 for i in range(count)] if attacks else []
    start = time.perf_counter()
    try:
        if attackers:
            await asyncio.sleep(args.attack_warmup)
        async with httpx.AsyncClient(headers=headers, timeout=args.attack_timeout) as client:
            normals = [_normal(client, url, random.Random(seed * 10 + i), args.requests, args.max_tokens, phase)
                       for i in range(args.clients)]
            try:
                await asyncio.wait_for(asyncio.gather(*normals), timeout=args.attack_timeout)
            except asyncio.TimeoutError:
                pass
    finally:
        for task in attackers:
            task.cancel()
        await asyncio.gather(*attackers, return_exceptions=True)
    missing = args.clients * args.requests - len(phase.total) - sum(phase.failed.values())
    if missing:
        phase.failed[NOT_SENT] += missing
    return phase, time.perf_counter() - start


def _alive(url: str, headers: dict[str, str]) -> bool:
    """Whether the server still answers (``/health``, any status, within 10 seconds)."""
    try:
        httpx.get(url + "/health", headers=headers, timeout=10)
    except httpx.TransportError:
        return False
    return True


# -- the run ---------------------------------------------------------------------------------------------


def _stats(values: list[float], cut: int) -> dict[str, Any]:
    """p50 and p95, each flagged a lower bound when it may rest on one of the ``cut`` lower-bound values."""
    values = sorted(values)
    stats: dict[str, Any] = {}
    for q in (50, 95):
        stats[f"p{q}"] = percentile(values, q)
        # The cut values sit among the largest: a percentile reaching into the top ``cut`` is a lower bound.
        stats[f"p{q}_lower_bound"] = bool(cut) and math.ceil((len(values) - 1) * q / 100) >= len(values) - cut
    return stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=2, help="normal clients")
    parser.add_argument("--requests", type=int, default=12, help="normal requests per client and phase")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per normal answer")
    parser.add_argument("--attackers", type=int, default=4)
    parser.add_argument("--kinds", type=lambda text: [k for k in text.split(",") if k], default=list(KINDS),
                        help=f"the attackers' kinds of request, in turn (default: all, {','.join(KINDS)})")
    parser.add_argument("--flood-attackers", type=int, default=16,
                        help="clients flooding /tokenize and /detokenize in the flood phase (0: no flood phase)")
    parser.add_argument("--attack-warmup", type=float, default=3.0, help="seconds of attack before measuring")
    parser.add_argument("--attack-timeout", type=float, default=60.0, help="the longest a phase may last")
    parser.add_argument("--fill", type=float, default=0.9, help="share of the context the long prompts take")
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--parallel", type=int, default=None,
                        help="contexts/slots of every server (default: attackers + clients, a slot each: the "
                        "attack's compute is measured, not a wait for a free slot)")
    parser.add_argument("--threads", type=int, default=physical_cores())
    parser.add_argument("--flash-attn", type=on_off, default=flash_attention_for(None, False),
                        help="on or off, for every server (default: llama-cache serve's auto, on)")
    parser.add_argument("--with-api-key", action="store_true", help="both servers with --api-key; every request "
                        "(the attackers' too) carries it")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "serve_noisy.json")
    args = parser.parse_args(argv)
    if not args.kinds or set(args.kinds) - set(KINDS):
        parser.error(f"--kinds: choose among {','.join(KINDS)}")
    import llama_cpp

    model = default_model_path()
    route_llama_cpp_logs()  # llama-cpp-python would print llama.cpp's warnings despite verbose=False
    probe = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
    pieces = Detokenizer.for_llama(probe)  # every piece whole: the server's bound counts the longest
    max_token_bytes = max(len(pieces.piece(t, special=True)) for t in range(probe.n_vocab()))
    limits = Limits.of_server(max_token_bytes)
    attacks = worst_requests(limits, args.n_ctx, probe, args.fill)
    flood = flood_requests(limits, args.n_ctx, probe)
    del probe
    env = dict(os.environ, PYTHONPATH=str(REPO))
    llama_server = find_llama_server()
    names = [name for name in args.servers.split(",") if name]
    if llama_server is None and "llama-server" in names:
        print(f"llama-server: skipped: no llama-server binary (set $LLAMA_SERVER or build it into "
              f"{DEFAULT_LLAMA_SERVER}; see benchmarks/serve.py's docstring)", file=sys.stderr)
        names.remove("llama-server")
    api_key = secrets.token_urlsafe(24) if args.with_api_key else None
    if api_key and "llama-cache" in names and not serve_takes_api_key(env):
        print("--with-api-key: this checkout's llama-cache serve has no --api-key", file=sys.stderr)
        return 2
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    parallel = args.parallel if args.parallel is not None else args.attackers + args.clients
    settings = Settings(args.n_ctx, parallel, args.threads, args.flash_attn)
    results: dict[str, Any] = {
        "scenario": "noisy", "model": model.name, "machine": machine(),
        "llama_server_version": llama_server_version(llama_server),
        "servers_settings": dataclasses.asdict(settings) | {"api_key": bool(api_key)},
        "normal": {"clients": args.clients, "requests_per_phase": args.clients * args.requests,
                   "max_tokens": args.max_tokens, "stream": True, "temperature": 0},
        "attack": {"attackers": args.attackers, "kinds": args.kinds, "warmup_s": args.attack_warmup,
                   "phase_timeout_s": args.attack_timeout, "fill": args.fill,
                   "limits": dataclasses.asdict(limits), "sizes": attacks.sizes},
        "flood": {"attackers": args.flood_attackers, "kinds": list(FLOOD_KINDS), "sizes": flood.sizes},
        "rounds": args.rounds, "commands": {}, "runs": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for round_number in range(args.rounds):
        shift = round_number % len(names)
        for name in names[shift:] + names[:shift]:  # a different server first in every round
            command = server_command(name, model, settings, free_port(), llama_server)
            assert command is not None
            command += ["--api-key", api_key] if api_key else []
            port = int(command[command.index("--port") + 1])
            results["commands"][name] = [c if c != api_key else "KEY" for c in command]
            log = args.out.parent / f"serve-noisy-{name}.log"
            run: dict[str, Any] = {"round": round_number, "server": name}
            with running_server(command, port, env, log, headers) as url:
                for phase_name in ("quiet", "attack", "flood") if args.flood_attackers else ("quiet", "attack"):
                    print(f"round {round_number + 1}/{args.rounds}: {name}, {phase_name}...", file=sys.stderr,
                          flush=True)
                    load = os.getloadavg()[0]
                    if phase_name == "quiet":
                        asyncio.run(warm_up(url, headers, args.max_tokens))
                    sent, kinds, count = {"quiet": (None, None, 0), "attack": (attacks, args.kinds, args.attackers),
                                          "flood": (flood, list(FLOOD_KINDS), args.flood_attackers)}[phase_name]
                    phase, seconds = asyncio.run(run_phase(url, headers, args, sent, round_number + 1, kinds, count))
                    run[phase_name] = {"ttft": _stats(phase.ttft, phase.cut_ttft),
                                       "total": _stats(phase.total, phase.cut_total),
                                       "measured": len(phase.total), "cut": phase.cut_total,
                                       "failed": dict(phase.failed),
                                       "attacks": {k: dict(v) for k, v in phase.attacks.items()},
                                       "seconds": round(seconds, 2),
                                       "load_average": [round(load, 2), round(os.getloadavg()[0], 2)],
                                       "each": {"ttft": [round(x, 4) for x in phase.ttft],
                                                "total": [round(x, 4) for x in phase.total]},
                                       "server_alive_after": _alive(url, headers)}
            results["runs"].append(run)
            args.out.write_text(json.dumps(results, indent=2) + "\n")  # what is done so far, if a later run fails
    results["summary"] = _summary(results["runs"])
    results["targets"] = _targets(results["summary"])
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(_table(results))
    print(f"\nwritten to {args.out}")
    return 0


def _summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per server and phase: each percentile's median and spread (min, max) over the rounds, the
    normal requests that failed and the attackers' statuses per kind, summed over the rounds."""
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for name in dict.fromkeys(run["server"] for run in runs):
        for phase in ("quiet", "attack", "flood"):
            rows = [run[phase] for run in runs if run["server"] == name and phase in run]
            if not rows:
                continue
            row: dict[str, Any] = {"rounds": len(rows), "measured": sum(r["measured"] for r in rows),
                                   "cut": sum(r["cut"] for r in rows)}
            for measure in ("ttft", "total"):
                for q in ("p50", "p95"):
                    values = [r[measure][q] for r in rows if r[measure][q] is not None]
                    row[f"{measure}_{q}"] = statistics.median(values) if values else None
                    row[f"{measure}_{q}_spread"] = [min(values), max(values)] if values else None
                    row[f"{measure}_{q}_lower_bound"] = any(r[measure][f"{q}_lower_bound"] for r in rows)
            row["failed"] = dict(sum((collections.Counter(r["failed"]) for r in rows), collections.Counter()))
            attacks: dict[str, collections.Counter[str]] = {}
            for r in rows:
                for kind, counts in r["attacks"].items():
                    attacks.setdefault(kind, collections.Counter()).update(counts)
            row["attacks"] = {kind: dict(attacks[kind]) for kind in KINDS + FLOOD_KINDS if kind in attacks}
            row["load_average"] = [min(r["load_average"][0] for r in rows), max(r["load_average"][1] for r in rows)]
            row["server_died"] = sum(1 for r in rows if not r["server_alive_after"])
            failed = sum(v for k, v in row["failed"].items() if k != NOT_SENT)
            row["failed_share"] = failed / (failed + row["measured"]) if failed else 0.0
            summary.setdefault(name, {})[phase] = row
    return summary


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if not numerator or not denominator else numerator / denominator


def _state(row: dict[str, Any] | None, key: str) -> str:
    """How a phase's percentile ``key`` stands: ``failed`` (the server died, or more than 5% of the normal
    requests failed: its p95 is a failure), ``lower`` (a lower bound), ``exact``, or ``none``."""
    if row is None or row[key] is None and not row["server_died"]:
        return "none"
    if row["server_died"] or row["failed_share"] > FAILED_SHARE:
        return "failed"
    return "lower" if row[f"{key}_lower_bound"] else "exact"


def _verdict(ratio: float | None, top: str, bottom: str, target: float) -> str:
    """met, missed or not measured. A failed numerator misses, a failed denominator is met by a numerator
    that is known; a lower-bound numerator makes the ratio a lower bound (it can only miss), a
    lower-bound denominator makes it an upper bound (it can only be met)."""
    if "none" in (top, bottom) or top == bottom == "failed" or top == bottom == "lower":
        return "not measured"
    if top == "failed":
        return "missed"
    if bottom == "failed":
        return "met" if top == "exact" else "not measured"
    assert ratio is not None
    if ratio <= target:
        return "met" if top == "exact" else "not measured"
    return "missed" if bottom == "exact" else "not measured"


def _targets(summary: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Ours under attack over ours quiet (at most 2x) and over llama-server under attack (at most 1x),
    for every percentile; the verdict is on the p95s (time to first token and total), both must be met.
    llama-server's own attack-over-quiet ratios are given for comparison."""
    ours = summary.get("llama-cache", {})
    theirs = summary.get("llama-server", {})
    sides = {"attack_vs_quiet": (ours.get("attack"), ours.get("quiet"), QUIET_VS_ATTACK_TARGET),
             "attack_vs_llama_server": (ours.get("attack"), theirs.get("attack"), VS_LLAMA_SERVER_TARGET),
             "llama_server_attack_vs_quiet": (theirs.get("attack"), theirs.get("quiet"), None),
             "flood_vs_quiet": (ours.get("flood"), ours.get("quiet"), FLOOD_VS_QUIET_TARGET),
             "llama_server_flood_vs_quiet": (theirs.get("flood"), theirs.get("quiet"), None)}
    targets: dict[str, dict[str, Any]] = {}
    for name, (top, bottom, target) in sides.items():
        keys = [f"{m}_{q}" for m in ("ttft", "total") for q in ("p50", "p95")]
        ratios = {k: _ratio(top and top[k], bottom and bottom[k]) for k in keys}
        states = {k: [_state(top, k), _state(bottom, k)] for k in keys}
        verdict = None
        if target is not None:
            each = [_verdict(ratios[k], *states[k], target) for k in ("ttft_p95", "total_p95")]
            verdict = "missed" if "missed" in each else "not measured" if "not measured" in each else "met"
        targets[name] = {"ratios": ratios, "states": states, "target": target, "verdict": verdict}
    return targets


def _table(results: dict[str, Any]) -> str:
    def s(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    def spread(row: dict[str, Any], key: str) -> str:
        low_high = row[f"{key}_spread"]
        more = ">" if row[f"{key}_lower_bound"] else ""
        return f"{more}{s(row[key])} ({s(low_high[0])}-{s(low_high[1])})" if low_high else "-"

    settings = results["servers_settings"]
    sizes = results["attack"]["sizes"]
    normal = results["normal"]
    lines = [
        f"noisy neighbours: {normal['clients']} clients x {normal['requests_per_phase'] // normal['clients']} "
        f"requests per phase, {normal['max_tokens']} tokens each, streamed; "
        f"{results['attack']['attackers']} attackers; {results['rounds']} round(s); model {results['model']}",
        f"every server: n_ctx {settings['n_ctx']} per request, {settings['parallel']} slots, {settings['threads']} "
        f"threads, batch {settings['n_batch']}, flash attention {'on' if settings['flash_attn'] else 'off'}"
        f"{', API key' if settings['api_key'] else ''}; machine {results['machine']['cpu']}, "
        f"{results['machine']['logical_cpus']} CPUs",
        "attacks: " + ", ".join(f"{k} ({v['prompt_tokens']} prompt tokens, {v['messages']} messages, "
                                f"max_tokens {v['max_tokens']})" for k, v in sizes.items()
                                if k != "disconnect" and k in results["attack"]["kinds"])
        + f", disconnect (a long_prompt); schema {sizes['json_schema']['schema_bytes']} bytes, "
          f"depth {sizes['json_schema']['schema_depth']}",
        "seconds, median over rounds (min-max); '>': a lower bound (requests still running at the phase's end, "
        "counted at their time so far, 'cut'):",
        f"{'server':<13} {'phase':<6} {'n':>4} {'cut':>3} {'TTFT p50':>22} {'TTFT p95':>22} {'total p50':>22} "
        f"{'total p95':>22}  failed",
    ]
    for name, phases in results["summary"].items():
        for phase, row in phases.items():
            failed = ", ".join(f"{k}: {v}" for k, v in row["failed"].items()) or "0"
            lines.append(f"{name:<13} {phase:<6} {row['measured']:>4} {row['cut']:>3} {spread(row, 'ttft_p50'):>22} "
                         f"{spread(row, 'ttft_p95'):>22} {spread(row, 'total_p50'):>22} "
                         f"{spread(row, 'total_p95'):>22}  {failed}")
    for name, phases in results["summary"].items():
        for phase, row in phases.items():
            if row["server_died"]:
                lines.append(f"{name}: the server stopped answering during the {phase} phase in {row['server_died']} "
                             f"of {row['rounds']} round(s)")
    lines.append("attackers' statuses per kind, summed over rounds:")
    for name, phases in results["summary"].items():
        for kind, counts in [item for phase in ("attack", "flood") if phase in phases
                             for item in phases[phase]["attacks"].items()]:
            lines.append(f"  {name:<13} {kind:<14} " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    lines.append("targets (ratios of medians, '>' a lower bound, '<' an upper bound, '~' neither, 'failed': the "
                 f"server died or more than {FAILED_SHARE:.0%} of the normal requests failed; verdict on the p95s):")
    for key, t in results["targets"].items():
        r = {k: "failed" if "failed" in t["states"][k] else "-" if v is None else
             {("lower", "lower"): "~", ("lower", "exact"): ">", ("exact", "lower"): "<"}.get(
                 tuple(t["states"][k]), "") + s(v)
             for k, v in t["ratios"].items()}
        lines.append(f"  {key:<29} TTFT p50 {r['ttft_p50']} p95 {r['ttft_p95']}, total p50 "
                     f"{r['total_p50']} p95 {r['total_p95']}"
                     + (f"; target <= {t['target']:.1f}x: {t['verdict']}" if t["target"] else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
