"""What write-through to Redis costs a streamed answer: how much later its last chunk arrives.

``llama-cache serve --redis URL`` makes the state ending a completion findable on every instance before
the stream's last chunk goes out, so a conversation's next turn finds it wherever it lands (see
docs/serving.md): the state is announced to Redis (one round trip) and stored behind the chunk, a lookup
elsewhere waiting for it meanwhile (docs/redis.md). This runs one server in this process against a real
redis-server and answers the turns of conversations on a long system document with write-through on and
off (each turn answered once, then asked again in both modes in alternating order), and reports how long the last chunk took after the one before it, and the
whole answer. Targets (issue #28): the last chunk at most 10 ms later than with write-through off, the
whole answer at most 1.05x. (Turn 2 on another instance is ``benchmarks/scale.py``'s.)

    python benchmarks/write_through.py [--turns 21] [--document-words 900]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.machine import machine  # noqa: E402
from benchmarks.sse import read_stream  # noqa: E402
from llama_cache.server import ServerConfig  # noqa: E402
from llama_cache.testing.redis_server import RedisServer  # noqa: E402
from tests.live_server import LiveServer  # noqa: E402

LAST_CHUNK_TARGET_MS = 10.0  # on - off, median
ANSWER_TARGET = 1.05  # on / off, median whole answer


def _stream(url: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[str, float, float]:
    """(answer, seconds from the chunk before the last to the last, seconds for the whole answer)."""
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=600, json={
            "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}) as response:
        stream = read_stream(response.iter_lines())
    arrivals = stream.chunk_times
    return stream.text, arrivals[-1] - arrivals[-2], arrivals[-1] - stream.started


def _at(measures: dict[str, list[float]], name: str, position: int) -> float:
    """The median of ``name`` over the asks made at ``position`` in their turn (0: first, 1: second)."""
    return statistics.median(value for value, at in zip(measures[name], measures["position"]) if at == position)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=21, help="turns of the conversation (each asked in both modes)")
    parser.add_argument("--document-words", type=int, default=900)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "write_through.json")
    args = parser.parse_args(argv)
    rng = random.Random(7)
    words = "river port barge lock canal harbour bridge quay tide delta".split()
    results: dict[str, dict[str, list[float]]] = {
        mode: {"last_chunk": [], "answer": [], "position": []} for mode in ("on", "off")}
    same_answers = 0
    with RedisServer() as redis:
        live = LiveServer(ServerConfig(n_ctx=4096, parallel=1, redis_url=redis.url))
        try:
            cache = live.service.cache
            document = " ".join(rng.choice(words) for _ in range(args.document_words))
            messages = [{"role": "system", "content": document}]
            for turn in range(args.turns):
                messages.append({"role": "user", "content": f"Question {turn}: name a {rng.choice(words)}."})
                # The turn is answered once unmeasured (its new prompt tokens evaluated, its new state made
                # and stored), then asked again in both modes, in alternating order: the two measured answers
                # are the same greedy answer on the same cached prompt, so their last chunks differ by what
                # write-through adds and by nothing else (a new state's first read is much slower).
                cache.write_through = turn % 2 == 0
                first, _, _ = _stream(live.url, messages, args.max_tokens)
                answers = {}
                for position, mode in enumerate(("on", "off") if turn % 2 == 0 else ("off", "on")):
                    cache.write_through = mode == "on"  # the engine reads it for each request
                    answers[mode], last, whole = _stream(live.url, messages, args.max_tokens)
                    results[mode]["last_chunk"].append(last)
                    results[mode]["answer"].append(whole)
                    results[mode]["position"].append(position)
                same_answers += answers["on"] == answers["off"] == first
                messages.append({"role": "assistant", "content": first})
        finally:
            live.stop()
    summary = {mode: {name: {"median": statistics.median(values), "min": min(values), "max": max(values)}
                      for name, values in measures.items() if name != "position"} for mode, measures in results.items()}
    # The second ask of a turn is sometimes much slower than the first in either mode (the state read
    # meeting fresh memory): modes are compared at the same position, and the positions averaged.
    extra = statistics.mean(_at(results["on"], "last_chunk", p) - _at(results["off"], "last_chunk", p) for p in (0, 1))
    print(f"{'write-through':<14} {'last chunk (ms, median, min-max)':<36} {'whole answer (ms)':<24}")
    for mode in ("on", "off"):
        last, whole = summary[mode]["last_chunk"], summary[mode]["answer"]
        print(f"{mode:<14} {last['median'] * 1e3:7.1f} ({last['min'] * 1e3:.1f}-{last['max'] * 1e3:.1f})"
              f"{'':<14} {whole['median'] * 1e3:8.1f} ({whole['min'] * 1e3:.0f}-{whole['max'] * 1e3:.0f})")
    print(f"cost of write-through per answer (median last-chunk delay, on - off, at the same position in a turn): {extra * 1e3:.1f} ms; "
          f"the same answer in both modes on {same_answers} of {args.turns} turns")
    ratio = statistics.mean(_at(results["on"], "answer", p) / _at(results["off"], "answer", p) for p in (0, 1))
    verdicts = [
        {"target": "last chunk <= 10 ms later with write-through on", "value": extra * 1e3, "unit": "ms",
         "met": extra * 1e3 <= LAST_CHUNK_TARGET_MS},
        {"target": "whole answer <= 1.05x write-through off", "value": ratio, "unit": "x", "met": ratio <= ANSWER_TARGET},
    ]
    for verdict in verdicts:
        print(f"  target: {verdict['target']}: {verdict['value']:.2f} {verdict['unit']} "
              f"({'met' if verdict['met'] else 'NOT MET'})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine(), "settings": vars(args) | {"out": str(args.out)},
                                    "raw": results, "summary": summary, "cost_ms": extra * 1e3,
                                    "answer_ratio": ratio, "same_answers": same_answers,
                                    "verdicts": verdicts}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
