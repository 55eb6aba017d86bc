"""No wrong hits, no missed hits, a true drop-in: each defect found by trying the library as a user would.

Every test here runs the real llama.cpp on the embedded default model (or a tiny recurrent model written by
the session fixture) and failed before the behaviour it checks was built.
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest

from llama_cache import IncompatibleStateError, Llama, LlamaCache, LlamaRAMCache, default_model_path
from llama_cache.measure import recording_evals
from llama_cache.state import fingerprint as fingerprint_module
from llama_cache.state.fingerprint import COVERED_PARAMS, IGNORED_PARAMS, file_identity, model_fingerprint

pytestmark = pytest.mark.model

PROMPT = (
    "The llama is a domesticated South American camelid, widely used as a meat and pack animal by Andean "
    "cultures since the pre-Columbian era. Llamas are social animals and live with others as a herd. "
    "Q: Is a llama a camelid? Answer yes or no.\nA:"
)


def _make(**kwargs: Any) -> Llama:
    options: dict[str, Any] = {"model_path": str(default_model_path()), "n_ctx": 512, "seed": 0, "verbose": False}
    options.update(kwargs)
    return Llama(**options)


def _plain(**kwargs: Any) -> llama_cpp.Llama:
    options: dict[str, Any] = {"model_path": str(default_model_path()), "n_ctx": 512, "seed": 0, "verbose": False}
    options.update(kwargs)
    return llama_cpp.Llama(**options)


def _complete(llm: llama_cpp.Llama, prompt: str = PROMPT, **kwargs: Any) -> tuple[str, int]:
    """Greedy completion: its text and the prompt tokens it evaluated."""
    options: dict[str, Any] = {"max_tokens": 8, "temperature": 0.0, "seed": 0}
    options.update(kwargs)
    with recording_evals(llm) as recorder:
        result = llm.create_completion(prompt, **options)
        evaluated = recorder.prompt_tokens(llm)
    return result["choices"][0]["text"], evaluated


def _fill(llm: Llama, cache: Any) -> None:
    """One completion of PROMPT from an empty context, its states stored in ``cache``."""
    llm.reset()
    llm.set_cache(cache)
    try:
        _complete(llm)
    finally:
        llm.set_cache(None)


@pytest.fixture(scope="module")
def base_llm() -> Iterator[Llama]:
    llm = _make()
    yield llm
    llm.close()


# -- wrong hits: the fingerprint ---------------------------------------------------------------------


def test_every_context_parameter_is_either_covered_or_deliberately_ignored() -> None:
    fields = {name for name, _ in llama_cpp.llama_context_params._fields_}
    assert set(COVERED_PARAMS) | set(IGNORED_PARAMS) == fields
    assert not set(COVERED_PARAMS) & set(IGNORED_PARAMS)


# A value different from the default for every covered parameter (set on the context parameters, as
# llama-cpp-python does before creating the context).
_CHANGED = {
    "n_seq_max": 2,
    "n_rs_seq": 3,
    "ctx_type": 1,
    "rope_scaling_type": llama_cpp.LLAMA_ROPE_SCALING_TYPE_LINEAR,
    "pooling_type": llama_cpp.LLAMA_POOLING_TYPE_MEAN,
    "attention_type": llama_cpp.LLAMA_ATTENTION_TYPE_NON_CAUSAL,
    "flash_attn_type": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "rope_freq_base": 20000.0,
    "rope_freq_scale": 0.5,
    "yarn_ext_factor": 0.25,
    "yarn_attn_factor": 2.0,
    "yarn_beta_fast": 16.0,
    "yarn_beta_slow": 2.0,
    "yarn_orig_ctx": 1024,
    "type_k": llama_cpp.GGML_TYPE_Q8_0,
    "type_v": llama_cpp.GGML_TYPE_Q8_0,
    "embeddings": True,
    "swa_full": True,
    "kv_unified": True,
}


def test_the_changed_values_cover_every_covered_parameter() -> None:
    assert set(_CHANGED) == set(COVERED_PARAMS)


@pytest.mark.parametrize("name", sorted(COVERED_PARAMS))
def test_a_changed_covered_parameter_changes_the_fingerprint(base_llm: Llama, name: str) -> None:
    params = base_llm.context_params
    original = getattr(params, name)
    assert model_fingerprint(base_llm) == base_llm.fingerprint  # unchanged: the same fingerprint
    changed = _CHANGED[name]
    if changed == original:
        changed = type(original)(not original) if isinstance(original, bool) else changed + 1
    setattr(params, name, changed)
    try:
        assert model_fingerprint(base_llm) != base_llm.fingerprint
    finally:
        setattr(params, name, original)
    assert model_fingerprint(base_llm) == base_llm.fingerprint


@pytest.mark.parametrize("name", ["n_ctx", "n_batch", "n_ubatch", "n_threads", "n_threads_batch", "offload_kqv"])
def test_ignored_parameters_leave_the_fingerprint_alone(base_llm: Llama, name: str) -> None:
    params = base_llm.context_params
    original = getattr(params, name)
    setattr(params, name, (not original) if isinstance(original, bool) else original + 7)
    try:
        assert model_fingerprint(base_llm) == base_llm.fingerprint
    finally:
        setattr(params, name, original)


@pytest.mark.parametrize(
    "options",
    [
        {"rope_freq_base": 20000.0},
        {"rope_freq_scale": 0.5},
        {"yarn_orig_ctx": 256, "rope_scaling_type": llama_cpp.LLAMA_ROPE_SCALING_TYPE_YARN},
        {"type_k": llama_cpp.GGML_TYPE_Q8_0},
        {"flash_attn": True},
        {"kv_overrides": {"llama.rope.freq_base": 50000.0}},
    ],
    ids=lambda options: "-".join(options),
)
def test_a_state_made_with_other_kv_settings_is_a_miss_and_the_text_is_the_cold_one(
    base_llm: Llama, options: dict[str, Any]
) -> None:
    cache = LlamaRAMCache(capacity_bytes=1 << 30)
    _fill(base_llm, cache)
    other = _make(**options)
    try:
        cold_text, _ = _complete(other)
        other.reset()
        other.set_cache(cache)
        text, evaluated = _complete(other)
        n_prompt = len(other.tokenize(PROMPT.encode()))
    finally:
        other.close()
    assert evaluated == n_prompt  # nothing restored
    assert text == cold_text


def test_the_same_settings_hit(base_llm: Llama) -> None:
    cache = LlamaCache(capacity_bytes=1 << 30)
    _fill(base_llm, cache)
    twin = _make(rope_freq_base=0.0, n_batch=128, n_threads=1, cache=cache)  # only ignored things differ
    try:
        assert twin.fingerprint == base_llm.fingerprint
        _, evaluated = _complete(twin)
    finally:
        twin.close()
    assert evaluated == 0


def test_models_differing_only_in_the_middle_of_the_file_have_different_fingerprints(
    tmp_path: Path, base_llm: Llama
) -> None:
    edited = tmp_path / "edited.gguf"
    shutil.copyfile(default_model_path(), edited)
    size = edited.stat().st_size
    with open(edited, "r+b") as file:  # one byte of tensor data, far from both ends
        file.seek(size // 2)
        byte = file.read(1)
        file.seek(size // 2)
        file.write(bytes([byte[0] ^ 0x01]))
    assert file_identity(edited) != file_identity(default_model_path())
    other = _make(model_path=str(edited))
    try:
        assert other.fingerprint != base_llm.fingerprint
    finally:
        other.close()


def test_file_identity_is_remembered_and_follows_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMA_CACHE_HOME", str(tmp_path / "home"))
    path = tmp_path / "model.bin"
    path.write_bytes(b"a" * 100_000)
    first = file_identity(path)
    assert (tmp_path / "home" / "file-identities.json").is_file()
    fingerprint_module._memo.clear()
    assert file_identity(path) == first  # from the file, after the in-process memo is gone
    path.write_bytes(b"a" * 50_000 + b"b" + b"a" * 49_999)  # same size, new modification time
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    assert file_identity(path) != first


def test_the_suite_remembers_identities_in_a_home_of_its_own(tmp_path_factory: pytest.TempPathFactory) -> None:
    home = Path(os.environ["LLAMA_CACHE_HOME"])  # set by conftest for the session
    assert home.is_relative_to(tmp_path_factory.getbasetemp())
    file_identity(default_model_path())
    assert fingerprint_module._memo_file() == home / "file-identities.json"


def test_logits_all_states_carry_the_fingerprint_and_a_foreign_one_is_a_miss() -> None:
    first = _make(logits_all=True)
    cache = LlamaRAMCache(capacity_bytes=1 << 30)
    first.set_cache(cache)
    try:
        _complete(first)
        state = first.save_state()
    finally:
        first.close()
    assert isinstance(state, llama_cpp.llama.LlamaState)
    assert getattr(state, "fingerprint", None) is not None
    other = _make(logits_all=True, rope_freq_base=20000.0)
    try:
        with pytest.raises(IncompatibleStateError):
            other.load_state(state)
        cold_text, _ = _complete(other)
        other.reset()
        other.set_cache(cache)
        text, evaluated = _complete(other)  # before: RuntimeError out of the completion
        n_prompt = len(other.tokenize(PROMPT.encode()))
    finally:
        other.close()
    assert text == cold_text
    assert evaluated == n_prompt


# -- clear errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [None, "state", b"bytes", object(), 42])
def test_load_state_refuses_what_is_not_a_state(base_llm: Llama, bad: Any) -> None:
    with pytest.raises(TypeError, match="load_state takes"):
        base_llm.load_state(bad)


def test_our_states_handed_to_a_plain_llama_give_a_clear_error_and_change_nothing(base_llm: Llama) -> None:
    base_llm.reset()
    base_llm.eval(base_llm.tokenize(PROMPT.encode()))
    state = base_llm.save_state()
    plain = _plain()
    try:
        plain.eval(plain.tokenize(b"Hello there"))
        before = (plain.n_tokens, plain.input_ids.copy())
        with pytest.raises(IncompatibleStateError, match="llama_cache.Llama"):
            plain.load_state(state)
        assert plain.n_tokens == before[0] and np.array_equal(plain.input_ids, before[1])
        # In a completion it is a miss: the plain model answers from its own evaluation.
        cache = LlamaCache(capacity_bytes=1 << 30)
        cache[state.tokens.tolist()] = state
        cold_text, _ = _complete(plain)
        plain.reset()
        plain.set_cache(cache)
        text, _ = _complete(plain)
    finally:
        plain.close()
    assert text == cold_text


def test_the_library_writes_nothing_to_stderr_without_logging_configured(tmp_path: Path) -> None:
    script = (
        "from llama_cache import LlamaRAMCache\n"
        "cache = LlamaRAMCache(capacity_bytes=1000)\n"
        "cache[[1, 2]] = object()\n"  # logged at WARNING
        "assert cache.stats().store_errors == 1\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


# -- missed hits -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["plain", "ours"])
def test_a_one_token_completion_repeated_is_a_hit(kind: str) -> None:
    llm = _plain() if kind == "plain" else _make()
    try:
        llm.set_cache(LlamaCache(capacity_bytes=1 << 30))
        first, evaluated_first = _complete(llm, max_tokens=1)
        llm.reset()
        again, evaluated_again = _complete(llm, max_tokens=1)
        n_prompt = len(llm.tokenize(PROMPT.encode()))
    finally:
        llm.close()
    assert evaluated_first == n_prompt
    assert evaluated_again <= 1  # before: the whole prompt (1.0x)
    assert again == first


def test_a_stop_on_the_first_token_leaves_a_findable_prompt_state() -> None:
    llm = _make()
    try:
        llm.set_cache(LlamaCache(capacity_bytes=1 << 30))
        bias = {llm.token_eos(): 100.0}  # end of text is the first token
        first, _ = _complete(llm, logit_bias=bias)
        llm.reset()
        again, evaluated = _complete(llm, logit_bias=bias)
    finally:
        llm.close()
    assert first == again == ""
    assert evaluated == 0


def test_recurrent_states_in_the_ram_cache_serve_only_prompts_they_prefix(tiny_model_paths: dict[str, Path]) -> None:
    path = str(tiny_model_paths["mamba"])
    llm = Llama(model_path=path, n_ctx=1024, seed=0, verbose=False, ctx_checkpoints=0,
                cache=LlamaRAMCache(capacity_bytes=1 << 30))
    cold = Llama(model_path=path, n_ctx=1024, seed=0, verbose=False, ctx_checkpoints=0)
    base = ("Llamas carry loads across the mountains and hum to each other at night. " * 8).strip()
    try:
        _complete(llm, base, max_tokens=4)
        _complete(llm, base + " First question: why?", max_tokens=4)
        llm.reset()
        text, evaluated = _complete(llm, base + " Another one: how?", max_tokens=4)
        cold_text, _ = _complete(cold, base + " Another one: how?", max_tokens=4)
        n_base = len(llm.tokenize(base.encode()))
        n_prompt = len(llm.tokenize((base + " Another one: how?").encode()))
        assert llm.tokenize((base + " Another one: how?").encode())[:n_base] == llm.tokenize(base.encode())
    finally:
        llm.close()
        cold.close()
    assert evaluated <= n_prompt - n_base + 1  # before: every token again
    assert text == cold_text


def test_an_earlier_recurrent_prompt_asked_again_restores_its_state(tiny_model_paths: dict[str, Path]) -> None:
    path = str(tiny_model_paths["mamba"])
    llm = Llama(model_path=path, n_ctx=1024, seed=0, verbose=False, ctx_checkpoints=0,
                cache=LlamaCache(capacity_bytes=1 << 30))
    cold = Llama(model_path=path, n_ctx=1024, seed=0, verbose=False, ctx_checkpoints=0)
    question = "Llamas carry loads across the mountains. " * 6 + "Why do they hum?"
    try:
        first, _ = _complete(llm, question, max_tokens=4)
        _complete(llm, question + first + " And then?", max_tokens=4)  # the live context moves past it
        again, evaluated = _complete(llm, question, max_tokens=4)
        cold_text, _ = _complete(cold, question, max_tokens=4)
    finally:
        llm.close()
        cold.close()
    assert evaluated == 0  # before: all of it again
    assert again == first == cold_text


# -- states never carry another sequence's logits ----------------------------------------------------


def _cold_last_logits(llm: Llama, tokens: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(tokens)
    pointer = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(pointer, shape=(llm.n_vocab(),)).copy()


def test_a_state_saved_after_reset_and_eval_holds_its_own_logits(base_llm: Llama) -> None:
    first = base_llm.tokenize(b"Llamas hum at night when they are calm")
    second = base_llm.tokenize(b"Alpacas spit at people they do not like")[: len(first)]
    second += [second[-1]] * (len(first) - len(second))
    expected = _cold_last_logits(base_llm, second)
    base_llm.reset()
    base_llm.create_completion(first, max_tokens=1, temperature=0.0)  # samples at position len-1
    base_llm.reset()
    base_llm.eval(second)  # the same length: the old row's position again
    state = base_llm.save_state()
    assert state.logits is not None and np.array_equal(state.logits, expected)


def test_a_state_saved_after_loading_another_holds_the_loaded_logits(base_llm: Llama) -> None:
    a = base_llm.tokenize(b"One two three four five six")
    b = base_llm.tokenize(b"Seven eight nine ten eleven twelve")
    base_llm.reset()
    base_llm.eval(a)
    state_a = base_llm.save_state()
    base_llm.reset()
    base_llm.create_completion(b, max_tokens=1, temperature=0.0)
    base_llm.load_state(state_a)
    again = base_llm.save_state()
    assert state_a.logits is not None
    assert again.logits is not None and np.array_equal(again.logits, state_a.logits)


# -- write amplification and releasing memory ---------------------------------------------------------


def test_a_pure_hit_writes_nothing_new(base_llm: Llama) -> None:
    cache = LlamaCache(capacity_bytes=1 << 30)
    base_llm.reset()
    base_llm.set_cache(cache)
    try:
        _complete(base_llm)
        writes = cache.stats().writes
        assert writes >= 1
        base_llm.reset()
        _, evaluated = _complete(base_llm)
    finally:
        base_llm.set_cache(None)
    assert evaluated == 0
    assert cache.stats().writes == writes


def test_reset_releases_the_last_state() -> None:
    llm = _make()
    try:
        llm.eval(llm.tokenize(PROMPT.encode()))
        state = llm.save_state()
        llm.reset()
        llm.load_state(state)
        reference = weakref.ref(state.tokens)  # owned by the state alone
        del state
        llm.reset()
        gc.collect()
        assert reference() is None
    finally:
        llm.close()


def test_a_cache_that_fails_to_store_never_fails_the_completion(base_llm: Llama) -> None:
    failures: list[int] = []

    class Failing(LlamaCache):
        def __setitem__(self, key: Any, value: Any) -> None:
            failures.append(len(key))
            raise OSError("disk full")

    prompt = "The capital of France is"  # PROMPT's greedy answer is empty: this one has words to compare
    base_llm.reset()
    cold_text, _ = _complete(base_llm, prompt)
    base_llm.reset()
    base_llm.set_cache(Failing(capacity_bytes=1 << 30))
    try:
        text, _ = _complete(base_llm, prompt)
    except OSError:
        pytest.fail("a cache failure escaped from the completion")
    finally:
        base_llm.set_cache(None)
    assert failures  # the completion did try to store its states
    assert text == cold_text and cold_text


def test_a_state_outlives_its_model_and_continues_in_a_new_one() -> None:
    llm = _make()
    llm.eval(llm.tokenize(PROMPT.encode()))
    state = llm.save_state()
    llm.close()
    other = _make()
    try:
        cold_text, _ = _complete(other)
        other.reset()
        other.load_state(state)
        text, evaluated = _complete(other)  # the restored prompt and its logits: no decode
    finally:
        other.close()
    assert evaluated == 0
    assert text == cold_text
