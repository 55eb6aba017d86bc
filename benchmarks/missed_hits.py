"""Prompt tokens evaluated where a cache should hit: ours against llama-cpp-python's own caches, one run.

Scenarios (each run with llama-cpp-python's cache and with ours, in alternating order):

- **one-token repeat**: a plain ``llama_cpp.Llama`` (default model) answers a ~400-token classification
  prompt with ``max_tokens=1``, then the same prompt again after ``reset()``;
- **recurrent divergence**: ``llama_cache.Llama`` on a tiny mamba model with a RAM cache: P, then P + A,
  then (after ``reset()``) P + B;
- **recurrent repeat**: the same model, ``ctx_checkpoints=0``: a question, a follow-up that moves the
  live context past it, then the question again.

Prints a table and writes ``benchmarks/results/missed_hits.json`` (the machine and versions under
``machine``, the counts per scenario and side under ``scenarios``).

    tools/run python benchmarks/missed_hits.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import llama_cpp
import llama_cpp.llama_cache as upstream

import llama_cache
from benchmarks.machine import finish, machine, write
from llama_cache.measure import recording_evals
from llama_cache.testing.tiny_models import write_tiny_model

DOCUMENT = (
    "The llama is a domesticated South American camelid, widely used as a meat and pack animal by Andean "
    "cultures since the pre-Columbian era. Llamas are social animals and live with others as a herd. "
)
CLASSIFY = DOCUMENT * 5 + "Is this text about animals? Answer yes or no.\nAnswer:"
HISTORY = ("Llamas carry loads across the mountains and hum to each other at night. " * 30).strip()


def _evaluated(llm: llama_cpp.Llama, prompt: str, **kwargs: Any) -> int:
    options: dict[str, Any] = {"max_tokens": 4, "temperature": 0.0, "seed": 0}
    options.update(kwargs)
    with recording_evals(llm) as recorder:
        llm.create_completion(prompt, **options)
        return recorder.prompt_tokens(llm)


def one_token_repeat(model: str, cache: Any) -> dict[str, int]:
    llm = llama_cpp.Llama(model_path=model, n_ctx=1024, seed=0, verbose=False)
    try:
        llm.set_cache(cache)
        first = _evaluated(llm, CLASSIFY, max_tokens=1)
        llm.reset()
        again = _evaluated(llm, CLASSIFY, max_tokens=1)
    finally:
        llm.close()
    return {"prompt": first, "repeat": again}


def recurrent_divergence(model: str, cache: Any) -> dict[str, int]:
    llm = llama_cache.Llama(model_path=model, n_ctx=2048, seed=0, verbose=False, ctx_checkpoints=0)
    try:
        llm.set_cache(cache)
        _evaluated(llm, HISTORY)
        _evaluated(llm, HISTORY + " First question: why?")
        llm.reset()
        prompt = HISTORY + " Another one: how?"
        evaluated = _evaluated(llm, prompt)
        total = len(llm.tokenize(prompt.encode()))
    finally:
        llm.close()
    return {"prompt": total, "evaluated": evaluated}


def recurrent_repeat(model: str, cache: Any) -> dict[str, int]:
    llm = llama_cache.Llama(model_path=model, n_ctx=2048, seed=0, verbose=False, ctx_checkpoints=0)
    question = HISTORY[:400] + " Why do they hum?"
    try:
        llm.set_cache(cache)
        _evaluated(llm, question)
        _evaluated(llm, question + " They do. And then?")
        evaluated = _evaluated(llm, question)
        total = len(llm.tokenize(question.encode()))
    finally:
        llm.close()
    return {"prompt": total, "evaluated": evaluated}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/missed_hits.json"))
    args = parser.parse_args()
    described = machine()
    model = str(llama_cache.default_model_path())
    results: dict[str, dict[str, dict[str, int]]] = {}
    with tempfile.TemporaryDirectory() as workdir:
        mamba = str(write_tiny_model("mamba", Path(workdir) / "mamba.gguf", tokenizer_from=model))
        scenarios = [
            ("one-token repeat (plain llama_cpp.Llama)", one_token_repeat, model, "repeat"),
            ("recurrent P, P+A, then P+B (RAM cache)", recurrent_divergence, mamba, "evaluated"),
            ("recurrent question asked again", recurrent_repeat, mamba, "evaluated"),
        ]
        for turn, (name, run, path, _) in enumerate(scenarios):
            makers = [
                ("llama-cpp-python", lambda: upstream.LlamaRAMCache(capacity_bytes=2 << 30)),
                ("llama-cache", lambda: llama_cache.LlamaRAMCache(capacity_bytes=2 << 30)),
            ]
            if name.startswith("one-token"):
                makers[1] = ("llama-cache", lambda: llama_cache.LlamaCache(capacity_bytes=2 << 30))
            if turn % 2:
                makers.reverse()  # alternate which side runs first
            results[name] = {side: run(path, make()) for side, make in makers}
    print("Prompt tokens evaluated where a cached state exists (fewer is better)")
    print(f"{'scenario':<44} {'prompt':>7} {'llama-cpp-python':>17} {'llama-cache':>12}")
    for name, run, _, field in scenarios:
        row = results[name]
        print(
            f"{name:<44} {row['llama-cache']['prompt']:>7} {row['llama-cpp-python'][field]:>17} "
            f"{row['llama-cache'][field]:>12}"
        )
    report = {"machine": described, "scenarios": results}
    finish(report)
    write(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
