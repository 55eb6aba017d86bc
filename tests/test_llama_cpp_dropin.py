"""Our caches plugged into a plain ``llama_cpp.Llama`` with ``set_cache``, on the real default model."""

from __future__ import annotations

from collections.abc import Iterator

import llama_cpp
import pytest

from llama_cache import LlamaCache, LlamaRAMCache, default_model_path
from llama_cache.measure import recording_evals

pytestmark = pytest.mark.model

PROMPT = (
    "Q: Name three animals that live in the Andes mountains and say one thing about each of them.\nA:"
)


@pytest.fixture(scope="module")
def model() -> Iterator[llama_cpp.Llama]:
    model = llama_cpp.Llama(model_path=str(default_model_path()), n_ctx=1024, seed=0, verbose=False)
    yield model
    model.close()


@pytest.fixture
def llm(model: llama_cpp.Llama) -> llama_cpp.Llama:
    """The module's model with nothing evaluated: no test reuses the tokens another left in its context."""
    model.reset()
    return model


def _complete(llm: llama_cpp.Llama, prompt: list[int], max_tokens: int = 8) -> tuple[list[int], int]:
    """Greedy completion of a token prompt: (completion tokens, prompt tokens evaluated)."""
    with recording_evals(llm) as recorder:
        result = llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0, seed=0)
    text = result["choices"][0]["text"]
    return llm.tokenize(text.encode(), add_bos=False, special=True), recorder.prompt_tokens(llm)


def test_extension_of_a_cached_completion_evaluates_only_the_new_tokens(llm: llama_cpp.Llama) -> None:
    cache = LlamaCache(capacity_bytes=4 << 30)
    llm.set_cache(cache)
    try:
        prompt = llm.tokenize(PROMPT.encode())
        with recording_evals(llm) as recorder:
            first = llm.create_completion(prompt, max_tokens=8, temperature=0.0, seed=0)
        assert recorder.prompt_tokens(llm) == len(prompt)
        assert len(cache) == 1
        (stored_key,) = cache.keys()
        stored_state = cache[stored_key]
        assert list(stored_key[: len(prompt)]) == prompt

        suffix = llm.tokenize(b" Also, which one is the largest?", add_bos=False)
        follow_up = list(stored_key) + suffix
        llm.reset()
        with recording_evals(llm) as recorder:
            cached = llm.create_completion(follow_up, max_tokens=8, temperature=0.0, seed=0)
        # Everything the stored state covers is skipped: the suffix (plus the last completion token,
        # which llama-cpp-python samples but never evaluates) is all that runs.
        assert recorder.prompt_tokens(llm) == len(follow_up) - stored_state.n_tokens
        assert recorder.prompt_tokens(llm) <= len(suffix) + 1
        assert cache.stats().hits >= 1
    finally:
        llm.set_cache(None)

    llm.reset()
    with recording_evals(llm) as recorder:
        llm.create_completion(follow_up, max_tokens=8, temperature=0.0, seed=0)
    assert recorder.prompt_tokens(llm) == len(follow_up)  # without the cache, all of it
    # The answer equals a cold run's evaluated in the same batches as the cached one (llama.cpp on CPU is
    # not batch-invariant: one batch of the whole prompt may flip a near tie): the prompt at once, each
    # completion token the stored state holds on its own, then the rest.
    llm.reset()
    llm.eval(prompt)
    for token in stored_key[len(prompt) : stored_state.n_tokens]:
        llm.eval([token])
    with recording_evals(llm) as recorder:
        same_batches = llm.create_completion(follow_up, max_tokens=8, temperature=0.0, seed=0)
    assert recorder.prompt_tokens(llm) == len(follow_up) - stored_state.n_tokens
    assert cached["choices"][0]["text"] == same_batches["choices"][0]["text"]
    assert first["choices"][0]["text"]


def test_ram_cache_serves_a_prompt_that_diverges_from_the_cached_one(llm: llama_cpp.Llama) -> None:
    cache = LlamaRAMCache(capacity_bytes=4 << 30)
    llm.set_cache(cache)
    try:
        prompt = llm.tokenize(PROMPT.encode())
        llm.create_completion(prompt, max_tokens=4, temperature=0.0, seed=0)
        divergent = prompt[:-3] + llm.tokenize(b" Give two examples.\nA:", add_bos=False)
        llm.reset()
        with recording_evals(llm) as recorder:
            cached = llm.create_completion(divergent, max_tokens=8, temperature=0.0, seed=0)
        # llama-cpp-python restores the state and cuts its KV back to the common prefix.
        assert recorder.prompt_tokens(llm) == len(divergent) - (len(prompt) - 3)
    finally:
        llm.set_cache(None)
    llm.reset()
    cold = llm.create_completion(divergent, max_tokens=8, temperature=0.0, seed=0)
    assert cached["choices"][0]["text"] == cold["choices"][0]["text"]


def test_llama_cpp_states_are_charged_for_their_scores_matrix(llm: llama_cpp.Llama) -> None:
    cache = LlamaCache(capacity_bytes=4 << 30)
    llm.set_cache(cache)
    try:
        llm.reset()
        llm.create_completion(PROMPT, max_tokens=2, temperature=0.0, seed=0)
    finally:
        llm.set_cache(None)
    (key,) = cache.keys()
    state = cache[key]
    # llama-cpp-python's own cache would charge llama_state_size only.
    assert cache.cache_size == state.llama_state_size + state.scores.nbytes + state.input_ids.nbytes
    assert cache.cache_size > 2 * state.llama_state_size
