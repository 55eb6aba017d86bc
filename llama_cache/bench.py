"""``llama-cache bench``: time to first token cold, with llama-cpp-python's cache, and with ours.

Three set-ups run side by side in one process on the same model file:

- cold: ``llama_cpp.Llama`` with no cache, reset before every request;
- theirs: ``llama_cpp.Llama`` with ``llama_cpp.llama_cache.LlamaRAMCache``;
- ours: ``llama_cache.Llama`` with ``llama_cache.LlamaRAMCache``.

Scenarios, three variants each (median reported): (a) a ~1,500-token prompt again, (b) that prompt plus
a short suffix, (c) a prompt diverging from the cached one at 75%, (d) a 10-turn chat where the model
serves other work between turns (it is reset before each turn, as a server's shared model is).

Like is compared with like:

- the set-ups take turns in a rotating order (per variant, per chat turn), so drift on a shared machine
  and whoever warms a cache line first do not favour one of them;
- saving is timed after new tokens were evaluated each time (what a completion pays), not as repeated
  saves of an unchanged context;
- both caches' memory is measured the same way: the distinct buffers their entries hold
  (:func:`~llama_cache.state.memory.memory_blocks`), against the same unit, llama.cpp's bytes for the
  sequence's KV.

It also measures ``save_state()`` on its own, after new tokens were evaluated on a restored history (what a
chat turn saves): the bytes the returned state holds against llama.cpp's bytes for the sequence (target: at
most 1.10x), and that state's restore against its canonical twin (target: at most 1.3x).

Per scenario it reports ours against llama-cpp-python's hit (their time to first token over ours) and,
for every state ours restored, the restore time against a restore of the same state held in canonical
form (llama.cpp's own bytes, handed over without assembly): the median and the largest such ratio
(target: at most 1.5), in the restoring thread's CPU time, which other processes do not inflate.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
from tqdm import tqdm

from llama_cache.caches.ram import LlamaRAMCache
from llama_cache.llama import Llama
from llama_cache.measure import (RestoreTiming, finish_conditions, machine_conditions, recording_restores, timed_chat_completion,
                                 timed_completion)
from llama_cache.native_log import route_llama_cpp_logs
from llama_cache.state.llama_state import RESTORE_STAGING, LlamaState
from llama_cache.state.memory import memory_blocks

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


_EVICT_BYTES = 64 << 20  # more than any CPU cache here


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
    restores: list[dict[str, Any]] = field(default_factory=list)  # ours: every restore, see _restore_rows
    ours_vs_theirs: float = 0.0  # their median time to first token over ours
    max_restore_ratio: float | None = None  # ours: slowest restore against its canonical twin
    median_restore_ratio: float | None = None


def document_tokens(llm: llama_cpp.Llama, target_tokens: int) -> list[int]:
    """A document of notes about llamas and a question, at least ``target_tokens`` tokens long."""
    sentences: list[str] = []
    index = 0
    while True:
        fact = _FACTS[index % len(_FACTS)]
        sentences.append(f"Note {index + 1}: {fact}.")
        index += 1
        tokens = llm.tokenize((" ".join(sentences) + "\nQuestion: what is the most surprising note?\nAnswer:").encode())
        if len(tokens) >= target_tokens:
            return tokens


def _rotated(setups: list[Setup], shift: int) -> list[Setup]:
    shift %= len(setups)
    return setups[shift:] + setups[:shift]


def _request(setup: Setup, prompt: list[int]) -> tuple[float, int]:
    if setup.name == "cold":
        setup.llm.reset()
    result = timed_completion(setup.llm, prompt, max_tokens=4, temperature=0.0, seed=0)
    return result.ttft_s * 1000, result.prompt_tokens_evaluated


def run_bench(model_path: Path, prompt_tokens: int, turns: int, out: Path) -> str:
    """Run every scenario, write JSON to ``out`` and return the report (a table)."""
    machine = machine_conditions()
    common = {"model_path": str(model_path), "n_ctx": 4096, "n_batch": 512, "seed": 0, "verbose": False}
    theirs_cache = llama_cpp.llama_cache.LlamaRAMCache(capacity_bytes=8 << 30)
    ours_cache = LlamaRAMCache(capacity_bytes=8 << 30)
    route_llama_cpp_logs()  # the plain llama_cpp.Llama baselines keep llama.cpp's warnings off stderr too
    cold_llm = llama_cpp.Llama(**common)
    theirs_llm = llama_cpp.Llama(**common)
    theirs_llm.set_cache(theirs_cache)
    ours_llm = Llama(**common, cache=ours_cache)
    setups = [Setup("cold", cold_llm, None), Setup("theirs", theirs_llm, theirs_cache), Setup("ours", ours_llm, ours_cache)]

    document = document_tokens(cold_llm, prompt_tokens)
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
        saving, saved = _save_ms(theirs_llm, ours_llm, words(" " + " ".join(_FACTS)))
        entry_bytes.update(saving)
        entry_bytes.update(_saved_state(saved["theirs"], saved["ours"], ours_llm))
        for index, (title, variants) in enumerate(scenarios):
            result = ScenarioResult(title, len(variants[0]))
            for variant, prompt in enumerate(variants):
                for setup in _rotated(setups, index + variant):
                    setup.llm.reset()
                    with recording_restores(setup.llm) as restores:
                        ttft, evaluated = _request(setup, prompt)
                    if setup.name == "ours":
                        result.restores += _restore_rows(ours_llm, restores)
                    result.runs_ms.setdefault(setup.name, []).append(ttft)
                    result.evaluated[setup.name] = max(evaluated, result.evaluated.get(setup.name, 0))
                    progress.update(1)
            result.ttft_ms = {name: statistics.median(runs) for name, runs in result.runs_ms.items()}
            _compare(result)
            results.append(result)
        chat, chat_restores = _chats(setups, turns, progress)
    entry_bytes["staging_bytes"] = float(RESTORE_STAGING.idle_nbytes)

    report = _report(results, chat, chat_restores, entry_bytes, len(document))
    finish_conditions(machine)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "model": model_path.name,
        "machine": machine,
        "prompt_tokens": len(document),
        "scenarios": [asdict(r) for r in results],
        "chat": chat,
        "chat_restores": chat_restores,
        "bytes_per_entry": entry_bytes,
    }, indent=2))
    return f"{report}\n\nJSON written to {out}"


def _compare(result: ScenarioResult) -> None:
    result.ours_vs_theirs = result.ttft_ms["theirs"] / result.ttft_ms["ours"]
    ratios = [row["ratio"] for row in result.restores]
    result.max_restore_ratio = max(ratios) if ratios else None
    result.median_restore_ratio = statistics.median(ratios) if ratios else None


def _restore_rows(llm: Llama, restores: list[RestoreTiming], repeats: int = 3) -> list[dict[str, Any]]:
    """Each restore ``llm`` made, against the median restore of the same state in canonical form.

    The canonical twin holds exactly the bytes llama.cpp is handed, so restoring it copies nothing
    before ``llama_state_seq_set_data``: the memory-speed floor that assembled states are held to. The
    twins are restored after the request, outside its timing (the next request resets the context),
    each time after the CPU caches were flushed by writing a buffer larger than them. The ratio is of
    the restoring thread's CPU time (page faults included), which other processes on a shared machine
    do not inflate; wall times are kept beside it.
    """
    rows: list[dict[str, Any]] = []
    scratch = np.empty(_EVICT_BYTES, dtype=np.uint8)
    for restore in restores:
        state = restore.state
        if not isinstance(state, LlamaState):
            continue
        twin = LlamaState.from_seq_bytes(state.tokens, state.logits, state.seed, state.fingerprint, state.seq_bytes(0))
        assert not twin.needs_assembly(0)
        walls, cpus = [], []
        for _ in range(repeats):
            # The request's restore found the state's bytes out of the CPU caches (other set-ups ran in
            # between); so must the twin's, or a small state would be compared with an L2-hot copy.
            scratch.fill(1)
            started, cpu_started = time.perf_counter(), time.thread_time()
            llm.load_state(twin)
            walls.append((time.perf_counter() - started) * 1000)
            cpus.append((time.thread_time() - cpu_started) * 1000)
        canonical_cpu_ms = statistics.median(cpus)
        rows.append({
            "n_tokens": state.n_tokens,
            "segments": len(state.segments),
            "assembled": state.needs_assembly(0),
            "ms": restore.seconds * 1000,
            "canonical_ms": statistics.median(walls),
            "cpu_ms": restore.cpu_seconds * 1000,
            "canonical_cpu_ms": canonical_cpu_ms,
            "ratio": restore.cpu_seconds * 1000 / canonical_cpu_ms,
        })
    return rows


def _chats(setups: list[Setup], turns: int, progress: tqdm) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One chat per set-up, turn by turn, the set-ups in an order rotating with the turn."""
    histories = {setup.name: [{"role": "system", "content": "You answer questions about llamas in one sentence."}]
                 for setup in setups}
    chat: dict[str, Any] = {setup.name: {"evaluated_per_turn": [], "ttft_ms_per_turn": [], "total_s": 0.0}
                            for setup in setups}
    restore_rows: list[dict[str, Any]] = []
    for turn in range(turns):
        for setup in _rotated(setups, turn):
            history = histories[setup.name]
            history.append({"role": "user", "content": f"Tell me fact number {turn + 1} about llamas."})
            setup.llm.reset()  # the shared model served someone else in between
            started = time.perf_counter()
            with recording_restores(setup.llm) as restores:
                result = timed_chat_completion(setup.llm, history, max_tokens=12, temperature=0.0, seed=0)
            row = chat[setup.name]
            row["total_s"] += time.perf_counter() - started
            history.append({"role": "assistant", "content": result.text})
            row["evaluated_per_turn"].append(result.prompt_tokens_evaluated)
            row["ttft_ms_per_turn"].append(result.ttft_s * 1000)
            if setup.name == "ours":
                assert isinstance(setup.llm, Llama)
                restore_rows += _restore_rows(setup.llm, restores)
            progress.update(1)
    return chat, restore_rows


def _held_bytes(values: list[Any]) -> int:
    """Bytes the distinct buffers of ``values`` hold (a buffer shared by several entries counts once)."""
    blocks: dict[Any, int] = {}
    for value in values:
        blocks.update(memory_blocks(value))
    return sum(blocks.values())


def _entry_bytes(theirs: Any, ours: LlamaRAMCache) -> dict[str, float]:
    """What each cache holds after its first request (the document), measured the same way for both.

    Both are charged the distinct buffers their entries hold (``memory_blocks``), not what each cache
    reports about itself, against one unit: llama.cpp's bytes for the sequence's KV. Ours holds two
    entries (the prompt's state and prompt+completion's, sharing one KV buffer); theirs holds one.
    """
    theirs_values = list(theirs.cache_state.values())
    ours_values = [ours.peek(key) for key in ours.keys()]  # no lookup: it would change recency
    longest = max(ours_values, key=lambda state: state.n_tokens)
    unit = float(longest.llama_state_size)
    theirs_held, ours_held = _held_bytes(theirs_values), _held_bytes(ours_values)
    return {
        "llama_cpp_seq_state_bytes": unit,
        "theirs_entries": float(len(theirs_values)),
        "theirs_bytes": float(theirs_held),
        "theirs_ratio": theirs_held / unit,
        "ours_entries": float(len(ours_values)),
        "ours_bytes": float(ours_held),
        "ours_ratio": ours_held / unit,
    }


def _save_ms(theirs: llama_cpp.Llama, ours: Llama, new_tokens: list[int], repeats: int = 5,
             step: int = 8) -> tuple[dict[str, float], dict[str, Any]]:
    """Median time of ``save_state`` after ``step`` new tokens were evaluated, each model as it is; and
    each model's last saved state.

    Every save follows new tokens, as a completion's does: ours then copies only their KV (the rest is
    shared with the state the context was built on), theirs copies the whole context state. The two
    models take turns in a rotating order.
    """
    if len(new_tokens) < repeats * step:
        raise ValueError(f"{repeats * step} new tokens needed, got {len(new_tokens)}")
    times: dict[str, list[float]] = {"theirs": [], "ours": []}
    saved: dict[str, Any] = {}
    models: list[tuple[str, llama_cpp.Llama]] = [("theirs", theirs), ("ours", ours)]
    for rep in range(repeats):
        chunk = new_tokens[rep * step : (rep + 1) * step]
        for name, llm in models[rep % 2 :] + models[: rep % 2]:
            llm.eval(chunk)
            started = time.perf_counter()
            saved[name] = llm.save_state()
            times[name].append((time.perf_counter() - started) * 1000)
    return {"theirs_save_ms": statistics.median(times["theirs"]), "ours_save_ms": statistics.median(times["ours"]),
            "save_new_tokens": float(step)}, saved


def _saved_state(theirs: Any, ours: LlamaState, llm: Llama, restores: int = 3) -> dict[str, float]:
    """What one ``save_state()`` returns, held apart from any cache: the bytes of its distinct buffers
    against llama.cpp's bytes for the sequence (both sides, one unit), and the median of ``restores``
    restores of ours against its canonical twin (CPU time, CPU caches flushed before each)."""
    unit = float(ours.llama_state_size)
    scratch = np.empty(_EVICT_BYTES, dtype=np.uint8)
    rows: list[dict[str, Any]] = []
    for _ in range(restores):
        llm.reset()
        scratch.fill(1)
        with recording_restores(llm) as timings:
            llm.load_state(ours)
        rows += _restore_rows(llm, timings)
    llm.reset()
    return {
        "save_state_tokens": float(ours.n_tokens),
        "save_state_segments": float(len(ours.segments)),
        "ours_save_state_bytes": float(_held_bytes([ours])),
        "ours_save_state_ratio": _held_bytes([ours]) / unit,
        "theirs_save_state_bytes": float(_held_bytes([theirs])),
        "theirs_save_state_ratio": _held_bytes([theirs]) / unit,
        "save_state_restore_ratio": statistics.median(row["ratio"] for row in rows),
        "save_state_restore_assembled": float(any(row["assembled"] for row in rows)),
    }


def _report(results: list[ScenarioResult], chat: dict[str, Any], chat_restores: list[dict[str, Any]],
            entry_bytes: dict[str, float], n: int) -> str:
    lines: list[str] = []
    lines.append(f"time to first token, {n}-token prompt, median of 3 variants (prompt tokens evaluated in brackets);")
    lines.append("set-ups in rotating order; restore = ours' restore / the same state's canonical restore, in")
    lines.append("the restoring thread's CPU time: median and slowest of the scenario's restores\n")
    header = (f"{'scenario':<28}{'cold':>18}{'llama-cpp-python':>20}{'llama-cache':>18}{'vs cold':>9}"
              f"{'vs theirs':>11}{'restore':>15}")
    lines.append(header)
    lines.append("-" * len(header))
    for r in results:
        cells = [f"{r.ttft_ms[s]:8.0f} ms ({r.evaluated[s]:>4})" for s in ("cold", "theirs", "ours")]
        restore = "-"
        if r.max_restore_ratio is not None:
            restore = f"{r.median_restore_ratio:.2f}x {r.max_restore_ratio:.2f}x"
        lines.append(f"{r.scenario:<28}{cells[0]:>18}{cells[1]:>20}{cells[2]:>18}"
                     f"{r.ttft_ms['cold'] / r.ttft_ms['ours']:>8.1f}x{r.ours_vs_theirs:>10.1f}x{restore:>15}")
    turns = len(chat["ours"]["evaluated_per_turn"])
    lines.append(f"\n(d) {turns}-turn chat (model reset between turns): prompt tokens evaluated per turn")
    for name in ("cold", "theirs", "ours"):
        ttft = sum(chat[name]["ttft_ms_per_turn"])
        lines.append(f"  {name:<7} {chat[name]['evaluated_per_turn']}  time to first token, all turns "
                     f"{ttft:.0f} ms; total {chat[name]['total_s']:.2f} s")
    ours_ttft, theirs_ttft = sum(chat["ours"]["ttft_ms_per_turn"]), sum(chat["theirs"]["ttft_ms_per_turn"])
    chat_ratios = [row["ratio"] for row in chat_restores]
    restore = f"{statistics.median(chat_ratios):.2f}x / {max(chat_ratios):.2f}x" if chat_ratios else "-"
    lines.append(f"  ours vs theirs (time to first token, all turns): {theirs_ttft / ours_ttft:.1f}x; "
                 f"restore / canonical, median / slowest: {restore}")
    every = [row["ratio"] for r in results for row in r.restores] + [row["ratio"] for row in chat_restores]
    if every:
        verdict = "met" if max(every) <= 1.5 else "NOT met"
        lines.append(f"\nno state restore slower than 1.5x the canonical one: {verdict} "
                     f"(median {statistics.median(every):.2f}x, max {max(every):.2f}x over {len(every)} restores)")
    unit = entry_bytes["llama_cpp_seq_state_bytes"]
    lines.append(
        f"\nmemory held after the first request, distinct buffers of all entries, in units of llama.cpp's "
        f"{unit / 2**20:.1f} MiB sequence state: theirs {entry_bytes['theirs_bytes'] / 2**20:.1f} MiB in "
        f"{entry_bytes['theirs_entries']:.0f} entry ({entry_bytes['theirs_ratio']:.2f}x), ours "
        f"{entry_bytes['ours_bytes'] / 2**20:.1f} MiB in {entry_bytes['ours_entries']:.0f} entries "
        f"({entry_bytes['ours_ratio']:.2f}x); ours' restore staging buffer (process-wide) "
        f"{entry_bytes['staging_bytes'] / 2**20:.1f} MiB"
    )
    lines.append(
        f"saving a state after {entry_bytes['save_new_tokens']:.0f} new tokens (median of 5): "
        f"theirs {entry_bytes['theirs_save_ms']:.0f} ms, ours {entry_bytes['ours_save_ms']:.0f} ms"
    )
    held, restore = entry_bytes["ours_save_state_ratio"], entry_bytes["save_state_restore_ratio"]
    lines.append(
        f"save_state() of {entry_bytes['save_state_tokens']:.0f} tokens, held apart from any cache, against "
        f"llama.cpp's bytes: theirs {entry_bytes['theirs_save_state_ratio']:.2f}x, ours {held:.2f}x "
        f"({entry_bytes['save_state_segments']:.0f} segments; at most 1.10x: {'met' if held <= 1.10 else 'NOT met'}); "
        f"its restore / canonical {restore:.2f}x (at most 1.3x: {'met' if restore <= 1.3 else 'NOT met'})"
    )
    return "\n".join(lines)
