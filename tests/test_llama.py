"""llama_cache.Llama on the real default model: compact states, partial reuse, exact hits, chats."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterator

import llama_cpp
import numpy as np
import pytest

from llama_cache import LlamaCache, LlamaRAMCache, default_model_path
from llama_cache.llama import Llama
from llama_cache.state.kv_layout import serialize_segments
from llama_cache.state.llama_state import LlamaState, RestoreCopy
from llama_cache.state.llama_state import IncompatibleStateError
from llama_cache.state.memory import memory_blocks

pytestmark = pytest.mark.model

DOCUMENT = (
    "The llama is a domesticated South American camelid, widely used as a meat and pack animal by "
    "Andean cultures since the pre-Columbian era. Llamas are social animals and live with others as a "
    "herd. Their wool is soft and contains only a small amount of lanolin. Llamas can learn simple "
    "tasks after a few repetitions. When using a pack, they can carry about 25 to 30% of their body "
    "weight for 8 to 13 km. "
)


def _make(cache: object | None = None, n_batch: int = 512) -> Llama:
    return Llama(
        model_path=str(default_model_path()), n_ctx=2048, n_batch=n_batch, seed=0, verbose=False,
        cache=cache,
    )


@pytest.fixture(scope="module")
def cold() -> Iterator[Llama]:
    """A model with no cache: the reference every cached result is compared with."""
    model = _make()
    yield model
    model.close()


def _greedy(llm: Llama, prompt: str | list[int], max_tokens: int = 12) -> str:
    llm.reset()
    result = llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0, seed=0)
    return result["choices"][0]["text"]


def _last_logits(llm: Llama) -> np.ndarray:
    pointer = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(pointer, shape=(llm.n_vocab(),)).copy()


# -- exact hits, extensions, divergence --------------------------------------------------------------


def test_exact_repeat_needs_no_decode_and_gives_the_cold_text(cold: Llama) -> None:
    llm = _make(LlamaCache(capacity_bytes=1 << 30))
    prompt = DOCUMENT + "Q: What do llamas carry?\nA:"
    first = _greedy(llm, prompt)
    assert llm.last_prompt_tokens_evaluated == len(llm.tokenize(prompt.encode()))
    again = _greedy(llm, prompt)
    assert llm.last_prompt_tokens_evaluated == 0
    assert first == again == _greedy(cold, prompt)


def test_a_prompt_asked_once_caches_no_logits_row_and_its_repeats_learn_one(cold: Llama) -> None:
    # A longest-common-prefix cache answers a repeat from prompt + answer's state: the first repeat
    # evaluates the last prompt token again and caches the prompt's own state; later ones evaluate nothing.
    cache = LlamaRAMCache(capacity_bytes=1 << 30)
    llm = _make(cache)
    prompt = llm.tokenize((DOCUMENT + "Q: What do llamas carry?\nA:").encode())
    expected = _greedy(cold, prompt)
    assert _greedy(llm, prompt) == expected
    assert len(cache) == 1 and cache[prompt].n_tokens > len(prompt) and cache[prompt].logits is None
    evaluated = []
    for _ in range(3):
        llm.reset()
        assert _greedy(llm, prompt) == expected
        evaluated.append(llm.last_prompt_tokens_evaluated)
    assert evaluated == [1, 0, 0]
    assert len(cache) == 2 and cache[prompt].n_tokens == len(prompt) and cache[prompt].logits is not None
    # Without reset, the live context holds the prompt: that repeat counts as asked again too.
    live_cache = LlamaRAMCache(capacity_bytes=1 << 30)
    live = _make(live_cache)
    for _ in range(2):
        assert live.create_completion(prompt, max_tokens=12, temperature=0.0, seed=0)["choices"][0]["text"] == expected
    assert live.last_prompt_tokens_evaluated == 1 and len(live_cache) == 2


def test_a_one_token_answer_from_a_restored_state_can_be_asked_again(cold: Llama) -> None:
    # One token asked for: it is never evaluated, so the restored state stays the live context and the
    # repeat samples at the same position, for which llama.cpp holds another prompt's logits (in a
    # context that decoded one) or none at all (in one that never decoded: llama.cpp aborts).
    def one_token(llm: Llama) -> str:
        return llm.create_completion(prompt, max_tokens=1, temperature=0.0, seed=0)["choices"][0]["text"]

    cache = LlamaRAMCache(capacity_bytes=1 << 30)
    prompt = DOCUMENT + "Q: What do llamas carry?\nA:"
    expected = _greedy(cold, prompt, max_tokens=1)
    used = _make(cache)
    assert one_token(used) == expected
    used.create_completion("Once upon a time", max_tokens=4, temperature=0.0)
    assert [one_token(used), one_token(used)] == [expected, expected]
    assert used.last_prompt_tokens_evaluated == 0
    fresh = _make(cache)
    assert [one_token(fresh), one_token(fresh)] == [expected, expected]
    assert fresh.last_prompt_tokens_evaluated == 0


def test_extension_evaluates_only_the_suffix(cold: Llama) -> None:
    llm = _make(LlamaCache(capacity_bytes=1 << 30))
    prompt = llm.tokenize(DOCUMENT.encode())
    _greedy(llm, prompt, max_tokens=4)
    suffix = llm.tokenize(b"Q: Are llamas social?\nA:", add_bos=False)
    text = _greedy(llm, prompt + suffix)
    assert llm.last_prompt_tokens_evaluated == len(suffix)
    assert text == _greedy(cold, prompt + suffix)


def test_divergent_prompt_reuses_the_common_prefix_with_the_ram_cache(cold: Llama) -> None:
    llm = _make(LlamaRAMCache(capacity_bytes=1 << 30))
    base = llm.tokenize((DOCUMENT + "Q: How far can a llama walk with a pack?\nA:").encode())
    _greedy(llm, base, max_tokens=4)
    common = int(len(base) * 0.75)
    divergent = base[:common] + llm.tokenize(b" Alpacas are smaller.\nQ: Which is bigger?\nA:", add_bos=False)
    text = _greedy(llm, divergent)
    assert llm.last_prompt_tokens_evaluated == len(divergent) - common
    assert text == _greedy(cold, divergent)


def test_prompts_longer_than_n_batch(cold: Llama) -> None:
    llm = _make(LlamaCache(capacity_bytes=1 << 30), n_batch=64)
    prompt = llm.tokenize((DOCUMENT * 2).encode())
    assert len(prompt) > 3 * 64
    _greedy(llm, prompt, max_tokens=4)
    suffix = llm.tokenize(b"Q: Summarise in five words.\nA:", add_bos=False)
    text = _greedy(llm, prompt + suffix)
    assert llm.last_prompt_tokens_evaluated == len(suffix)
    # The cold reference evaluates in chunks of 512; greedy text is robust to that.
    assert text == _greedy(cold, prompt + suffix)


@pytest.mark.parametrize("case", range(20))
def test_varied_prompts_give_the_cold_text(cold: Llama, case: int) -> None:
    """Twenty prompts of every kind: exact repeats, extensions and divergent prefixes."""
    rng = np.random.default_rng(case)
    trie = case % 2 == 1
    llm = _make((LlamaCache if trie else LlamaRAMCache)(capacity_bytes=1 << 30))
    sentences = DOCUMENT.split(". ")
    order = rng.permutation(len(sentences))
    base = ". ".join(sentences[i] for i in order) + f"\nQ: Tell me fact number {case}.\nA:"
    tokens = llm.tokenize(base.encode())
    _greedy(llm, tokens, max_tokens=6)
    kind = case % 3
    if kind == 0:
        query = tokens
    elif kind == 1:
        query = tokens + llm.tokenize(b" Answer briefly.\nA:", add_bos=False)
    else:
        cut = int(rng.integers(len(tokens) // 2, len(tokens) - 2))
        query = tokens[:cut] + llm.tokenize(b" In short:", add_bos=False)
    text = _greedy(llm, query)
    if trie and kind == 2:
        # No cached key is a prefix of a divergent prompt: the trie cache misses.
        assert llm.last_prompt_tokens_evaluated == len(query)
    else:
        assert llm.last_prompt_tokens_evaluated < len(query)
    assert text == _greedy(cold, query)


# -- exactness of the restored state -----------------------------------------------------------------


def test_restored_state_gives_bit_identical_logits_to_a_same_chunk_cold_run() -> None:
    llm = _make()
    prompt = llm.tokenize(DOCUMENT.encode())
    suffix = llm.tokenize(b"Q: What colour are llamas?", add_bos=False)
    llm.eval(prompt)
    state = llm.save_state()
    llm.eval(suffix)
    cold_logits = _last_logits(llm)

    llm.reset()
    llm.eval(llm.tokenize(b"Something else entirely, to overwrite the context."))
    llm.reset()
    llm.load_state(state)
    assert llm.n_tokens == len(prompt)
    llm.eval(suffix)
    assert np.array_equal(_last_logits(llm), cold_logits)


def test_a_chat_turn_holds_one_copy_of_the_kv_and_restores_from_the_bytes_kept_beside_it_exactly() -> None:
    """A state extended from a restored one holds its KV once; the context offers it llama.cpp's bytes,
    which a cache adopts and charges; it restores without assembly, bit for bit, and as before once the
    cache released them."""
    llm = _make()
    prompt = llm.tokenize(DOCUMENT.encode())
    question = llm.tokenize(b"Q: What colour are llamas?", add_bos=False)
    answer = llm.tokenize(b" Mostly brown and white.", add_bos=False)
    llm.eval(prompt)
    history = llm.save_state()
    llm.reset()
    llm.load_state(history)
    llm.eval(question)
    turn = llm.save_state()  # two segments: the history's KV, shared, and the question's own
    assert len(turn.segments) == 2 and turn.segments[0].buffer is history.segments[0].buffer
    assembled = serialize_segments(turn.layout, list(turn.segments), 0)  # type: ignore[arg-type]
    llm.eval(answer)
    cold_logits = _last_logits(llm)

    # One copy of the KV: the shared history and the question's own, with the logits row and tokens.
    assert turn.restore_copy is None
    assert turn.nbytes <= 1.10 * turn.llama_state_size
    assert not turn.needs_assembly(0)  # the context's bytes of its last save are offered to it
    cache = LlamaRAMCache(capacity_bytes=1 << 30)
    cache[turn.tokens.tolist()] = turn
    copy = turn.restore_copy  # adopted by the cache, charged to its budget
    assert copy is not None and copy.data is not None and copy.nbytes == turn.llama_state_size
    assert cache.cache_size == turn.nbytes == sum(size for _, size in memory_blocks(turn))
    llm.eval(llm.tokenize(b" and a next save", add_bos=False))
    llm.save_state()  # the context offers this save's bytes now; the cache keeps the turn's
    assert not turn.needs_assembly(0)
    for released in (False, True):
        if released:
            copy.release()
            assert turn.needs_assembly(0)
        llm.reset()
        llm.eval(llm.tokenize(b"Something else entirely, to overwrite the context."))
        llm.reset()
        llm.load_state(turn)
        assert llm.n_tokens == turn.n_tokens
        assert np.array_equal(llm._read_seq_bytes(), assembled)
        llm.eval(answer)
        assert np.array_equal(_last_logits(llm), cold_logits)


def test_a_turn_no_cache_adopted_loses_only_its_fast_restore() -> None:
    """Without a cache, the offered bytes go with the context's next save; the turn restores by
    assembly then, and greedy generation after the restore is the same."""
    llm = _make()
    prompt = llm.tokenize(DOCUMENT.encode())
    llm.eval(prompt)
    history = llm.save_state()
    llm.reset()
    llm.load_state(history)
    llm.eval(llm.tokenize(b"Q: Where do llamas live?\nA:", add_bos=False))
    turn = llm.save_state()
    expected = _greedy_after(llm, turn)
    llm.reset()
    llm.eval(prompt[:50])
    llm.save_state()  # a canonical state: nothing offered any more
    assert turn.needs_assembly(0) and turn.adopt_restore_copy() is None
    assert _greedy_after(llm, turn) == expected


def _greedy_after(llm: Llama, state: LlamaState, n: int = 8) -> list[int]:
    """The ``n`` tokens greedy decoding gives after restoring ``state`` and evaluating one more token."""
    llm.reset()
    llm.load_state(state)
    llm.eval(llm.tokenize(b" The", add_bos=False))
    out = []
    for _ in range(n):
        out.append(int(np.argmax(_last_logits(llm))))
        llm.eval(out[-1:])
    return out


def test_state_owns_one_logits_row_and_the_sequence_kv() -> None:
    llm = _make()
    prompt = llm.tokenize(DOCUMENT.encode())
    llm.eval(prompt)
    state = llm.save_state()
    assert isinstance(state, LlamaState)
    assert state.n_tokens == len(prompt)
    assert list(state.input_ids) == prompt
    full = llama_cpp.llama_state_seq_get_size(llm._ctx.ctx, 0)
    assert state.llama_state_size == full
    assert state.nbytes <= 1.05 * full + state.tokens.nbytes + llm.n_vocab() * 4


# -- chats -------------------------------------------------------------------------------------------

QUESTIONS = {
    "a": ["What is a llama?", "Where do they live?", "What do they eat?"],
    "b": ["Name a colour.", "Name another one.", "Which is warmer?"],
}


def _chat_turns(llm: Llama) -> list[tuple[int, int, str, int]]:
    """Two conversations interleaved on one model, as a server sees them.

    Returns (turn, prompt tokens evaluated, reply, cache bytes after the turn) per reply.
    """
    histories = {name: [{"role": "system", "content": "Answer in one short sentence."}] for name in QUESTIONS}
    results = []
    for turn in range(3):
        for name, questions in QUESTIONS.items():
            histories[name].append({"role": "user", "content": questions[turn]})
            reply = llm.create_chat_completion(histories[name], max_tokens=10, temperature=0.0, seed=0)
            text = reply["choices"][0]["message"]["content"]
            histories[name].append({"role": "assistant", "content": text})
            size = _bytes_without_restore_copies(llm.cache)
            results.append((turn, getattr(llm, "last_prompt_tokens_evaluated", -1), text, size))
    return results


def _bytes_without_restore_copies(cache: object) -> int:
    """What a cache charges for its entries' own memory: restore copies, released before any entry, aside."""
    if not isinstance(cache, LlamaCache):
        return getattr(cache, "cache_size", 0)
    blocks = {identity: size for key in cache.keys() for identity, size in memory_blocks(cache.peek(key))}
    assert cache.cache_size == sum(blocks.values())
    return sum(size for identity, size in blocks.items() if not isinstance(identity, RestoreCopy))


def test_interleaved_chats_evaluate_only_new_tokens_and_match_llama_cpp(cold: Llama) -> None:
    llm = _make(LlamaCache(capacity_bytes=1 << 30))
    results = _chat_turns(llm)
    for turn, evaluated, _, _ in results:
        if turn > 0:
            # The new user message and the template's tags around it: never the history again.
            assert evaluated <= 30, results
    # Memory grows by the new tokens' KV, not by a copy of the whole conversation per turn (the restore
    # copies kept beside turns use budget no entry needs: they are released first).
    bytes_per_token = llm.save_state().layout.bytes_per_token  # type: ignore[union-attr]
    growth = np.diff([size for *_, size in results])
    assert max(growth) < 60 * bytes_per_token + 4 * llm.n_vocab() * 4
    # llama.cpp on CPU is not batch-invariant: a turn evaluated after a restored history can differ from
    # a whole-prompt evaluation in a near tie. llama-cpp-python with its own cache evaluates in the very
    # same chunks (restore the history, evaluate the rest), so its replies must match ours exactly.
    reference = llama_cpp.Llama(model_path=str(default_model_path()), n_ctx=2048, seed=0, verbose=False)
    reference.set_cache(llama_cpp.llama_cache.LlamaRAMCache(capacity_bytes=4 << 30))
    expected = _chat_turns(reference)  # type: ignore[arg-type]
    assert [text for _, _, text, _ in results] == [text for _, _, text, _ in expected]
    reference.close()


# -- trust: foreign states, bad input ----------------------------------------------------------------


def test_a_state_from_another_model_is_a_logged_miss(caplog: pytest.LogCaptureFixture) -> None:
    cache = LlamaCache(capacity_bytes=1 << 30)
    llm = _make(cache)
    prompt = llm.tokenize(DOCUMENT.encode())
    _greedy(llm, prompt, max_tokens=2)
    forged = []
    for key in list(cache.keys()):
        state = cache[key]
        del cache[key]  # the cache is bound to llm's model: its states go, another model's come
        forged.append(
            LlamaState(state.tokens, state.logits, state.seed, "another-model", layout=state.layout, segments=state.segments)
        )
        cache[key] = forged[-1]
    cache.bind(None)  # answer from every model's states, as an unbound cache shared by several models does
    with caplog.at_level(logging.WARNING, logger="llama_cache"):
        _greedy(llm, prompt, max_tokens=2)
    assert llm.last_prompt_tokens_evaluated > 0
    assert "another model" in caplog.text
    with pytest.raises(IncompatibleStateError):
        llm.load_state(forged[0])


def test_a_state_longer_than_the_context_is_refused() -> None:
    big = _make()
    big.eval(big.tokenize((DOCUMENT * 3).encode()))
    state = big.save_state()
    small = Llama(model_path=str(default_model_path()), n_ctx=128, seed=0, verbose=False)
    with pytest.raises(IncompatibleStateError):
        small.load_state(state)


@pytest.mark.parametrize("bad", [[-1], [10**9], [1, 2, 49152]])
def test_out_of_vocabulary_tokens_raise_value_error(bad: list[int]) -> None:
    llm = _make()
    with pytest.raises(ValueError):
        llm.eval(bad)
    with pytest.raises(ValueError):
        llm.create_completion(bad, max_tokens=1)


def test_non_int_tokens_raise_type_error() -> None:
    llm = _make()
    with pytest.raises(TypeError):
        llm.eval([1.5])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        llm.eval("hello")  # type: ignore[arg-type]


def test_bad_constructor_arguments() -> None:
    with pytest.raises(ValueError):
        Llama(model_path=str(default_model_path()), checkpoint_interval=0, verbose=False)
    with pytest.raises(TypeError):
        Llama(model_path=str(default_model_path()), cache={}, verbose=False)


def test_the_prompt_state_is_cached_beside_prompt_and_completion() -> None:
    cache = LlamaCache(capacity_bytes=1 << 30)
    llm = _make(cache)
    prompt = llm.tokenize(DOCUMENT.encode())
    _greedy(llm, prompt, max_tokens=5)
    lengths = sorted(len(key) for key in cache.keys())
    assert lengths[0] == len(prompt)
    assert lengths[1] > len(prompt)
    # The two share the prompt's KV: the cache holds it once.
    prompt_state = cache[prompt]
    assert prompt_state.logits is not None
    assert cache.cache_size < prompt_state.nbytes * 1.3 + ctypes.sizeof(ctypes.c_float) * llm.n_vocab()
    # Prompt + completion's state is kept for the next turn, which extends it: no logits row.
    longer = max(cache.keys(), key=len)
    assert cache[list(longer)].logits is None
    assert cache[list(longer)].n_tokens == len(longer)
