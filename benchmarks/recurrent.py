"""Multi-turn chat on tiny recurrent and hybrid models: prompt tokens evaluated and time per turn.

    tools/run python benchmarks/recurrent.py [--turns 6] [--history-tokens 2000]

For each of the tiny ``lfm2`` (hybrid) and ``mamba`` (recurrent) models written by
``llama_cache.testing.tiny_models``, a chat whose system message is a ~2,000-token document runs on one
model kept between turns, side by side:

- theirs: ``llama_cpp.Llama`` with ``llama_cpp.llama_cache.LlamaRAMCache``;
- ours: ``llama_cache.Llama`` with ``llama_cache.LlamaRAMCache`` and checkpoints
  (``ctx_checkpoints=16``, ``checkpoint_interval=512``).

The two chats advance turn by turn, in an order that alternates with the turn, so drift on a shared
machine does not favour one of them. After the last turn each side's memory is measured the same way:
the distinct buffers its cache's entries hold (``llama_cache.state.memory.memory_blocks``); ours'
checkpoints are reported beside it.

Target: from the second turn on, ours evaluates at most the tokens since the latest checkpoint on the
new prompt's path (the bound is printed per turn). Prints a table and the verdict per model and writes
``benchmarks/results/recurrent.json`` (the machine, the versions, the settings, every turn, the verdicts),
rewritten after each model.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import llama_cpp
from tqdm import tqdm

from benchmarks.machine import finish, machine, write
from llama_cache import LlamaRAMCache, default_model_path
from llama_cache.checkpoints import HybridCheckpointCache
from llama_cache.llama import Llama
from llama_cache.measure import timed_chat_completion
from llama_cache.state.memory import memory_blocks
from llama_cache.testing.tiny_models import write_tiny_model

ARCHITECTURES = ("lfm2", "mamba")
INTERVAL = 512


def _document(llm: llama_cpp.Llama, target_tokens: int) -> str:
    sentences = []
    index = 0
    while len(llm.tokenize(" ".join(sentences).encode())) < target_tokens:
        sentences.append(f"Entry {index}: the herd crossed pass number {index * 7 % 23} before dusk.")
        index += 1
    return " ".join(sentences)


def _chats(models: dict[str, llama_cpp.Llama], document: str, turns: int,
           progress: tqdm) -> dict[str, list[dict[str, Any]]]:
    """One chat per model, turn by turn, the models in an order that rotates with the turn."""
    names = list(models)
    histories = {name: [{"role": "system", "content": document}] for name in names}
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for turn in range(turns):
        shift = turn % len(names)
        for name in names[shift:] + names[:shift]:
            llm, history = models[name], histories[name]
            history.append({"role": "user", "content": f"Question {turn + 1}: which pass came first?"})
            before = _reusable_before(llm)
            result = timed_chat_completion(llm, history, max_tokens=8, temperature=0.0, seed=0)
            history.append({"role": "assistant", "content": result.text})
            rows[name].append({
                "turn": turn + 1,
                "evaluated": result.prompt_tokens_evaluated,
                "ttft_ms": result.ttft_s * 1000,
                "total_ms": result.total_s * 1000,
                "bound": _bound(llm, before) if before is not None else None,
            })
            progress.update(1)
    return rows


def _held_bytes(values: list[Any]) -> int:
    """Bytes the distinct buffers of ``values`` hold (a buffer shared by several entries counts once)."""
    blocks: dict[Any, int] = {}
    for value in values:
        blocks.update(memory_blocks(value))
    return sum(blocks.values())


def _reusable_before(llm: llama_cpp.Llama) -> tuple[list[int], list[tuple[int, str]]] | None:
    """What the next prompt could resume from: the live tokens and the checkpoints (pos, prefix hash)."""
    if not isinstance(llm, Llama) or llm.checkpoints is None:
        return None
    live = [int(t) for t in llm.input_ids[: llm.n_tokens]]
    return live, [(cp.pos, cp.hash_val) for cp in llm.checkpoints.checkpoints]


def _bound(llm: Llama, before: tuple[list[int], list[tuple[int, str]]]) -> int:
    """Prompt tokens after the furthest reusable point (live context or checkpoint) on the prompt's path."""
    prompt = [int(t) for t in llm.input_ids[: llm.last_prompt_length]]
    live, checkpoints = before
    reusable = [pos for pos, digest in checkpoints
                if pos < len(prompt) and HybridCheckpointCache._hash_prefix(prompt, pos) == digest]
    if live and prompt[: len(live)] == live and len(live) < len(prompt):
        reusable.append(len(live))
    return len(prompt) - max(reusable, default=0)


def _verdict(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """The target on our turns from the second on: evaluated tokens at most the turn's bound."""
    judged = [row for row in turns if row["turn"] >= 2 and row["bound"] is not None]
    within = sum(1 for row in judged if row["evaluated"] <= row["bound"])
    verdict = "not measured" if not judged else "met" if within == len(judged) else "not met"
    return {"turns": len(judged), "within": within, "verdict": verdict}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--history-tokens", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/recurrent.json"))
    args = parser.parse_args()

    results: dict[str, Any] = {}
    report: dict[str, Any] = {"machine": machine(), "settings": {"turns": args.turns,
                                                                "history_tokens": args.history_tokens,
                                                                "checkpoint_interval": INTERVAL},
                              "architectures": results}
    with tempfile.TemporaryDirectory() as scratch, tqdm(
        total=2 * len(ARCHITECTURES) * args.turns, desc="recurrent chat", unit="turn", leave=False
    ) as progress:
        for arch in ARCHITECTURES:
            path = write_tiny_model(arch, Path(scratch) / f"{arch}.gguf", tokenizer_from=default_model_path())
            common = {"model_path": str(path), "n_ctx": 4096, "seed": 0, "verbose": False}
            theirs_cache = llama_cpp.llama_cache.LlamaRAMCache(capacity_bytes=4 << 30)
            theirs = llama_cpp.Llama(**common)
            theirs.set_cache(theirs_cache)
            ours_cache = LlamaRAMCache(capacity_bytes=4 << 30)
            ours = Llama(**common, cache=ours_cache, checkpoint_interval=INTERVAL)
            document = _document(theirs, args.history_tokens)
            started = time.perf_counter()
            rows = _chats({"theirs": theirs, "ours": ours}, document, args.turns, progress)
            results[arch] = {
                **rows,
                "checkpoints": len(ours.checkpoints or ()),
                "memory": {
                    "theirs_entries": len(theirs_cache.cache_state),
                    "theirs_bytes": _held_bytes(list(theirs_cache.cache_state.values())),
                    "ours_entries": len(ours_cache),
                    "ours_bytes": _held_bytes([ours_cache.peek(key) for key in ours_cache.keys()]),
                    "ours_checkpoint_bytes": ours.checkpoints.cache_size if ours.checkpoints is not None else 0,
                },
                "seconds": time.perf_counter() - started,
            }
            theirs.close()
            ours.close()
            write(args.out, report)  # each model as it is done, if a later one fails

    for arch, data in results.items():
        print(f"\n{arch}: ~{args.history_tokens}-token history, model kept between turns")
        print(f"{'turn':>4} {'theirs: evaluated':>18} {'ms':>8} {'ours: evaluated':>16} {'ms':>8} {'bound':>6}")
        for mine, their in zip(data["ours"], data["theirs"]):
            bound = "" if mine["bound"] is None else str(mine["bound"])
            print(f"{mine['turn']:>4} {their['evaluated']:>18} {their['ttft_ms']:>8.0f} "
                  f"{mine['evaluated']:>16} {mine['ttft_ms']:>8.0f} {bound:>6}")
        memory = data["memory"]
        print(f"cache memory after {args.turns} turns (distinct buffers of all entries): theirs "
              f"{memory['theirs_bytes'] / 2**20:.1f} MiB in {memory['theirs_entries']} entries, ours "
              f"{memory['ours_bytes'] / 2**20:.1f} MiB in {memory['ours_entries']} entries "
              f"+ {memory['ours_checkpoint_bytes'] / 2**20:.2f} MiB of checkpoints")
    report["targets"] = {arch: _verdict(data["ours"]) for arch, data in results.items()}
    print()
    for arch, target in report["targets"].items():
        print(f"{arch}: target, from turn 2 on ours evaluates at most the tokens since its latest checkpoint: "
              f"{target['within']} of {target['turns']} turns within: {target['verdict'].upper()}")
    finish(report)
    write(args.out, report)
    print(f"\nJSON written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
