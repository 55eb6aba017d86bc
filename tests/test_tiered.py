"""TieredCache: the shared contract over RAM + disk, tier choice, promotion, write-behind, failing tiers,
exit and fork, and real completions on the default model."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from llama_cache import BaseLlamaCache, CacheStats, LlamaDiskCache, LlamaRAMCache, LlamaTrieCache, TieredCache
from llama_cache import tokens as tokens_module
from llama_cache.checkpoints import HybridCheckpointCache
from llama_cache.state.memory import memory_blocks
from tests.cache_contract import CacheContract
from tests.test_disk_cache import disk_size, make_cut_state
from tests.test_disk_cache import PLAIN_PROMPT, plain_cold_answer
from tests.test_disk_cache import make_state as make_opaque_state
from tests.test_index import common_len

REPO = Path(__file__).resolve().parents[1]


def ram_size(state: Any) -> int:
    return sum(size for _, size in memory_blocks(state))


def tokens_of(state: Any) -> tuple[int, ...]:
    return tuple(state.tokens.tolist())


# -- the contract ---------------------------------------------------------------------------------


class _TieredContract(CacheContract):
    """An in-memory tier in front of a disk tier, each given the share of the budget its copy of a
    state takes. What tiers legitimately change: sizes are the sums of both copies, each tier counts
    its own writes, evictions and rejections, and each tier's LRU order sees only its own traffic."""

    policy = "longest_common_prefix"
    fast: Any = LlamaRAMCache
    maker: Any = staticmethod(make_cut_state)

    @pytest.fixture(autouse=True)
    def _directory(self, open_cache: Any) -> None:
        self._open_disk = open_cache

    def make_cache(self, capacity_bytes: int) -> Any:
        fast = slow = capacity_bytes
        if isinstance(capacity_bytes, int) and capacity_bytes > 0:
            probe = self.make_state([0])
            fast = capacity_bytes * ram_size(probe) // self.size_of(probe)
            slow = capacity_bytes - fast
        return TieredCache([self.fast(capacity_bytes=fast), self._open_disk(slow)])

    def make_state(self, tokens: Sequence[int], nbytes: int = 1000) -> Any:
        return self.maker(tokens, nbytes)

    def make_state_of(self, tokens: Sequence[int], fingerprint: str) -> Any:
        return self.maker(tokens, 1000, fingerprint=fingerprint)

    def size_of(self, state: Any) -> int:
        return ram_size(state) + disk_size(state)

    def tokens_of(self, state: Any) -> tuple[int, ...]:
        return tokens_of(state)

    def test_replacing_a_key_never_overcounts(self) -> None:
        # Neither tier rewrites a state holding the same tokens as the stored one; one with logits
        # replaces one without, in both.
        cache = self.make_cache(10**6)
        first = self.make_state([1, 2], nbytes=3000)
        cache[[1, 2]] = first
        size_one = cache.cache_size
        for _ in range(3):
            cache[[1, 2]] = self.make_state([1, 2], nbytes=5000)
        assert len(cache) == 1 and cache.cache_size == size_one == self.size_of(first)
        assert [tier.writes for tier in cache.stats().tiers] == [1, 1]
        with_logits = self.maker([1, 2], 3000, logits=True)
        cache[[1, 2]] = with_logits
        assert len(cache) == 1 and cache.cache_size == self.size_of(with_logits)
        assert cache[[1, 2]].logits is not None
        assert [tier.writes for tier in cache.stats().tiers] == [2, 2]

    def test_lru_eviction_keeps_the_budget(self) -> None:
        probe = self.make_state([0], nbytes=1000)
        capacity = 3 * self.size_of(probe) + self.size_of(probe) // 2
        cache = self.make_cache(capacity)
        fast, slow = cache.tiers
        for token in range(1, 4):
            cache[[token]] = self.make_state([token], nbytes=1000)
        cache[[1]]  # served by the fast tier: only its recency changes
        assert [2] in cache
        cache[[4]] = self.make_state([4], nbytes=1000)
        assert cache.cache_size <= capacity
        # Each tier evicted its own least recently used entry.
        assert [2] not in fast and all([t] in fast for t in (1, 3, 4))
        assert [1] not in slow and all([t] in slow for t in (2, 3, 4))
        assert all([t] in cache for t in (1, 2, 3, 4))
        stats = cache.stats()
        assert [tier.evictions for tier in stats.tiers] == [1, 1] and stats.evictions == 2

    def test_value_larger_than_capacity_is_not_stored(self) -> None:
        small = self.make_state([1], nbytes=100)
        cache = self.make_cache(self.size_of(small) * 4)
        cache[[1]] = small
        cache[[2]] = self.make_state([2], nbytes=self.size_of(small) * 50)
        assert [2] not in cache
        assert [1] in cache
        assert cache.cache_size == self.size_of(small)
        assert [tier.rejected for tier in cache.stats().tiers] == [1, 1]


class TestTieredContract(_TieredContract):
    pass


class TestTieredContractRecurrentStates(_TieredContract):
    """States that cannot be cut back, behind a trie tier: both answer by whole-key prefix."""

    policy = "whole_key_prefix"
    fast = LlamaTrieCache
    maker = staticmethod(make_opaque_state)


# -- which tier answers, promotion -----------------------------------------------------------------


def test_each_tier_tells_how_much_of_a_query_it_holds_without_loading(open_cache: Any) -> None:
    tiers = ram, trie, disk = LlamaRAMCache(10**7), LlamaTrieCache(10**7), open_cache(write_behind=False)
    for tier in tiers:
        tier[[1, 2, 3, 4]] = make_cut_state([1, 2, 3, 4])
        tier[[9]] = make_opaque_state([9])  # cannot be cut back: answers only queries its key prefixes
    assert [tier.match_length([1, 2, 3, 7]) for tier in tiers] == [3, 0, 3]
    assert [tier.match_length([1, 2, 3, 4, 5]) for tier in tiers] == [4, 4, 4]
    assert [tier.match_length([1, 2]) for tier in tiers] == [2, 0, 2]
    assert [tier.match_length([9, 1]) for tier in tiers] == [1, 1, 1]
    assert [tier.match_length([5]) for tier in tiers] == [0, 0, 0]
    assert [tier.stats().hits + tier.stats().misses for tier in tiers] == [0, 0, 0]
    assert disk.lookup_prefix([1, 2, 3, 7]).n_tokens == 3  # what the disk tier's match length said
    with pytest.raises(TypeError):
        disk.match_length("abc")  # type: ignore[arg-type]


def test_a_lookup_converts_its_list_once_for_every_tier_and_index(
        open_cache: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    ram, trie, disk = LlamaRAMCache(10**7), LlamaTrieCache(10**7), open_cache(write_behind=False)
    cache = TieredCache([ram, trie, disk])
    disk[[1, 2, 3]] = make_cut_state([1, 2, 3], logits=True)
    conversions = []
    convert = tokens_module._from_list

    def counted(tokens: Any) -> Any:
        conversions.append(len(tokens))
        return convert(tokens)

    monkeypatch.setattr(tokens_module, "_from_list", counted)
    assert cache.match_length([1, 2, 3, 4]) == 3
    assert conversions == [4]
    assert tokens_of(cache.lookup_prefix([1, 2, 3, 5])) == (1, 2, 3)  # three tiers asked, one answering
    assert conversions == [4, 4]
    assert [1, 2, 3, 6] in cache
    assert conversions == [4, 4, 4]


def test_a_state_only_on_disk_is_promoted_and_then_served_from_ram(open_cache: Any) -> None:
    ram, disk = LlamaRAMCache(10**7), open_cache(write_behind=False)
    cache = TieredCache([ram, disk])
    disk[[1, 2, 3]] = make_cut_state([1, 2, 3], logits=True)
    found = cache[[1, 2, 3, 4]]
    assert tokens_of(found) == (1, 2, 3)
    assert ram.peek([1, 2, 3]) is found  # promoted at once, by reference
    assert (ram.stats().hits, disk.stats().hits) == (0, 1)
    assert cache[[1, 2, 3, 5]] is found
    assert (ram.stats().hits, disk.stats().hits) == (1, 1)
    cache.flush()
    assert disk.stats().writes == 1  # the promoted state never went back to the disk tier
    stats = cache.stats()
    assert (stats.hits, stats.misses) == (2, 0)
    assert stats.tiers == (ram.stats(), disk.stats())


def test_promotion_reaches_the_middle_tiers_in_the_background(open_cache: Any) -> None:
    ram, trie, disk = LlamaRAMCache(10**7), LlamaTrieCache(10**7), open_cache(write_behind=False)
    cache = TieredCache([ram, trie, disk])
    disk[[4, 5]] = make_cut_state([4, 5])
    found = cache[[4, 5, 6]]
    assert ram.peek([4, 5]) is found
    cache.flush()
    assert trie.peek([4, 5]) is found
    assert disk.stats().writes == 1


def test_the_longest_prefix_wins_over_the_fastest_tier(open_cache: Any) -> None:
    ram, disk = LlamaRAMCache(10**7), open_cache(write_behind=False)
    cache = TieredCache([ram, disk])
    ram[[1, 2, 3]] = make_cut_state([1, 2, 3])  # the system prompt
    disk[[1, 2, 3, 4, 5, 6]] = make_cut_state([1, 2, 3, 4, 5, 6])  # the whole conversation
    assert cache.match_length([1, 2, 3, 4, 5, 9]) == 5
    # Through lookup_prefix the disk tier reads only the shared prefix; that is what is promoted.
    shared = cache.lookup_prefix([1, 2, 3, 4, 5, 9])
    assert tokens_of(shared) == (1, 2, 3, 4, 5) and shared.logits is None
    assert ram.peek([1, 2, 3, 4, 5]) is shared
    whole = cache[[1, 2, 3, 4, 5, 6, 7]]
    assert tokens_of(whole) == (1, 2, 3, 4, 5, 6)
    assert (ram.stats().hits, disk.stats().hits) == (0, 2)
    # Equal matches go to the faster tier.
    assert tokens_of(cache[[1, 2, 3, 4, 5, 6, 8]]) == (1, 2, 3, 4, 5, 6)
    assert (ram.stats().hits, disk.stats().hits) == (1, 2)


class ExactTier(BaseLlamaCache):
    """A cache answering exact keys only, with the default ``match_length`` (it cannot tell)."""

    def __init__(self) -> None:
        super().__init__(10**9)
        self.states: dict[tuple[int, ...], Any] = {}

    @property
    def cache_size(self) -> int:
        return sum(ram_size(state) for state in self.states.values())

    def __getitem__(self, key: Sequence[int]) -> Any:
        return self.states[tuple(int(t) for t in key)]

    def __contains__(self, key: Sequence[int]) -> bool:  # type: ignore[override]
        return tuple(int(t) for t in key) in self.states

    def __setitem__(self, key: Sequence[int], value: Any) -> None:
        self.states[tuple(int(t) for t in key)] = value

    def __len__(self) -> int:
        return len(self.states)

    def stats(self) -> CacheStats:
        return CacheStats(0, 0, len(self.states), self.cache_size, self.capacity_bytes, 0, 0)


def test_a_tier_that_cannot_tell_its_match_length_is_still_tried() -> None:
    ram, exact = LlamaRAMCache(10**7), ExactTier()
    cache = TieredCache([ram, exact])
    assert exact.match_length([7, 8]) == 0
    exact[[7, 8]] = make_cut_state([7, 8])
    assert cache.match_length([7, 8]) == 0
    found = cache[[7, 8]]
    assert ram.peek([7, 8]) is found
    with pytest.raises(KeyError):
        cache[[6, 9]]
    assert (cache.stats().hits, cache.stats().misses) == (1, 1)


# -- write-behind ---------------------------------------------------------------------------------


class GatedTier(LlamaRAMCache):
    """A RAM cache whose stores wait for the test to open a gate: a slow tier at the test's pace."""

    def __init__(self) -> None:
        super().__init__(10**8)
        self.gate = threading.Event()
        self.entered = threading.Semaphore(0)

    def __setitem__(self, key: Sequence[int], value: Any) -> None:
        self.entered.release()
        if not self.gate.wait(timeout=60):
            raise TimeoutError("the test never opened the gate")
        super().__setitem__(key, value)


def test_stores_reach_the_slower_tiers_in_the_background() -> None:
    ram, slow = LlamaRAMCache(10**7), GatedTier()
    cache = TieredCache([ram, slow])
    state = make_cut_state([1, 2])
    cache[[1, 2]] = state  # returns while the slow tier is still closed
    assert ram.peek([1, 2]) is state and [1, 2] not in slow
    assert cache[[1, 2, 3]] is state  # lookups do not wait for the queue
    slow.gate.set()
    cache.flush()
    assert slow.peek([1, 2]) is state
    cache.close()


def test_a_full_queue_drops_the_oldest_states_and_counts_them() -> None:
    ram, slow = LlamaRAMCache(10**7), GatedTier()
    cache = TieredCache([ram, slow], max_pending=2)
    cache[[1]] = make_cut_state([1])
    assert slow.entered.acquire(timeout=60)  # the writer is inside the slow tier with state 1
    for token in range(2, 7):
        cache[[token]] = make_cut_state([token])  # the queue holds two: 2 and 3, then 4, are dropped
    assert all([token] in ram for token in range(1, 7))
    slow.gate.set()
    cache.flush()
    assert sorted(slow.keys()) == [(1,), (5,), (6,)]
    stats = cache.stats()
    assert stats.dropped == 3 and stats.store_errors == 0
    cache.close()


# -- failing tiers --------------------------------------------------------------------------------


class BrokenTier(BaseLlamaCache):
    """A tier whose every operation fails, as an unreachable server would; it cannot tell its match
    length (the default)."""

    def __init__(self) -> None:
        super().__init__(1000)

    @property
    def cache_size(self) -> int:
        raise OSError("unreachable")

    def __getitem__(self, key: Sequence[int]) -> Any:
        raise OSError("unreachable")

    def __contains__(self, key: Sequence[int]) -> bool:  # type: ignore[override]
        raise OSError("unreachable")

    def __setitem__(self, key: Sequence[int], value: Any) -> None:
        raise OSError("unreachable")

    def __len__(self) -> int:
        raise OSError("unreachable")

    def stats(self) -> CacheStats:
        raise OSError("unreachable")


class BrokenIndexTier(BrokenTier):
    """A failing tier whose match length fails too."""

    def match_length(self, key: Sequence[int]) -> int:
        raise OSError("unreachable")


@pytest.mark.parametrize("broken_first", [False, True])
@pytest.mark.parametrize("broken_kind", [BrokenTier, BrokenIndexTier])
def test_a_failing_tier_never_breaks_stores_or_lookups(
    broken_first: bool, broken_kind: type[BrokenTier], caplog: pytest.LogCaptureFixture
) -> None:
    ram, broken = LlamaRAMCache(10**7), broken_kind()
    cache = TieredCache([broken, ram] if broken_first else [ram, broken])
    state = make_cut_state([1, 2, 3])
    with caplog.at_level(logging.DEBUG, logger="llama_cache"):
        for _ in range(3):
            cache[[1, 2, 3]] = state
        cache.flush()
        assert cache[[1, 2, 3, 4]] is state
        assert cache.lookup_prefix([1, 2, 3, 4]) is state
        assert [1, 2, 3] in cache and [9] not in cache
        with pytest.raises(KeyError):
            cache[[9]]
        assert len(cache) == 1 and cache.cache_size == ram.cache_size
        stats = cache.stats()
    # Three stores fail; with the broken tier first, so do the promotions of the two hits.
    assert stats.store_errors == (5 if broken_first else 3) and stats.lookup_errors >= 2
    assert (stats.hits, stats.misses) == (2, 1)
    index = 0 if broken_first else 1
    assert stats.tiers[index] == CacheStats(0, 0, 0, 0, 1000, 0, 0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # Once per operation and exception type: the store, the lookup, the counting.
    assert len([w for w in warnings if "failed to store" in w]) == 1
    assert len([w for w in warnings if "failed to look up" in w]) == 1
    assert all(f"tier {index} (" in w for w in warnings)
    cache.close()


# -- bad input ------------------------------------------------------------------------------------


def test_bad_tiers_and_arguments_are_refused() -> None:
    ram = LlamaRAMCache(10**6)
    with pytest.raises(ValueError):
        TieredCache([])
    with pytest.raises(ValueError):
        TieredCache([ram, ram])
    with pytest.raises(TypeError):
        TieredCache(ram)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        TieredCache([ram, {}])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="prompt cache, got HybridCheckpointCache"):
        TieredCache([ram, HybridCheckpointCache.__new__(HybridCheckpointCache)])

    class _NotATier(LlamaRAMCache):
        usable_as_tier = False

    assert ram.usable_as_tier and not HybridCheckpointCache.usable_as_tier
    with pytest.raises(TypeError, match="prompt cache, got _NotATier"):
        TieredCache([ram, _NotATier(10**6)])
    with pytest.raises(ValueError):
        TieredCache([ram], max_pending=0)
    with pytest.raises(TypeError):
        TieredCache([ram], max_pending=2.5)  # type: ignore[arg-type]


def test_capacity_is_the_sum_and_bind_reaches_the_disk_tier(open_cache: Any) -> None:
    disk = open_cache(5000)  # room for 5000 bytes of entries, on top of what an empty disk cache takes
    cache = TieredCache([LlamaRAMCache(3000), disk])
    total = 3000 + disk.capacity_bytes
    assert cache.capacity_bytes == total and cache.stats().capacity_bytes == total
    assert cache.fingerprint is None
    cache.bind("model-a")
    assert disk.fingerprint == cache.fingerprint == "model-a"
    assert TieredCache([LlamaRAMCache(3000)]).fingerprint is None  # nothing to bind


# -- exit and fork --------------------------------------------------------------------------------

_FORKER = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    from llama_cache import LlamaDiskCache, LlamaRAMCache, LlamaState, TieredCache

    def make_state(tokens, nbytes):
        return LlamaState(np.asarray(tokens, dtype=np.int32), None, 0, "test", opaque=np.zeros(nbytes, np.uint8))

    cache = TieredCache([LlamaRAMCache(), LlamaDiskCache(sys.argv[1], write_behind=False)])
    disk = cache.tiers[1]
    for i in range(5):
        cache[[2, i]] = make_state([2, i], 200_000)  # still queued when fork() comes: drained first
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            assert all([2, i] in disk for i in range(5))
            cache[[3]] = make_state([3], 1000)  # the child's own writer
            cache.flush()
            assert [3] in disk
        except BaseException as error:
            print("child failed:", repr(error), file=sys.stderr)
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert [3] in disk  # the parent sees what the child stored
    cache[[4]] = make_state([4], 1000)
    cache[[5]] = make_state([5], 1000)
    # No flush, no close: the queued writes are drained at exit.
    """
)


def test_fork_and_exit_drain_the_queue(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    result = _run_python(_FORKER, str(directory))
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and result.stderr == ""
    disk = LlamaDiskCache(directory, write_behind=False)
    try:
        assert sorted(disk.keys()) == [(2, 0), (2, 1), (2, 2), (2, 3), (2, 4), (3,), (4,), (5,)]
    finally:
        disk.close()


def _run_python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO)


# -- a real model ---------------------------------------------------------------------------------

_PROMPT = (
    "The library keeps the model state of every prompt it has seen, in memory and on disk, so a new "
    "process can answer a longer question without evaluating its start again. Question: what is the "
    "capital of France? Answer:"
)
_SUFFIX = " Please answer in one short sentence. Answer:"

_MODEL_CHILD = textwrap.dedent(
    """
    import json, sys
    import llama_cache
    from llama_cache import Llama, LlamaDiskCache, LlamaRAMCache, TieredCache

    directory, text = sys.argv[1], sys.argv[2]
    llm = Llama(model_path=str(llama_cache.default_model_path()), n_ctx=1024, verbose=False, seed=0)
    cache = TieredCache([LlamaRAMCache(), LlamaDiskCache(directory)])
    llm.set_cache(cache)
    out = llm.create_completion(text, max_tokens=16, temperature=0)
    stats = cache.stats()
    ram, disk = stats.tiers
    print(json.dumps([out["choices"][0]["text"], llm.last_prompt_tokens_evaluated, stats.hits,
                      ram.hits, disk.hits, ram.entries]))
    cache.close()
    """
)


@pytest.mark.model
def test_a_new_process_with_an_empty_ram_tier_hits_from_disk(tmp_path: Path) -> None:
    import llama_cache
    from llama_cache import Llama

    llm = Llama(model_path=str(llama_cache.default_model_path()), n_ctx=1024, verbose=False, seed=0)
    longer = _PROMPT + _SUFFIX
    llm.reset()
    cold = llm.create_completion(longer, max_tokens=16, temperature=0)["choices"][0]["text"]
    cold_evaluated = llm.last_prompt_tokens_evaluated
    llm.reset()
    directory = tmp_path / "cache"
    cache = TieredCache([LlamaRAMCache(), LlamaDiskCache(directory)])
    llm.set_cache(cache)
    assert cache.fingerprint == llm.fingerprint  # set_cache bound the disk tier
    first = llm.create_completion(_PROMPT, max_tokens=16, temperature=0)["choices"][0]["text"]
    cache.close()
    prompt_tokens = llm.tokenize(_PROMPT.encode())
    completion_tokens = llm.tokenize(first.encode(), add_bos=False)
    longer_tokens = llm.tokenize(longer.encode())
    shared = max(common_len(longer_tokens, prompt_tokens), common_len(longer_tokens, prompt_tokens + completion_tokens))

    result = _run_python(_MODEL_CHILD, str(directory), longer)
    assert result.returncode == 0, result.stderr
    text, evaluated, hits, ram_hits, disk_hits, ram_entries = json.loads(result.stdout)
    assert text == cold
    assert evaluated == len(longer_tokens) - shared < cold_evaluated  # only the new tokens
    assert hits == 1 and (ram_hits, disk_hits) == (0, 1)
    assert ram_entries >= 2  # the promoted prefix, and what the completion stored


@pytest.mark.model
def test_a_plain_llama_cpp_llama_uses_the_tiered_cache(tmp_path: Path) -> None:
    import llama_cpp

    import llama_cache

    model = str(llama_cache.default_model_path())
    cold = plain_cold_answer(model)
    directory = tmp_path / "cache"
    llm = llama_cpp.Llama(model_path=model, n_ctx=512, verbose=False, seed=0)
    cache = TieredCache([LlamaRAMCache(), LlamaDiskCache(directory)])
    llm.set_cache(cache)
    first = llm(PLAIN_PROMPT, max_tokens=16, temperature=0)["choices"][0]["text"]
    second = llm(PLAIN_PROMPT, max_tokens=16, temperature=0)["choices"][0]["text"]
    assert first == second == cold
    stats = cache.stats()
    assert stats.hits == 1 and stats.tiers[0].hits == 1 and stats.tiers[1].writes >= 1
    cache.close()

    # A new, empty RAM tier in front of the same directory: the disk tier serves llama-cpp-python's
    # own state, which is promoted.
    fresh = TieredCache([LlamaRAMCache(), LlamaDiskCache(directory)])
    llm.set_cache(fresh)
    llm.reset()
    third = llm(PLAIN_PROMPT, max_tokens=16, temperature=0)["choices"][0]["text"]
    assert third == cold
    ram, disk = fresh.stats().tiers
    assert fresh.stats().hits == 1 and (ram.hits, disk.hits) == (0, 1) and ram.entries >= 1
    fresh.close()


def test_write_through_stores_in_every_tier_before_returning() -> None:
    class Recording(LlamaRAMCache):
        """Records the thread each store ran in."""

        threads: list[threading.Thread] = []

        def __setitem__(self, key: Sequence[int], value: Any) -> None:
            self.threads.append(threading.current_thread())
            super().__setitem__(key, value)

    for write_through in (True, False):
        slow = Recording(capacity_bytes=10**8)
        slow.threads = []
        tiered = TieredCache([LlamaRAMCache(capacity_bytes=10**8), slow], write_through=write_through)
        try:
            key = [1, 2, 3, 4]
            tiered[key] = make_cut_state(key)
            tiered.flush()
            assert slow.match_length(key) == len(key)
            # Write-through stores in the caller's thread, before returning; otherwise the writer does.
            assert (slow.threads == [threading.current_thread()]) == write_through
        finally:
            tiered.close()
