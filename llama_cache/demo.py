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


def run_demo(model_path: Path, turns: int, max_tokens: int) -> int:
    """Run the demo on ``model_path`` and print a per-turn table; returns the exit status."""
    llm = llama_cpp.Llama(model_path=str(model_path), n_ctx=4096, n_batch=512, seed=0, verbose=False)
    total = 2 * turns * len(CONVERSATIONS)
    with tqdm(total=total, desc="demo turns", unit="turn", leave=False) as progress:
        llm.set_cache(None)
        cold = run_chats(llm, turns, max_tokens, progress)
        llm.reset()
        cache = LlamaTrieCache(capacity_bytes=4 << 30)
        llm.set_cache(cache)
        cached = run_chats(llm, turns, max_tokens, progress)

    print(f"model: {model_path.name}   {len(CONVERSATIONS)} interleaved conversations, {turns} turns each\n")
    header = f"{'conv':<5}{'turn':>5}  {'no cache: ttft':>15} {'prompt tok':>11}   {'LlamaCache: ttft':>17} {'prompt tok':>11}  same text"
    print(header)
    print("-" * len(header))
    for plain, hit in zip(cold, cached):
        same = "yes" if plain.timing.text == hit.timing.text else "NO"
        print(
            f"{plain.conversation:<5}{plain.turn:>5}  {plain.timing.ttft_s * 1000:>12.0f} ms "
            f"{plain.timing.prompt_tokens_evaluated:>11}   {hit.timing.ttft_s * 1000:>14.0f} ms "
            f"{hit.timing.prompt_tokens_evaluated:>11}  {same}"
        )
    cold_total = sum(r.timing.ttft_s for r in cold)
    cached_total = sum(r.timing.ttft_s for r in cached)
    stats = cache.stats()
    print(
        f"\ntotal time to first token: {cold_total:.2f} s without a cache, {cached_total:.2f} s with "
        f"LlamaCache ({cold_total / cached_total:.1f}x)"
    )
    print(
        f"cache: {stats.entries} entries, {stats.bytes / 2**20:.0f} MiB charged, {stats.hits} hits, "
        f"{stats.misses} misses (llama-cpp-python's states carry a full scores matrix; "
        "llama_cache.Llama stores compact ones)"
    )
    return 0
