"""llama_cache.Llama on recurrent and hybrid models: checkpointed prefill, resumption, invalidation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest

from llama_cache import LlamaCache, LlamaRAMCache
from llama_cache.llama import Llama
from llama_cache.testing.tiny_models import TINY_ARCHITECTURES

DOCUMENT = "Llamas carry loads across the mountains and hum to each other at night. " * 12


def _make(path: Path, **kwargs: Any) -> Llama:
    options = {"n_ctx": 2048, "seed": 0, "verbose": False, "n_threads": 1, "checkpoint_interval": 64}
    options.update(kwargs)
    return Llama(model_path=str(path), **options)


def _greedy(llm: llama_cpp.Llama, prompt: str | list[int], max_tokens: int = 6) -> str:
    result = llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0, seed=0)
    return result["choices"][0]["text"]


def _chat(llm: llama_cpp.Llama, turns: int = 3, reset: bool = False) -> list[tuple[int, str]]:
    history = [{"role": "system", "content": DOCUMENT}]
    replies = []
    for turn in range(turns):
        history.append({"role": "user", "content": f"Question {turn}: what do llamas do?"})
        if reset:
            llm.reset()
        reply = llm.create_chat_completion(history, max_tokens=6, temperature=0.0, seed=0)
        text = reply["choices"][0]["message"]["content"]
        history.append({"role": "assistant", "content": text})
        replies.append((getattr(llm, "last_prompt_tokens_evaluated", -1), text))
    return replies


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_chat_turns_resume_from_checkpoints_and_match_cold_runs(arch: str, tiny_model_paths: dict[str, Path]) -> None:
    llm = _make(tiny_model_paths[arch])
    replies = _chat(llm)
    assert llm.checkpoints is not None and len(llm.checkpoints) > 0
    for evaluated, _ in replies[1:]:
        # The new user message, the previous reply and the template's tags: never the document again.
        assert 0 < evaluated < 60, replies
    cold = _make(tiny_model_paths[arch], ctx_checkpoints=0)
    assert [text for _, text in replies] == [text for _, text in _chat(cold, reset=True)]


@pytest.mark.parametrize("arch", ["lfm2", "mamba"])
def test_a_prompt_leaving_the_live_path_resumes_from_the_best_checkpoint(
    arch: str, tiny_model_paths: dict[str, Path]
) -> None:
    llm = _make(tiny_model_paths[arch])
    base = llm.tokenize(DOCUMENT.encode())
    assert len(base) > 64
    _greedy(llm, base + llm.tokenize(b" Second question?", add_bos=False))
    third = base + llm.tokenize(b" A third, different question?", add_bos=False)
    text = _greedy(llm, third)
    # Resumed from the checkpoint at the document's last interval boundary (64 * k), not from zero.
    assert llm.last_prompt_tokens_evaluated == len(third) - (len(base) // 64) * 64
    cold = _make(tiny_model_paths[arch], ctx_checkpoints=0)
    assert text == _greedy(cold, third)


@pytest.mark.parametrize("arch", ["lfm2", "mamba2"])
def test_restore_and_continue_gives_bit_identical_logits(arch: str, tiny_model_paths: dict[str, Path]) -> None:
    llm = _make(tiny_model_paths[arch])
    prompt = llm.tokenize(DOCUMENT.encode())
    llm.eval(prompt)
    assert llm.checkpoints is not None
    best = llm.checkpoints.find_best_checkpoint(prompt)
    assert best is not None and best.pos == (len(prompt) // 64) * 64
    tail = prompt[best.pos :]
    continuation = llm.tokenize(b" And then?", add_bos=False)
    llm.eval(continuation)
    first = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),)).copy()

    assert llm.checkpoints.restore_checkpoint(best)
    llm.n_tokens = best.pos
    llm.eval(tail)
    llm.eval(continuation)
    again = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),))
    assert np.array_equal(first, again)


def test_disabled_checkpoints_never_split_nor_extract(tiny_model_paths: dict[str, Path]) -> None:
    llm = _make(tiny_model_paths["lfm2"], ctx_checkpoints=0)
    assert llm.checkpoints is not None
    calls: list[int] = []
    original = llama_cpp.Llama.eval

    def counting_eval(self: llama_cpp.Llama, tokens: Any) -> None:
        calls.append(len(tokens))
        original(self, tokens)

    extracted: list[int] = []
    real_get = llm.checkpoints._get_data_ext
    assert real_get is not None
    llm.checkpoints._get_data_ext = lambda *args: extracted.append(1) or real_get(*args)  # type: ignore[method-assign]
    prompt = llm.tokenize(DOCUMENT.encode())
    try:
        llama_cpp.Llama.eval = counting_eval  # type: ignore[method-assign]
        _greedy(llm, prompt, max_tokens=1)
    finally:
        llama_cpp.Llama.eval = original  # type: ignore[method-assign]
    assert calls[0] == len(prompt)  # one evaluation, not split at checkpoint positions
    assert extracted == []
    assert len(llm.checkpoints) == 0


def test_reset_and_state_loads_invalidate_checkpoints(tiny_model_paths: dict[str, Path]) -> None:
    llm = _make(tiny_model_paths["granitehybrid"])
    prompt = llm.tokenize(DOCUMENT.encode())
    llm.eval(prompt)
    assert llm.checkpoints is not None and len(llm.checkpoints) > 0
    state = llm.save_state()
    llm.reset()
    assert len(llm.checkpoints) == 0
    llm.eval(prompt)
    assert len(llm.checkpoints) > 0
    llm.load_state(state)
    assert len(llm.checkpoints) == 0
    assert llm.n_tokens == len(prompt)


def test_device_mode_keeps_one_checkpoint_per_sequence(tiny_model_paths: dict[str, Path]) -> None:
    llm = _make(tiny_model_paths["mamba2"], checkpoint_on_device=True)
    llm.eval(llm.tokenize(DOCUMENT.encode()))
    assert llm.checkpoints is not None
    assert len(llm.checkpoints) == 1
    assert llm.checkpoints.on_device


@pytest.mark.parametrize("arch", ["mamba", "granitehybrid"])
def test_prompt_cache_serves_recurrent_models_after_reset(arch: str, tiny_model_paths: dict[str, Path]) -> None:
    cache = LlamaCache(capacity_bytes=1 << 30)
    llm = _make(tiny_model_paths[arch], cache=cache)
    prompt = llm.tokenize(DOCUMENT.encode())
    first = _greedy(llm, prompt)
    llm.reset()
    assert _greedy(llm, prompt) == first
    assert llm.last_prompt_tokens_evaluated == 0  # the prompt's complete state, with its logits
    llm.reset()
    suffix = llm.tokenize(b" Anything else?", add_bos=False)
    _greedy(llm, prompt + suffix)
    assert llm.last_prompt_tokens_evaluated == len(suffix)


def test_ram_cache_longer_entry_falls_back_cleanly_on_recurrent_memory(tiny_model_paths: dict[str, Path]) -> None:
    """A cached state running past the prompt cannot be cut back: the answer must still be right."""
    llm = _make(tiny_model_paths["mamba"], cache=LlamaRAMCache(capacity_bytes=1 << 30), ctx_checkpoints=0)
    prompt = llm.tokenize(DOCUMENT.encode())
    _greedy(llm, prompt + llm.tokenize(b" Long follow-up question here?", add_bos=False))
    llm.reset()
    shorter = prompt + llm.tokenize(b" Short?", add_bos=False)
    text = _greedy(llm, shorter)
    cold = _make(tiny_model_paths["mamba"], ctx_checkpoints=0)
    assert text == _greedy(cold, shorter)


def test_closing_the_model_closes_its_checkpoints(tiny_model_paths: dict[str, Path]) -> None:
    llm = _make(tiny_model_paths["lfm2"])
    llm.eval(llm.tokenize(DOCUMENT.encode()))
    checkpoints = llm.checkpoints
    assert checkpoints is not None and len(checkpoints) > 0
    best = checkpoints.find_best_checkpoint(llm.tokenize(DOCUMENT.encode()))
    assert best is not None
    llm.close()
    assert checkpoints.closed
    assert not checkpoints.restore_checkpoint(best)
