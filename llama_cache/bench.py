"""``llama-cache bench``: time to first token cold, with llama-cpp-python's cache, and with ours.

Three set-ups run side by side in one process on the same model file:

- cold: ``llama_cpp.Llama`` with no cache, reset before every request;
- theirs: ``llama_cpp.Llama`` with ``llama_cpp.llama_cache.LlamaRAMCache``;
- ours: ``llama_cache.Llama`` with ``llama_cache.LlamaRAMCache``.

Scenarios, three variants each (median reported): (a) a ~1,500-token prompt again, (b) that prompt plus
a short suffix, (c) a prompt diverging from the cached one at 75%, (d) a 10-turn chat where the model serves other work between turns (it is
reset before each turn, as a server's shared model is). Plus the bytes each cache charges per entry.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp
from tqdm import tqdm

from llama_cache.state.memory import memory_blocks
from llama_cache.caches.ram import LlamaRAMCache
from llama_cache.llama import Llama
from llama_cache.measure import timed_chat_completion, timed_completion

_FACTS = [
    "Llamas were domesticated in the Andes several thousand years ago",
    "a llama can carry about a quarter of its body weight over long distances",
    "their wool is soft and nearly free of lanolin",
    "herds keep watch for predators and warn each other with a high call",
    "alpacas are smaller relatives bred mainly for their fibre",
    "llamas communicate with ear positions, tail posture and humming",
    "they were the main pack animal of the Inca road network",
    "a baby llama is called a cria and stands within an hour of birth",
]


@dataclass
class Setup:
    name: str
    llm: llama_cpp.Llama
    cache: Any


@dataclass
class ScenarioResult:
    scenario: str
    prompt_tokens: int
    ttft_ms: dict[str, float] = field(default_factory=dict)  # median over the variants
    runs_ms: dict[str, list[float]] = field(default_factory=dict)
    evaluated: dict[str, int] = field(default_factory=dict)  # the most any variant evaluated


def _document(llm: llama_cpp.Llama, target_tokens: int) -> list[int]:
    sentences: list[str] = []
    index = 0
    while True:
        fact = _FACTS[index % len(_FACTS)]
        sentences.append(f"Note {index + 1}: {fact}.")
        index += 1
        tokens = llm.tokenize((" ".join(sentences) + "\nQuestion: what is the most surprising note?\nAnswer:").encode())
        if len(tokens) >= target_tokens:
            return tokens


def _request(setup: Setup, prompt: list[int]) -> tuple[float, int]:
    if setup.name == "cold":
        setup.llm.reset()
    result = timed_completion(setup.llm, prompt, max_tokens=4, temperature=0.0, seed=0)
    return result.ttft_s * 1000, result.prompt_tokens_evaluated


def run_bench(model_path: Path, prompt_tokens: int, turns: int, out: Path) -> str:
    """Run every scenario, write JSON to ``out`` and return the report (a table)."""
    common = {"model_path": str(model_path), "n_ctx": 4096, "n_batch": 512, "seed": 0, "verbose": False}
    theirs_cache = llama_cpp.llama_cache.LlamaRAMCache(capacity_bytes=8 << 30)
    ours_cache = LlamaRAMCache(capacity_bytes=8 << 30)
    cold_llm = llama_cpp.Llama(**common)
    theirs_llm = llama_cpp.Llama(**common)
    theirs_llm.set_cache(theirs_cache)
    ours_llm = Llama(**common, cache=ours_cache)
    setups = [Setup("cold", cold_llm, None), Setup("theirs", theirs_llm, theirs_cache), Setup("ours", ours_llm, ours_cache)]

    document = _document(cold_llm, prompt_tokens)
    cut = int(len(document) * 0.75)

    def words(text: str) -> list[int]:
        return cold_llm.tokenize(text.encode(), add_bos=False)

    # Each scenario runs in three variants (distinct texts, so no variant is an exact repeat of
    # another) and reports the median: the machine is shared and noisy.
    scenarios = [
        ("(a) same prompt again", [document] * 3),
        ("(b) prompt + short suffix", [document + words(t) for t in (" Explain it briefly.", " Why?", " Give one example.")]),
        ("(c) diverges at 75%", [document[:cut] + words(t) for t in (
            " Which note is the shortest?\nAnswer:", " Name two notes.\nAnswer:", " Count the notes.\nAnswer:")]),
    ]

    results: list[ScenarioResult] = []
    steps = len(setups) * (sum(len(variants) for _, variants in scenarios) + 1 + turns)
    with tqdm(total=steps, desc="bench", unit="request", leave=False) as progress:
        for setup in setups[1:]:  # fill both caches with the document
            _request(setup, document)
            progress.update(1)
        progress.update(1)
        entry_bytes = _entry_bytes(theirs_cache, ours_cache)
        entry_bytes.update(_save_ms(theirs_llm, ours_llm))
        for title, variants in scenarios:
            result = ScenarioResult(title, len(variants[0]))
            for prompt in variants:
                for setup in setups:
                    setup.llm.reset()
                    ttft, evaluated = _request(setup, prompt)
                    result.runs_ms.setdefault(setup.name, []).append(ttft)
                    result.evaluated[setup.name] = max(evaluated, result.evaluated.get(setup.name, 0))
                    progress.update(1)
            result.ttft_ms = {name: statistics.median(runs) for name, runs in result.runs_ms.items()}
            results.append(result)
        chat = {setup.name: _chat(setup, turns, progress) for setup in setups}

    report = _report(results, chat, entry_bytes, len(document))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "model": model_path.name,
        "machine": platform.platform(),
        "prompt_tokens": len(document),
        "scenarios": [asdict(r) for r in results],
        "chat": chat,
        "bytes_per_entry": entry_bytes,
    }, indent=2))
    return f"{report}\n\nJSON written to {out}"


def _chat(setup: Setup, turns: int, progress: tqdm) -> dict[str, Any]:
    history = [{"role": "system", "content": "You answer questions about llamas in one sentence."}]
    evaluated: list[int] = []
    ttft: list[float] = []
    started = time.perf_counter()
    for turn in range(turns):
        history.append({"role": "user", "content": f"Tell me fact number {turn + 1} about llamas."})
        setup.llm.reset()  # the shared model served someone else in between
        result = timed_chat_completion(setup.llm, history, max_tokens=12, temperature=0.0, seed=0)
        history.append({"role": "assistant", "content": result.text})
        evaluated.append(result.prompt_tokens_evaluated)
        ttft.append(result.ttft_s * 1000)
        progress.update(1)
    return {"evaluated_per_turn": evaluated, "ttft_ms_per_turn": ttft, "total_s": time.perf_counter() - started}


def _entry_bytes(theirs: Any, ours: LlamaRAMCache) -> dict[str, float]:
    """What each cache charges for its first request (the document), against llama.cpp's state bytes.

    Ours holds two entries for it (the prompt's state and prompt+completion's) sharing one KV buffer;
    theirs holds one. Theirs is measured honestly (``memory_blocks``), not by its own ``cache_size``.
    """
    (their_state,) = theirs.cache_state.values()
    their_owned = sum(size for _, size in memory_blocks(their_state))
    ours_longest = ours.peek(max(ours.keys(), key=len))  # no lookup: it would change recency
    assert ours_longest is not None
    return {
        "llama_cpp_state_bytes": float(their_state.llama_state_size),
        "theirs_bytes": float(their_owned),
        "theirs_ratio": their_owned / their_state.llama_state_size,
        "ours_bytes": float(ours.cache_size),
        "ours_ratio": ours.cache_size / ours_longest.llama_state_size,
    }


def _save_ms(theirs: llama_cpp.Llama, ours: Llama, repeats: int = 5) -> dict[str, float]:
    """Median time of one ``save_state`` (what a completion pays before returning), each model as it is."""

    def median_ms(llm: llama_cpp.Llama) -> float:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            llm.save_state()
            times.append((time.perf_counter() - started) * 1000)
        return sorted(times)[len(times) // 2]

    return {"theirs_save_ms": median_ms(theirs), "ours_save_ms": median_ms(ours)}


def _report(results: list[ScenarioResult], chat: dict[str, Any], entry_bytes: dict[str, float], n: int) -> str:
    lines: list[str] = []
    lines.append(f"time to first token, {n}-token prompt, median of 3 variants (prompt tokens evaluated in brackets)\n")
    header = f"{'scenario':<28}{'cold':>18}{'llama-cpp-python':>20}{'llama-cache':>18}{'vs cold':>9}{'vs theirs':>11}"
    lines.append(header)
    lines.append("-" * len(header))
    for r in results:
        cells = [f"{r.ttft_ms[s]:8.0f} ms ({r.evaluated[s]:>4})" for s in ("cold", "theirs", "ours")]
        lines.append(f"{r.scenario:<28}{cells[0]:>18}{cells[1]:>20}{cells[2]:>18}"
              f"{r.ttft_ms['cold'] / r.ttft_ms['ours']:>8.1f}x{r.ttft_ms['theirs'] / r.ttft_ms['ours']:>10.1f}x")
    lines.append(f"\n{len(chat['ours']['evaluated_per_turn'])}-turn chat (model reset between turns): prompt tokens evaluated per turn")
    for name in ("cold", "theirs", "ours"):
        lines.append(f"  {name:<7} {chat[name]['evaluated_per_turn']}  total {chat[name]['total_s']:.2f} s")
    lines.append(
        f"\nbytes per cached entry: llama.cpp state {entry_bytes['llama_cpp_state_bytes'] / 2**20:.1f} MiB; "
        f"theirs {entry_bytes['theirs_bytes'] / 2**20:.1f} MiB ({entry_bytes['theirs_ratio']:.2f}x), "
        f"ours {entry_bytes['ours_bytes'] / 2**20:.1f} MiB ({entry_bytes['ours_ratio']:.2f}x)"
    )
    lines.append(
        f"saving a state after a completion: theirs {entry_bytes['theirs_save_ms']:.0f} ms, "
        f"ours {entry_bytes['ours_save_ms']:.0f} ms"
    )
    return "\n".join(lines)
