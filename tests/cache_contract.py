"""The contract every prefix cache keeps, as a mixin run by each tier's test module.

A tier's test module subclasses :class:`CacheContract`, says which lookup policy it has
(``longest_common_prefix``, ``whole_key_prefix``, or ``shared_prefix``: the longest common prefix with
any stored key, returned cut to that prefix, as the chunk-addressed Redis tier answers) and provides ``make_cache(capacity_bytes)`` and
``make_state(tokens, nbytes)``. ``make_state`` must return a value the tier can store whose charged size
is ``size_of(state)``; in-memory tiers use :class:`SizedState`, persistent ones real states.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest


class SizedState:
    """A stand-in value for cache tests: knows its tokens and its size, nothing else."""

    def __init__(self, tokens: Sequence[int], nbytes: int, fingerprint: str | None = None) -> None:
        self.tokens = tuple(tokens)
        self.nbytes = nbytes
        if fingerprint is not None:
            self.fingerprint = fingerprint


class CacheContract:
    policy: str = "longest_common_prefix"  # or "whole_key_prefix", "shared_prefix"

    def make_cache(self, capacity_bytes: int) -> Any:
        raise NotImplementedError

    def make_state(self, tokens: Sequence[int], nbytes: int = 1000) -> Any:
        return SizedState(tokens, nbytes)

    def make_state_of(self, tokens: Sequence[int], fingerprint: str) -> Any:
        """A state made in the namespace ``fingerprint`` (see ``namespaced_fingerprint``)."""
        return SizedState(tokens, 1000, fingerprint)

    def size_of(self, state: Any) -> int:
        return int(state.nbytes)

    def tokens_of(self, state: Any) -> tuple[int, ...]:
        return tuple(state.tokens)

    # -- lookups -----------------------------------------------------------------------------------

    def test_empty_cache_misses(self) -> None:
        cache = self.make_cache(10**6)
        with pytest.raises(KeyError):
            cache[[1, 2, 3]]
        assert [1, 2, 3] not in cache
        assert cache.cache_size == 0
        assert len(cache) == 0
        assert bool(cache) is True  # llama-cpp-python tests `if self.cache:`

    def test_exact_key_returns_the_stored_state(self) -> None:
        cache = self.make_cache(10**6)
        state = self.make_state([1, 2, 3])
        cache[[1, 2, 3]] = state
        assert self.tokens_of(cache[[1, 2, 3]]) == (1, 2, 3)
        assert (1, 2, 3) in cache

    def test_longer_query_hits_its_stored_prefix(self) -> None:
        cache = self.make_cache(10**6)
        cache[[1, 2]] = self.make_state([1, 2])
        cache[[1, 2, 3, 4]] = self.make_state([1, 2, 3, 4])
        cache[[9, 9]] = self.make_state([9, 9])
        assert self.tokens_of(cache[[1, 2, 3, 4, 5, 6]]) == (1, 2, 3, 4)
        if self.policy in ("whole_key_prefix", "shared_prefix"):
            assert self.tokens_of(cache[[1, 2, 7]]) == (1, 2)
        else:
            # Both keys share (1, 2) with the query: the tie goes to the most recently used.
            assert self.tokens_of(cache[[1, 2, 7]]) == (1, 2, 3, 4)

    def test_divergent_and_shorter_queries_follow_the_policy(self) -> None:
        cache = self.make_cache(10**6)
        cache[[5, 6, 7, 8]] = self.make_state([5, 6, 7, 8])
        if self.policy == "longest_common_prefix":
            # The stored key diverges from the query, or runs past its end: still the best entry,
            # returned untruncated.
            assert self.tokens_of(cache[[5, 6, 0]]) == (5, 6, 7, 8)
            assert self.tokens_of(cache[[5]]) == (5, 6, 7, 8)
            assert [5, 6, 0] in cache
        elif self.policy == "shared_prefix":
            assert self.tokens_of(cache[[5, 6, 0]]) == (5, 6)
            assert self.tokens_of(cache[[5]]) == (5,)
            assert [5, 6, 0] in cache
        else:
            with pytest.raises(KeyError):
                cache[[5, 6, 0]]
            with pytest.raises(KeyError):
                cache[[5]]
            assert [5, 6, 0] not in cache
        with pytest.raises(KeyError):
            cache[[4, 5, 6, 7, 8]]

    def test_a_namespace_answers_from_its_own_states_only(self) -> None:
        cache = self.make_cache(10**6)
        cache[[1, 2, 3, 4]] = self.make_state_of([1, 2, 3, 4], "a" * 32)
        cache[[1, 2, 3, 9]] = self.make_state_of([1, 2, 3, 9], "b" * 32)
        query = [1, 2, 3, 4, 5]
        assert cache.match_length(query, namespace="a" * 32) == 4
        assert self.tokens_of(cache.lookup_prefix(query, namespace="a" * 32))[:4] == (1, 2, 3, 4)
        assert cache.match_length(query, namespace="b" * 32) < 4  # its own [1, 2, 3, 9] at best
        assert self.tokens_of(cache.lookup_prefix([1, 2, 3, 9], namespace="b" * 32))[:4] == (1, 2, 3, 9)
        assert cache.match_length(query, namespace="c" * 32) == 0
        with pytest.raises(KeyError):
            cache.lookup_prefix(query, namespace="c" * 32)

    def test_empty_key_and_query(self) -> None:
        cache = self.make_cache(10**6)
        cache[[1]] = self.make_state([1])
        with pytest.raises(KeyError):
            cache[[]]
        if self.policy == "whole_key_prefix":
            cache[[]] = self.make_state([])
            assert self.tokens_of(cache[[7, 7]]) == ()
            assert self.tokens_of(cache[[1, 2]]) == (1,)
            assert [] in cache

    def test_ties_go_to_the_most_recently_used(self) -> None:
        cache = self.make_cache(10**6)
        cache[[1, 2, 3]] = self.make_state([1, 2, 3])
        cache[[1, 2, 4]] = self.make_state([1, 2, 4])
        if self.policy == "longest_common_prefix":
            assert self.tokens_of(cache[[1, 2, 9]]) == (1, 2, 4)
            cache[[1, 2, 3]]
            assert self.tokens_of(cache[[1, 2, 9]]) == (1, 2, 3)
        elif self.policy == "shared_prefix":
            assert self.tokens_of(cache[[1, 2, 9]]) == (1, 2)
        else:
            # Neither key prefixes the query: no tie to break, a miss.
            with pytest.raises(KeyError):
                cache[[1, 2, 9]]
            assert self.tokens_of(cache[[1, 2, 3, 9]]) == (1, 2, 3)

    # -- storage and the byte budget ---------------------------------------------------------------

    def test_replacing_a_key_never_overcounts(self) -> None:
        cache = self.make_cache(10**6)
        first = self.make_state([1, 2], nbytes=3000)
        second = self.make_state([1, 2], nbytes=5000)
        cache[[1, 2]] = first
        size_one = cache.cache_size
        cache[[1, 2]] = second
        assert len(cache) == 1
        assert cache.cache_size == size_one - self.size_of(first) + self.size_of(second)
        for _ in range(5):
            cache[[1, 2]] = self.make_state([1, 2], nbytes=5000)
        assert cache.cache_size == size_one - self.size_of(first) + self.size_of(second)

    def test_lru_eviction_keeps_the_budget(self) -> None:
        probe = self.make_state([0], nbytes=1000)
        capacity = 3 * self.size_of(probe) + self.size_of(probe) // 2
        cache = self.make_cache(capacity)
        for token in range(1, 4):
            cache[[token]] = self.make_state([token], nbytes=1000)
        cache[[1]]  # 1 becomes most recently used; 2 is now the oldest
        assert [2] in cache  # __contains__ does not touch recency
        cache[[4]] = self.make_state([4], nbytes=1000)
        assert cache.cache_size <= capacity
        assert [2] not in cache
        assert [1] in cache and [3] in cache and [4] in cache
        assert cache.stats().evictions == 1

    def test_value_larger_than_capacity_is_not_stored(self) -> None:
        small = self.make_state([1], nbytes=100)
        cache = self.make_cache(self.size_of(small) * 4)
        cache[[1]] = small
        cache[[2]] = self.make_state([2], nbytes=self.size_of(small) * 50)
        assert [2] not in cache
        assert [1] in cache
        assert cache.cache_size == self.size_of(small)
        assert cache.stats().rejected == 1

    def test_cache_size_tracks_entries(self) -> None:
        cache = self.make_cache(10**7)
        states = [self.make_state([i, i + 1], nbytes=1000 + i) for i in range(10)]
        for state in states:
            cache[list(self.tokens_of(state))] = state
        assert cache.cache_size == sum(self.size_of(s) for s in states)
        assert len(cache) == 10

    def test_stats_count_hits_and_misses(self) -> None:
        cache = self.make_cache(10**6)
        cache[[1, 2]] = self.make_state([1, 2])
        cache[[1, 2, 3]]
        with pytest.raises(KeyError):
            cache[[3]]
        [1, 2] in cache  # noqa: B015 - membership tests are not lookups
        stats = cache.stats()
        assert (stats.hits, stats.misses, stats.entries) == (1, 1, 1)
        assert stats.bytes == cache.cache_size

    # -- bad input ---------------------------------------------------------------------------------

    @pytest.mark.parametrize("bad_key", ["abc", 3, None, [1.5], [True, 2], [b"x"]])
    def test_bad_keys_raise_type_error(self, bad_key: Any) -> None:
        cache = self.make_cache(10**6)
        with pytest.raises(TypeError):
            cache[bad_key] = self.make_state([1])
        with pytest.raises(TypeError):
            cache[bad_key]
        with pytest.raises(TypeError):
            bad_key in cache  # noqa: B015

    def test_negative_tokens_raise_value_error(self) -> None:
        cache = self.make_cache(10**6)
        with pytest.raises(ValueError):
            cache[[1, -2]] = self.make_state([1, -2])
        with pytest.raises(ValueError):
            cache[[-1]]

    @pytest.mark.parametrize("capacity", [0, -5])
    def test_non_positive_capacity_raises_value_error(self, capacity: int) -> None:
        with pytest.raises(ValueError):
            self.make_cache(capacity)

    def test_non_int_capacity_raises_type_error(self) -> None:
        with pytest.raises(TypeError):
            self.make_cache("big")  # type: ignore[arg-type]

    # -- concurrency -------------------------------------------------------------------------------

    def test_concurrent_writers_and_readers_keep_the_budget(self) -> None:
        probe = self.make_state([0], nbytes=1000)
        capacity = 20 * self.size_of(probe)
        cache = self.make_cache(capacity)
        errors: list[BaseException] = []

        def worker(offset: int) -> None:
            try:
                for i in range(60):
                    key = [offset, i % 25, i]
                    cache[key] = self.make_state(key, nbytes=1000)
                    try:
                        found = cache[[offset, i % 25, i, 7]]
                        assert self.tokens_of(found)[0] == offset
                    except KeyError:
                        pass  # evicted by another thread between the store and the lookup
            except BaseException as error:  # noqa: BLE001 - surfaced through `errors`
                errors.append(error)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        assert 0 < cache.cache_size <= capacity
