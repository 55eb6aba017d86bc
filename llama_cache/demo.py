"""``llama-cache demo``: what a prefix cache saves a plain ``llama_cpp.Llama`` serving two chats.

Two conversations share a system prompt and take turns on one model, as a server sees them. The live
context then always holds the other conversation, so without a cache llama-cpp-python re-evaluates the
whole history every turn; with :class:`llama_cache.LlamaCache` plugged in through ``set_cache`` each
turn restores its conversation's last state and evaluates only the new message.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import llama_cpp
from tqdm import tqdm

from llama_cache.caches.trie import LlamaTrieCache
from llama_cache.measure import CompletionTiming, timed_chat_completion
from llama_cache.native_log import route_llama_cpp_logs

SYSTEM_PROMPT = (
    "You are a concise assistant for a team that runs language models on small machines. "
    "Answer in one or two sentences. Prefer concrete numbers, name trade-offs plainly, and say when "
    "something depends on the hardware. The team cares about time to first token, memory per "
    "request, and keeping answers identical whether or not a cache was used."
)

CONVERSATIONS: dict[str, list[str]] = {
    "A": [
        "What is a KV cache?",
        "Why does a long system prompt slow down the first token?",
        "How can a server avoid paying for that prompt twice?",
        "What happens when the cache is full?",
    ],
    "B": [
        "Give me a name for a small pet llama.",
        "Why that name?",
        "Suggest a second name that rhymes with it.",
        "Which of the two is easier to shout across a field?",
    ],
}


@dataclass(frozen=True, slots=True)
class TurnResult:
    conversation: str
    turn: int
    timing: CompletionTiming


def run_chats(llm: llama_cpp.Llama, turns: int, max_tokens: int, progress: tqdm) -> list[TurnResult]:
    """Play the conversations interleaved, turn by turn, and measure every reply (greedy decoding)."""
    histories = {name: [{"role": "system", "content": SYSTEM_PROMPT}] for name in CONVERSATIONS}
    results: list[TurnResult] = []
    for turn in range(turns):
        for name, questions in CONVERSATIONS.items():
            history = histories[name]
            history.append({"role": "user", "content": questions[turn % len(questions)]})
            timing = timed_chat_completion(llm, history, max_tokens=max_tokens, temperature=0.0, seed=0)
            history.append({"role": "assistant", "content": timing.text})
            results.append(TurnResult(name, turn + 1, timing))
            progress.update(1)
    return results


def run_demo(model_path: Path, turns: int, max_tokens: int) -> str:
    """Run the demo on ``model_path`` and return its report: a per-turn table and totals.

    Three runs of the same conversations: a plain ``llama_cpp.Llama`` without a cache, the same with
    :class:`LlamaTrieCache` plugged in through ``set_cache``, and :class:`llama_cache.Llama` with one.
    """
    from llama_cache.llama import Llama

    common = {"model_path": str(model_path), "n_ctx": 4096, "n_batch": 512, "seed": 0, "verbose": False}
    plain_cache = LlamaTrieCache(capacity_bytes=4 << 30)
    ours_cache = LlamaTrieCache(capacity_bytes=4 << 30)
    runs: dict[str, list[TurnResult]] = {}
    with tqdm(total=3 * turns * len(CONVERSATIONS), desc="demo turns", unit="turn", leave=False) as progress:
        route_llama_cpp_logs()  # the plain llama_cpp.Llama keeps llama.cpp's warnings off stderr too
        plain = llama_cpp.Llama(**common)
        runs["no cache"] = run_chats(plain, turns, max_tokens, progress)
        plain.reset()
        plain.set_cache(plain_cache)
        runs["LlamaCache"] = run_chats(plain, turns, max_tokens, progress)
        plain.close()
        ours = Llama(**common, cache=ours_cache)
        runs["llama_cache.Llama"] = run_chats(ours, turns, max_tokens, progress)
        ours.close()

    names = list(runs)
    lines: list[str] = []
    lines.append(f"model: {model_path.name}   {len(CONVERSATIONS)} interleaved conversations, {turns} turns each")
    lines.append("time to first token in ms (prompt tokens evaluated)\n")
    header = f"{'conv':<5}{'turn':>5}" + "".join(f"{name:>22}" for name in names) + "  same text"
    lines.append(header)
    lines.append("-" * len(header))
    for row in zip(*runs.values()):
        cells = "".join(f"{r.timing.ttft_s * 1000:>13.0f} ({r.timing.prompt_tokens_evaluated:>5})" for r in row)
        same = "yes" if len({r.timing.text for r in row}) == 1 else "no"
        lines.append(f"{row[0].conversation:<5}{row[0].turn:>5}{cells}  {same}")
    cached_agree = all(a.timing.text == b.timing.text for a, b in zip(runs["LlamaCache"], runs["llama_cache.Llama"]))
    if any(len({r.timing.text for r in row}) > 1 for row in zip(*runs.values())):
        lines.append(
            "\n(llama.cpp on CPU is not batch-invariant: a prompt evaluated in other chunks can flip a "
            "near tie between two tokens. Both cached runs evaluate in the same chunks; they "
            + ("agree." if cached_agree else "differ too.")
            + ")"
        )
    totals = {name: sum(r.timing.ttft_s for r in results) for name, results in runs.items()}
    lines.append("\ntotal time to first token: " + ", ".join(f"{name} {total:.2f} s" for name, total in totals.items()))
    for name, cache in (("LlamaCache on llama_cpp.Llama", plain_cache), ("llama_cache.Llama", ours_cache)):
        stats = cache.stats()
        lines.append(
            f"{name}: {stats.entries} entries, {stats.bytes / 2**20:.1f} MiB, "
            f"{stats.hits} hits, {stats.misses} misses"
        )
    return "\n".join(lines)
