"""The in-memory caches run the shared contract, plus what only they promise."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from llama_cpp.llama import LlamaState as UpstreamState

from llama_cache import LlamaCache, LlamaRAMCache, LlamaTrieCache
from llama_cache.state.llama_state import LlamaState, RestoreCopy
from llama_cache.state.memory import memory_blocks
from llama_cache.testing.states import synthetic_state
from tests.cache_contract import CacheContract


class TestRAMCacheContract(CacheContract):
    policy = "longest_common_prefix"

    def make_cache(self, capacity_bytes: int) -> Any:
        return LlamaRAMCache(capacity_bytes=capacity_bytes)


class TestTrieCacheContract(CacheContract):
    policy = "whole_key_prefix"

    def make_cache(self, capacity_bytes: int) -> Any:
        return LlamaTrieCache(capacity_bytes=capacity_bytes)


def test_llama_cache_is_the_trie_cache() -> None:
    assert LlamaCache is LlamaTrieCache


def _upstream_state(n_ctx: int, n_vocab: int, state_bytes: int) -> UpstreamState:
    return UpstreamState(
        input_ids=np.zeros(n_ctx, dtype=np.intc),
        scores=np.zeros((8, n_vocab), dtype=np.single),
        n_tokens=3,
        llama_state=bytes(state_bytes),
        llama_state_size=state_bytes,
        seed=1,
    )


def test_llama_cpp_states_are_charged_for_everything_they_hold() -> None:
    state = _upstream_state(n_ctx=512, n_vocab=1000, state_bytes=4096)
    owned = state.input_ids.nbytes + state.scores.nbytes + 4096
    assert sum(size for _, size in memory_blocks(state)) == owned
    cache = LlamaRAMCache(capacity_bytes=10**6)
    cache[[1, 2, 3]] = state
    assert cache.cache_size == owned  # llama-cpp-python would charge only 4096


def test_legacy_objects_fall_back_to_llama_state_size() -> None:
    class Legacy:
        llama_state_size = 123

    cache = LlamaTrieCache(capacity_bytes=1000)
    cache[[1]] = Legacy()
    assert cache.cache_size == 123


def test_values_without_a_size_are_not_stored_and_counted_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    cache = LlamaTrieCache(capacity_bytes=1000)
    with caplog.at_level("WARNING", logger="llama_cache"):
        cache[[1]] = object()
    assert len(cache) == 0
    assert cache.stats().store_errors == 1
    assert "not caching" in caplog.text


class _SharedBlocks:
    """A value made of named blocks, some shared with other values."""

    def __init__(self, *blocks: tuple[str, int]) -> None:
        self._blocks = list(blocks)

    def memory_blocks(self) -> list[tuple[str, int]]:
        return self._blocks


def test_shared_blocks_are_charged_once_and_released_with_the_last_holder() -> None:
    cache = LlamaRAMCache(capacity_bytes=10**6)
    cache[[1, 2]] = _SharedBlocks(("prefix", 1000), ("a", 10))
    cache[[1, 2, 3]] = _SharedBlocks(("prefix", 1000), ("a", 10), ("b", 20))
    assert cache.cache_size == 1030
    del cache[[1, 2]]
    assert cache.cache_size == 1030
    del cache[[1, 2, 3]]
    assert cache.cache_size == 0
    with pytest.raises(KeyError):
        del cache[[1, 2, 3]]


def test_numpy_and_tuple_keys_are_the_same_key() -> None:
    cache = LlamaRAMCache(capacity_bytes=10**6)
    cache[np.array([4, 5, 6], dtype=np.int64)] = _SharedBlocks(("x", 1))
    cache[(4, 5, 6)] = _SharedBlocks(("y", 2))
    assert len(cache) == 1
    assert list(cache.keys()) == [(4, 5, 6)]


def test_a_stored_key_is_not_affected_by_mutating_the_callers_array() -> None:
    cache = LlamaTrieCache(capacity_bytes=10**6)
    key = np.array([1, 2, 3])
    cache[key] = _SharedBlocks(("x", 1))
    key[0] = 9
    assert [1, 2, 3] in cache
    assert [9, 2, 3] not in cache


def test_oversized_replacement_drops_the_old_state() -> None:
    cache = LlamaTrieCache(capacity_bytes=100)
    cache[[1]] = _SharedBlocks(("small", 10))
    cache[[1]] = _SharedBlocks(("huge", 1000))
    assert [1] not in cache
    assert cache.cache_size == 0


def test_peek_reads_an_exact_key_without_touching_recency() -> None:
    cache = LlamaRAMCache(capacity_bytes=10**6)
    first, second = _SharedBlocks(("x", 1)), _SharedBlocks(("y", 1))
    cache[[1, 2, 3]] = first
    cache[[1, 2, 4]] = second
    assert cache.peek([1, 2, 3]) is first
    assert cache.peek([1, 2]) is None
    assert cache[[1, 2, 9]] is second  # still the most recently used
    assert cache.stats().hits == 1


@pytest.mark.parametrize("kind", [LlamaRAMCache, LlamaTrieCache])
def test_two_models_states_under_equal_keys_are_two_entries(kind: type) -> None:
    from tests.test_disk_cache import make_cut_state

    # One model's state under a key replaced the other's: a shared cache served each model half the time.
    cache = kind(capacity_bytes=10**7)
    cache[[1, 2, 3]] = make_cut_state([1, 2, 3], 600, fingerprint="model-a")
    cache[[1, 2, 3]] = make_cut_state([1, 2, 3], 900, fingerprint="model-b")
    cache[[9]] = make_cut_state([9], 300, fingerprint="model-b")
    assert len(cache) == 3
    assert cache[[1, 2, 3, 4]].fingerprint == "model-b"  # unbound: the best of every model, ties to the latest
    cache.bind("model-a")
    assert cache.fingerprint == "model-a"
    assert cache[[1, 2, 3, 4]].fingerprint == "model-a" and cache.match_length([1, 2, 3, 4]) == 3
    assert [9] not in cache and list(cache.keys()) == [(1, 2, 3)]
    with pytest.raises(KeyError):
        cache[[9]]
    cache.bind("model-b")
    assert cache[[1, 2, 3, 4]].fingerprint == "model-b" and cache[[9]].fingerprint == "model-b"
    del cache[[1, 2, 3]]  # the bound model's entry only
    cache.bind(None)
    assert cache[[1, 2, 3]].fingerprint == "model-a" and len(cache) == 2
    assert cache.cache_size == sum(size for state in (cache[[1, 2, 3]], cache[[9]])
                                   for _, size in memory_blocks(state))


def test_states_without_a_fingerprint_are_filed_under_the_bound_model() -> None:
    cache = LlamaRAMCache(capacity_bytes=10**7, fingerprint="model-a")
    cache[[1, 2, 3]] = _upstream_state(n_ctx=8, n_vocab=10, state_bytes=64)
    assert [1, 2, 3] in cache
    cache.bind("model-b")
    assert [1, 2, 3] not in cache
    with pytest.raises(TypeError):
        cache.bind(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        LlamaRAMCache(fingerprint="")


def _chat_turn() -> tuple[LlamaState, LlamaState, LlamaState]:
    """A state, a turn extended from it (holding a restore copy) and a view of that turn sharing the copy."""
    rng = np.random.default_rng(7)
    tokens = np.arange(40, dtype=np.int32)
    base = synthetic_state(tokens[:20], 64, rng)
    turn = base.extended(20, tokens[:30], None, 0, synthetic_state(tokens[:30], 64, rng).seq_bytes())
    view = turn.prefix(25, None)
    assert turn.restore_copy is not None and view.restore_copy is turn.restore_copy
    return base, turn, view


def _footprint(*states: LlamaState, copies: bool) -> int:
    blocks = {identity: size for state in states for identity, size in memory_blocks(state)}
    return sum(size for identity, size in blocks.items() if copies or not isinstance(identity, RestoreCopy))


@pytest.mark.parametrize("make", [LlamaRAMCache, LlamaTrieCache])
def test_restore_copies_are_charged_once_and_released_before_any_entry_is_evicted(make: Any) -> None:
    states = _chat_turn()
    copy = states[1].restore_copy
    assert copy is not None
    roomy = make(capacity_bytes=10**7)
    for state in states:
        roomy[state.tokens] = state
    assert roomy.cache_size == _footprint(*states, copies=True) > _footprint(*states, copies=False)

    tight = make(capacity_bytes=_footprint(*states, copies=False))
    for state in states:
        tight[state.tokens] = state
    assert len(tight) == 3 and tight.stats().evictions == 0
    assert copy.data is None and states[1].needs_assembly(0)
    assert tight.cache_size == _footprint(*states, copies=False)
    for state in states:
        del tight[state.tokens]
    assert tight.cache_size == 0
    # The roomy cache charged bytes that are gone now: it uncharges them before it evicts for room.
    roomy.capacity_bytes = _footprint(*states, copies=False)
    roomy[[99]] = _SharedBlocks(("other", 0))
    assert len(roomy) == 4 and roomy.stats().evictions == 0
    assert roomy.cache_size == _footprint(*states, copies=False)


def test_a_state_that_fits_only_without_its_copy_is_stored_without_it() -> None:
    _, turn, _ = _chat_turn()
    cache = LlamaRAMCache(capacity_bytes=_footprint(turn, copies=False))
    cache[turn.tokens] = turn
    assert len(cache) == 1 and cache.stats().rejected == 0
    assert turn.restore_copy is not None and turn.restore_copy.data is None
    assert cache.cache_size == _footprint(turn, copies=False)
