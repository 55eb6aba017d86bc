"""The engine's deterministic mode on the real default model: a greedy answer is the same bit for bit
alone or under any load (concurrent requests, queueing, heads shared and evicted)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from llama_cache import Engine, LlamaRAMCache

pytestmark = [pytest.mark.model]

SYSTEM = "You are a careful assistant who answers in one short sentence about nature and cities. " * 3
QUESTIONS = [
    "What is a river?", "Why is the sky blue?", "Name a large city.", "What do bees make?",
    "How tall can trees grow? Answer with numbers and some detail about the tallest ones you know.",
    "What is snow?", "Where do whales live?", "What is a volcano made of?",
    "Describe a desert at night, the sounds, the cold air, the stars and the animals that come out.",
    "Is the moon a planet?",
]


def _prompts(engine: Engine) -> list[list[int]]:
    tokenize = engine.model.tokenize
    head = tokenize(SYSTEM.encode())
    # A shared head, questions of several lengths (one prompt chunk, several, one token more than
    # another prompt), and one prompt with no shared head at all.
    prompts = [head + tokenize(f" Question: {q} Answer:".encode(), add_bos=False) for q in QUESTIONS]
    prompts.append(prompts[0] + tokenize(b" Yes", add_bos=False))
    prompts.append(tokenize(b"Once upon a time, in a small village by the sea,"))
    return prompts


def _alone(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Each prompt's greedy answer with nothing else running (one after another, on a fresh engine)."""
    answers = []
    with Engine(n_ctx=4096, parallel=8, deterministic=True) as engine:
        for prompt, n in zip(prompts, max_tokens, strict=True):
            answers.append(_tokens(engine, prompt, n))
    return answers


def _tokens(engine: Engine, prompt: list[int], max_tokens: int) -> list[int]:
    completions = engine.completions()
    completions.create_completion(prompt, max_tokens=max_tokens, temperature=0)
    return completions.live_tokens()[len(prompt):].tolist()


def test_greedy_answers_of_concurrent_requests_equal_each_request_alone_bit_for_bit() -> None:
    with Engine(n_ctx=4096, parallel=8, deterministic=True) as engine:
        prompts = _prompts(engine)
        max_tokens = [24 + 7 * (i % 4) for i in range(len(prompts))]
        answers: dict[int, list[int]] = {}

        def ask(index: int) -> None:
            answers[index] = _tokens(engine, prompts[index], max_tokens[index])

        # More requests than sequences at once: some wait, start while others generate, and take
        # heads from sequences that finished or are still reading them.
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert engine.scheduler.stats.shared_tokens > 0  # heads were copied between sequences
        assert sorted(answers) == list(range(len(prompts))) and sum(map(len, answers.values())) > len(prompts)
    alone = _alone(prompts, max_tokens)
    for index, answer in answers.items():
        assert answer == alone[index], f"request {index} differs under load"


def test_answers_are_the_same_after_eviction_to_the_tiers_and_back() -> None:
    with Engine(n_ctx=1024, parallel=2, deterministic=True, cache=LlamaRAMCache(capacity_bytes=1 << 28)) as engine:
        prompts = _prompts(engine)[:5]
        first = [_tokens(engine, prompt, 12) for prompt in prompts]  # two sequences: the others are evicted
        assert engine.scheduler.stats.evicted > 0
        again = [_tokens(engine, prompt + answer[:3], 9) for prompt, answer in zip(prompts, first, strict=True)]
        assert engine.scheduler.stats.restored_tokens > 0
    for answer, later in zip(first, again, strict=True):
        assert later == answer[3:12]


def test_each_sequence_has_a_stream_of_its_own_with_a_cell_to_spare() -> None:
    with Engine(n_ctx=2048, parallel=4, deterministic=True) as engine:
        assert engine.context.n_ctx_seq == 512
        assert engine.n_ctx == 511  # what one request may hold
        assert engine.figures()["kv_cells"] == 2048
        tokens = engine.model.tokenize(b"word " * 600)
        with pytest.raises(ValueError, match="exceed context window of 511"):
            engine.completions().create_completion(tokens[:600], max_tokens=4, temperature=0)
        # A prompt that fills its stream but one cell answers up to the end (the spare cell holds the
        # throwaway row of its last decode).
        prompt = tokens[:505]
        completions = engine.completions()
        result = completions.create_completion(prompt, max_tokens=100, temperature=0)
        assert result["choices"][0]["finish_reason"] == "length"
        assert result["usage"]["completion_tokens"] == 6


def test_deterministic_mode_needs_a_transformer_model(tiny_model_paths: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="deterministic mode needs a transformer model"):
        Engine(tiny_model_paths["mamba"], n_ctx=256, parallel=1, deterministic=True)


def test_deterministic_mode_needs_flash_attention() -> None:
    import llama_cpp

    with Engine(n_ctx=512, parallel=1) as engine:  # auto: on (rows skip other sequences' cells)
        assert engine.flash_attn is True
        assert engine.context.params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    with Engine(n_ctx=512, parallel=1, flash_attn=False) as engine:
        assert engine.flash_attn is False
        assert engine.context.params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    with Engine(n_ctx=512, parallel=1, deterministic=True) as engine:
        assert engine.flash_attn is True
        assert engine.context.params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    with pytest.raises(ValueError, match="deterministic mode needs flash attention"):
        Engine(n_ctx=512, parallel=1, deterministic=True, flash_attn=False)
    with pytest.raises(ValueError, match="flash_attn must be True, False or None"):
        Engine(n_ctx=512, parallel=1, flash_attn="on")  # type: ignore[arg-type]
