"""Tests for llama_cache.index: RadixIndex against a naive oracle, plus examples and input validation."""

from __future__ import annotations

import array
import enum
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from llama_cache.index import Match, RadixIndex
from llama_cache import LlamaRAMCache, LlamaTrieCache
from llama_cache import tokens as tokens_module
from llama_cache.tokens import CheckedTokens, as_token_array, checked_tokens

# ------------------------------------------------------------------------------------------- helpers


def check_structure(index: RadixIndex[Any]) -> None:
    """Check the tree's structural invariants and its MRU pointers (white-box)."""
    root = index._root
    assert root.parent is None
    assert len(root.edge) == 0
    terminals = 0
    stack = [root]
    while stack:
        node = stack.pop()
        if node.stamp:
            terminals += 1
        if node is not root:
            assert len(node.edge) > 0, "empty edge"
            assert node.edge.dtype == np.int32 and node.edge.ndim == 1
            assert not node.edge.flags.writeable
            assert node.stamp or node.children, "empty non-terminal leaf"
            assert node.stamp or len(node.children) != 1, "non-terminal node with a single child"
        for first, child in node.children.items():
            assert type(first) is int
            assert first == int(child.edge[0]), "child dict key != edge[0]"
            assert child.parent is node, "broken parent pointer"
            stack.append(child)
        # `best` is the terminal node with the largest stamp in the subtree, found here by brute force.
        best = None
        sub = [node]
        while sub:
            n = sub.pop()
            if n.stamp and (best is None or n.stamp > best.stamp):
                best = n
            sub.extend(n.children.values())
        assert node.best is best, "stale MRU pointer"
    assert terminals == len(index)


def common_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Oracle:
    """A naive model: (key, value) pairs, least recently used first."""

    def __init__(self) -> None:
        self.entries: list[tuple[tuple[int, ...], int]] = []

    def find(self, key: tuple[int, ...]) -> int | None:
        for i, (k, _) in enumerate(self.entries):
            if k == key:
                return i
        return None

    def insert(self, key: tuple[int, ...], value: int) -> int | None:
        i = self.find(key)
        old = None if i is None else self.entries.pop(i)[1]
        self.entries.append((key, value))
        return old

    def touch(self, key: tuple[int, ...]) -> None:
        i = self.find(key)
        if i is None:
            raise KeyError(key)
        self.entries.append(self.entries.pop(i))

    def remove(self, key: tuple[int, ...]) -> int:
        i = self.find(key)
        if i is None:
            raise KeyError(key)
        return self.entries.pop(i)[1]

    def get(self, key: tuple[int, ...]) -> int | None:
        i = self.find(key)
        return None if i is None else self.entries[i][1]

    def longest_prefix(self, query: tuple[int, ...]) -> tuple[tuple[int, ...], int, int] | None:
        found = None
        for k, v in self.entries:
            if query[: len(k)] == k and (found is None or len(k) > len(found[0])):
                found = (k, v, len(k))
        return found

    def longest_common_prefix(self, query: tuple[int, ...]) -> tuple[tuple[int, ...], int, int] | None:
        found = None
        for k, v in self.entries:  # oldest first, so `>=` lets the most recently used win ties
            c = common_len(k, query)
            if c >= 1 and (found is None or c >= found[2]):
                found = (k, v, c)
        return found


def as_triple(match: Match[int] | None) -> tuple[tuple[int, ...], int, int] | None:
    return None if match is None else (match.key, match.value, match.common)


# --------------------------------------------------------------------------------- state machine

tokens = st.integers(min_value=0, max_value=3)
keys = st.lists(tokens, max_size=8).map(tuple)
queries = st.lists(tokens, max_size=10).map(tuple)
# Key and query forms accepted by the index: all must behave alike.
forms = st.sampled_from(
    [
        list,
        tuple,
        lambda k: np.array(k, dtype=np.int64),
        lambda k: np.array(k, dtype=np.int32),
        lambda k: np.array(k, dtype=np.uint16),
        lambda k: array.array("i", k),
    ]
)


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index: RadixIndex[int] = RadixIndex()
        self.oracle = Oracle()
        self.counter = 0

    def next_value(self) -> int:
        self.counter += 1
        return self.counter

    def stored(self) -> list[tuple[int, ...]]:
        return [k for k, _ in self.oracle.entries]

    @initialize(data=st.data())
    def seed(self, data: st.DataObject) -> None:
        for key in data.draw(st.lists(keys, max_size=6)):
            value = self.next_value()
            assert self.index.insert(key, value) == self.oracle.insert(key, value)

    @rule(key=keys, form=forms)
    def insert(self, key: tuple[int, ...], form) -> None:  # type: ignore[no-untyped-def]
        value = self.next_value()
        assert self.index.insert(form(key), value) == self.oracle.insert(key, value)

    @precondition(lambda self: self.oracle.entries)
    @rule(data=st.data())
    def replace(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self.stored()))
        value = self.next_value()
        old = self.oracle.insert(key, value)
        assert old is not None
        assert self.index.insert(key, value) == old

    @rule(key=keys)
    def remove(self, key: tuple[int, ...]) -> None:
        try:
            expected = self.oracle.remove(key)
        except KeyError:
            with pytest.raises(KeyError):
                self.index.remove(key)
        else:
            assert self.index.remove(key) == expected

    @precondition(lambda self: self.oracle.entries)
    @rule(data=st.data())
    def remove_stored(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self.stored()))
        assert self.index.remove(list(key)) == self.oracle.remove(key)

    @rule(key=keys)
    def touch(self, key: tuple[int, ...]) -> None:
        try:
            self.oracle.touch(key)
        except KeyError:
            with pytest.raises(KeyError):
                self.index.touch(key)
        else:
            self.index.touch(key)

    @precondition(lambda self: self.oracle.entries)
    @rule(data=st.data())
    def touch_stored(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self.stored()))
        self.oracle.touch(key)
        self.index.touch(np.array(key, dtype=np.int64))

    @rule(key=keys, form=forms)
    def get_and_contains(self, key: tuple[int, ...], form) -> None:  # type: ignore[no-untyped-def]
        expected = self.oracle.get(key)
        assert self.index.get(form(key)) == expected
        assert (form(key) in self.index) == (expected is not None)

    @rule(query=queries, form=forms)
    def longest_prefix(self, query: tuple[int, ...], form) -> None:  # type: ignore[no-untyped-def]
        assert as_triple(self.index.longest_prefix(form(query))) == self.oracle.longest_prefix(query)

    @rule(query=queries, form=forms)
    def longest_common_prefix(self, query: tuple[int, ...], form) -> None:  # type: ignore[no-untyped-def]
        expected = self.oracle.longest_common_prefix(query)
        assert as_triple(self.index.longest_common_prefix(form(query))) == expected

    @precondition(lambda self: self.oracle.entries)
    @rule(data=st.data())
    def longest_common_prefix_of_stored(self, data: st.DataObject) -> None:
        # Queries derived from stored keys (truncated, then extended) hit ties and mid-edge mismatches.
        key = data.draw(st.sampled_from(self.stored()))
        cut = data.draw(st.integers(0, len(key)))
        query = key[:cut] + data.draw(st.lists(tokens, max_size=3).map(tuple))
        expected = self.oracle.longest_common_prefix(query)
        assert as_triple(self.index.longest_common_prefix(query)) == expected
        assert as_triple(self.index.longest_prefix(query)) == self.oracle.longest_prefix(query)

    @precondition(lambda self: len(self.oracle.entries) > 8)
    @rule()
    def clear(self) -> None:
        self.index.clear()
        self.oracle.entries.clear()

    @invariant()
    def consistent(self) -> None:
        assert len(self.index) == len(self.oracle.entries)
        assert list(self.index.items()) == sorted(self.oracle.entries)
        check_structure(self.index)


IndexMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestIndexMachine = IndexMachine.TestCase


# --------------------------------------------------------------------------------------- examples


def edges(index: RadixIndex[Any]) -> list[tuple[int, ...]]:
    """Every edge of the tree, depth-first in token order."""
    out: list[tuple[int, ...]] = []

    def walk(node) -> None:  # type: ignore[no-untyped-def]
        for first in sorted(node.children):
            child = node.children[first]
            out.append(tuple(child.edge.tolist()))
            walk(child)

    walk(index._root)
    return out


def test_split_and_merge_on_divergence() -> None:
    index: RadixIndex[str] = RadixIndex()
    index.insert([1, 2, 3, 4], "a")
    assert edges(index) == [(1, 2, 3, 4)]
    index.insert([1, 2, 5], "b")
    assert edges(index) == [(1, 2), (3, 4), (5,)]
    assert index.remove([1, 2, 5]) == "b"
    assert edges(index) == [(1, 2, 3, 4)]
    check_structure(index)


def test_split_and_merge_on_inner_key() -> None:
    index: RadixIndex[str] = RadixIndex()
    index.insert((1, 2, 3, 4), "long")
    index.insert((1, 2), "short")
    assert edges(index) == [(1, 2), (3, 4)]
    assert index.get((1, 2)) == "short"
    assert (1, 2, 3) not in index
    assert index.remove((1, 2)) == "short"
    assert edges(index) == [(1, 2, 3, 4)]
    assert index.remove((1, 2, 3, 4)) == "long"
    assert edges(index) == []
    assert len(index) == 0


def test_prune_then_merge_parent() -> None:
    index: RadixIndex[int] = RadixIndex()
    for i, key in enumerate([(1, 2, 3), (1, 2, 4), (1, 5)]):
        index.insert(key, i)
    assert edges(index) == [(1,), (2,), (3,), (4,), (5,)]
    index.remove((1, 2, 3))
    assert edges(index) == [(1,), (2, 4), (5,)]
    index.remove((1, 5))
    assert edges(index) == [(1, 2, 4)]
    check_structure(index)


def test_longest_prefix() -> None:
    index: RadixIndex[str] = RadixIndex()
    assert index.longest_prefix([1, 2]) is None
    index.insert([1, 2], "a")
    index.insert([1, 2, 3, 4], "b")
    assert as_triple(index.longest_prefix([1, 2, 3])) == ((1, 2), "a", 2)
    assert as_triple(index.longest_prefix([1, 2, 3, 4, 5])) == ((1, 2, 3, 4), "b", 4)
    assert index.longest_prefix([1]) is None
    assert index.longest_prefix([]) is None
    index.insert([], "empty")
    assert as_triple(index.longest_prefix([9, 9])) == ((), "empty", 0)
    assert as_triple(index.longest_prefix([])) == ((), "empty", 0)


def test_longest_common_prefix_and_recency() -> None:
    index: RadixIndex[str] = RadixIndex()
    index.insert([1, 2, 3, 4], "a")
    index.insert([1, 2, 5, 6], "b")
    index.insert([7], "c")
    # A tie at common == 2: the most recently used key wins; lookups do not change recency.
    assert as_triple(index.longest_common_prefix([1, 2, 9])) == ((1, 2, 5, 6), "b", 2)
    assert index.get([1, 2, 3, 4]) == "a" and [1, 2, 3, 4] in index
    assert index.longest_prefix([1, 2, 3, 4]) is not None
    assert as_triple(index.longest_common_prefix([1, 2, 9])) == ((1, 2, 5, 6), "b", 2)
    index.touch([1, 2, 3, 4])
    assert as_triple(index.longest_common_prefix([1, 2, 9])) == ((1, 2, 3, 4), "a", 2)
    assert as_triple(index.longest_common_prefix([1])) == ((1, 2, 3, 4), "a", 1)
    # Re-inserting makes a key most recently used.
    index.insert([1, 2, 5, 6], "b2")
    assert as_triple(index.longest_common_prefix([1, 2])) == ((1, 2, 5, 6), "b2", 2)
    # The stored key may continue past the query or past the divergence point.
    assert as_triple(index.longest_common_prefix([1, 2, 3])) == ((1, 2, 3, 4), "a", 3)
    assert as_triple(index.longest_common_prefix([1, 2, 3, 9, 9])) == ((1, 2, 3, 4), "a", 3)
    assert as_triple(index.longest_common_prefix([7, 8])) == ((7,), "c", 1)
    # Nothing shared, or only the empty key: None.
    assert index.longest_common_prefix([8]) is None
    assert index.longest_common_prefix([]) is None
    index.insert([], "empty")
    assert index.longest_common_prefix([8]) is None
    # Removing the MRU key hands the tie back.
    index.remove([1, 2, 5, 6])
    index.touch([7])
    assert as_triple(index.longest_common_prefix([1, 2, 5])) == ((1, 2, 3, 4), "a", 2)


def test_none_values_and_replace() -> None:
    index: RadixIndex[str | None] = RadixIndex()
    assert index.insert([3], None) is None
    assert [3] in index
    assert index.get([3]) is None
    assert index.insert([3], "x") is None
    assert index.insert([3], "y") == "x"
    assert len(index) == 1
    assert index.remove([3]) == "y"
    with pytest.raises(KeyError):
        index.remove([3])
    with pytest.raises(KeyError):
        index.touch([3])


def test_items_clear_and_iteration_guard() -> None:
    index: RadixIndex[int] = RadixIndex()
    for i, key in enumerate([(2,), (1, 3), (), (1, 2, 3), (1,)]):
        index.insert(key, i)
    assert list(index.items()) == [((), 2), ((1,), 4), ((1, 2, 3), 3), ((1, 3), 1), ((2,), 0)]
    it = index.items()
    next(it)
    index.touch([2])  # recency changes are allowed while iterating
    next(it)
    index.insert([5], 5)
    with pytest.raises(RuntimeError):
        next(it)
    index.clear()
    assert len(index) == 0
    assert list(index.items()) == []
    assert index.longest_common_prefix([1]) is None
    index.insert([1], 1)
    assert index.get([1]) == 1


def test_numpy_and_other_inputs() -> None:
    index: RadixIndex[str] = RadixIndex()
    key = np.array([5, 6, 7, 8], dtype=np.int64)
    index.insert(key, "a")
    key[0] = 99  # the index copied the tokens
    assert index.get([5, 6, 7, 8]) == "a"
    forms: list[Any] = [
        np.array([5, 6, 7, 8], dtype=np.int32),
        np.array([5, 6, 7, 8], dtype=np.uint8),
        np.array([0, 5, 0, 6, 0, 7, 0, 8], dtype=np.int32)[1::2],  # non-contiguous
        array.array("q", [5, 6, 7, 8]),
        range(5, 9),
        (np.int64(5), 6, np.uint32(7), 8),
    ]
    for form in forms:
        assert form in index
    assert as_triple(index.longest_prefix(range(5, 20))) == ((5, 6, 7, 8), "a", 4)
    assert as_triple(index.longest_common_prefix(np.array([5, 6, 0], dtype=np.int16))) == ((5, 6, 7, 8), "a", 2)
    assert index.longest_common_prefix(range(10, 0, -1)) is None


def test_as_token_array_conversions() -> None:
    for tokens in ([1, 2, 2**31 - 1], (1, 2, 2**31 - 1), np.array([1, 2, 2**31 - 1], dtype=np.uint64)):
        out = as_token_array(tokens)
        assert out.dtype == np.int32 and out.ndim == 1
        assert out.tolist() == [1, 2, 2**31 - 1]
        assert not out.flags.writeable
    empties: list[Any] = [[], (), range(0), np.array([], dtype=np.int64), array.array("i")]
    for empty in empties:
        out = as_token_array(empty)
        assert out.dtype == np.int32 and out.shape == (0,)
    assert as_token_array(range(10, 0, -3)).tolist() == [10, 7, 4, 1]

    class Colour(enum.IntEnum):
        RED = 4

    assert as_token_array([Colour.RED, 1]).tolist() == [4, 1]
    # An int32 input is not copied, but the caller's array stays writeable.
    source = np.arange(4, dtype=np.int32)
    as_token_array(source)
    assert source.flags.writeable


@pytest.mark.parametrize(
    "bad",
    [
        "abc",
        b"\x01\x02",
        bytearray(b"\x01"),
        1.5,
        None,
        5,
        True,
        {1, 2},
        {1: 2},
        iter([1, 2]),
        [1.0, 2.0],
        [1, 2.5],
        [True, False],
        [1, True],
        [np.True_],
        [None],
        ["a"],
        [[1, 2]],
        [[1, 2], [3]],
        np.array([True, False]),
        np.array([1.0, 2.0]),
        np.array(["a"]),
        np.array(5),
        np.zeros((2, 2), dtype=np.int32),
        array.array("d", [1.0]),
    ],
    ids=repr,
)
def test_bad_types(bad: object) -> None:
    with pytest.raises(TypeError):
        as_token_array(bad)  # type: ignore[arg-type]
    index: RadixIndex[int] = RadixIndex()
    index.insert([1], 1)
    with pytest.raises(TypeError):
        index.insert(bad, 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        index.longest_common_prefix(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        bad in index  # type: ignore[operator]  # noqa: B015
    assert len(index) == 1


@pytest.mark.parametrize(
    "bad",
    [
        [-1],
        [1, 2**31],
        [2**63],
        [2**70],
        (0, -5),
        range(-1, 3),
        range(2**31 - 1, 2**31 + 1),
        np.array([-1], dtype=np.int32),
        np.array([3, -1], dtype=np.int8),
        np.array([2**31], dtype=np.int64),
        np.array([2**64 - 1], dtype=np.uint64),
        array.array("i", [-3]),
    ],
    ids=repr,
)
def test_bad_values(bad: object) -> None:
    with pytest.raises(ValueError):
        as_token_array(bad)  # type: ignore[arg-type]
    index: RadixIndex[int] = RadixIndex()
    with pytest.raises(ValueError):
        index.insert(bad, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        index.get(bad)  # type: ignore[arg-type]
    assert len(index) == 0


def test_nbytes_per_token() -> None:
    rng = np.random.default_rng(1234)
    index: RadixIndex[int] = RadixIndex()
    empty = index.nbytes()
    assert empty > 0
    total = 0
    for i in range(50):
        key = rng.integers(0, 50_000, size=2000)
        index.insert(key, i)
        total += len(key)
    per_token = index.nbytes() / total
    assert 4 <= per_token < 16, per_token
    # Removing everything gives the memory back (bar the root dict's grown hash table).
    for stored, _ in list(index.items()):
        index.remove(stored)
    assert index.nbytes() < empty + 4096


def test_long_shared_prefixes() -> None:
    # Many long keys sharing a long prefix: answers stay correct and the shared run is stored once.
    rng = np.random.default_rng(7)
    prefix = rng.integers(0, 1000, size=3000)
    index: RadixIndex[int] = RadixIndex()
    tails = {}
    for i in range(20):
        tail = rng.integers(0, 1000, size=500)
        tails[i] = tail
        index.insert(np.concatenate([prefix, tail]), i)
    check_structure(index)
    assert index.nbytes() < (3000 + 20 * 500) * 4 * 1.5
    query = np.concatenate([prefix, tails[3][:100], [5000]])
    match = index.longest_common_prefix(query)
    assert match is not None and match.value == 3 and match.common == 3100
    assert index.longest_prefix(query) is None
    assert as_triple(index.longest_common_prefix(prefix[:10])) == (
        tuple(np.concatenate([prefix, tails[19]]).tolist()), 19, 10
    )


def test_touch_match_marks_the_matched_key_most_recently_used() -> None:
    index: RadixIndex[str] = RadixIndex()
    index.insert([1, 2, 3], "a")
    index.insert([1, 2, 4], "b")
    match = index.longest_prefix([1, 2, 3, 7])
    assert match is not None and match.value == "a"
    index.touch_match(match)
    assert as_triple(index.longest_common_prefix([1, 2, 9])) == ((1, 2, 3), "a", 2)


# ------------------------------------------------------------------------------ numpy and checked queries


class _Plain(Sequence[int]):
    """A sequence that is neither a list nor an array: the path every element's type is looked at on."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: Any) -> Any:
        return self.items[index]


class _Value:
    """A stand-in state: one byte to the caches' accounting."""

    nbytes = 1
    llama_state_size = 1


def test_numpy_queries_answer_as_list_queries_on_random_keys() -> None:
    rng = np.random.default_rng(20261202)
    shared = [rng.integers(0, 50_000, size=int(rng.integers(50, 300))) for _ in range(4)]
    keys = [np.concatenate([shared[i % 4], rng.integers(0, 50_000, size=int(rng.integers(1, 400)))])
            for i in range(60)]
    caches = [LlamaRAMCache(capacity_bytes=10**9), LlamaTrieCache(capacity_bytes=10**9)]
    index: RadixIndex[int] = RadixIndex()
    values = [_Value() for _ in keys]
    for i, key in enumerate(keys):
        index.insert(key.tolist(), i)
        for cache in caches:
            cache[key.tolist()] = values[i]
    for _ in range(200):
        key = keys[int(rng.integers(len(keys)))]
        cut = int(rng.integers(0, len(key) + 1))
        listed = key[:cut].tolist() + rng.integers(0, 50_000, size=int(rng.integers(0, 200))).tolist()
        forms = [np.array(listed, dtype=np.int32), np.array(listed, dtype=np.intc), checked_tokens(listed)]
        for form in forms:
            assert as_triple(index.longest_prefix(form)) == as_triple(index.longest_prefix(listed))
            assert as_triple(index.longest_common_prefix(form)) == as_triple(index.longest_common_prefix(listed))
            for cache in caches:
                assert cache.match_length(form) == cache.match_length(listed)
                assert (form in cache) == (listed in cache)
                if listed in cache:
                    assert cache[form] is cache[listed]


def test_an_int32_array_is_taken_without_a_copy() -> None:
    for dtype in (np.int32, np.intc):
        source = np.arange(1, 2001, dtype=dtype)
        out = as_token_array(source)
        assert np.shares_memory(out, source) and not out.flags.writeable
        assert source.flags.writeable  # the caller's own array is left as it was
        checked = checked_tokens(source)
        assert np.shares_memory(np.asarray(checked), source)


def test_checked_tokens_are_validated_once_and_immutable(monkeypatch: pytest.MonkeyPatch) -> None:
    checked = checked_tokens([5, 6, 7, 8])
    assert checked_tokens(checked) is checked
    assert as_token_array(checked) is checked.array
    assert list(checked) == [5, 6, 7, 8] and len(checked) == 4 and checked[1] == 6
    assert isinstance(checked[1:3], CheckedTokens) and checked[1:3].tolist() == [6, 7]
    assert not checked.array.flags.writeable
    with pytest.raises(AttributeError):
        checked.array = np.zeros(1, dtype=np.int32)  # type: ignore[misc]
    # A radix index and a cache take it without converting again.
    calls = []
    monkeypatch.setattr(tokens_module, "_from_list", lambda tokens: calls.append(tokens))
    cache = LlamaRAMCache(capacity_bytes=10**6)
    index: RadixIndex[int] = RadixIndex()
    index.insert(checked, 1)
    assert index.get(checked) == 1 and cache.match_length(checked) == 0 and checked not in cache
    assert calls == []


BAD_LISTS: list[Any] = [
    [1.0, 2.0], [1, 2.5], [True, False], [1, True], [0, 5, True], [True, -1], [np.True_], [None], ["a"],
    [[1, 2]], [[1, 2], [3]], [np.float64(2.0)], [-1], [3, -7, 2], [1, 2**31], [2**63], [2**70], [-(2**31) - 1],
]


@pytest.mark.parametrize("bad", BAD_LISTS, ids=repr)
def test_lists_are_refused_as_any_sequence_is(bad: list[Any]) -> None:
    # The list path converts in one C loop; what it refuses, it refuses as the per-element path does.
    with pytest.raises((TypeError, ValueError)) as expected:
        as_token_array(_Plain(bad))
    for form in (bad, tuple(bad)):
        with pytest.raises(expected.type) as got:
            as_token_array(form)
        assert str(got.value) == str(expected.value)
        with pytest.raises(expected.type):
            checked_tokens(form)


@pytest.mark.parametrize(
    ("bad", "error"),
    [(np.array([-1, 2], dtype=np.int32), ValueError), (np.array([1.0, 2.0]), TypeError),
     (np.zeros((2, 2), dtype=np.int32), TypeError), (np.array([True]), TypeError),
     (np.array([2**31], dtype=np.int64), ValueError), ([3, -1], ValueError), ([1.5], TypeError)],
    ids=repr,
)
def test_bad_queries_are_refused_on_every_lookup_path(bad: Any, error: type[Exception]) -> None:
    cache = LlamaRAMCache(capacity_bytes=10**6)
    for call in (checked_tokens, cache.match_length, cache.__getitem__, cache.__contains__):
        with pytest.raises(error):
            call(bad)
