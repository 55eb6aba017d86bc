"""HybridCheckpointCache on the real llama.cpp, with the tiny recurrent and hybrid models.

The round trip runs on all four architectures through ``Llama.eval``; the bookkeeping tests (lookup,
eviction, modes, invalidation) run on the LFM2 hybrid through a raw context with two sequences.
"""

from __future__ import annotations

import array
import ctypes
import dataclasses
import gc
import hashlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest

from llama_cache.caches.base import CacheStats
from llama_cache.checkpoints import registry
from llama_cache.checkpoints import (
    HybridCheckpoint,
    HybridCheckpointCache,
    notify_memory_cleared,
    notify_seq_changed,
    notify_seq_kept,
    notify_seq_removed,
)
from llama_cache.testing.tiny_models import TINY_ARCHITECTURES

HYBRIDS = ("lfm2", "granitehybrid")

PROMPT = (
    "The history of the lighthouse is, in large part, a history of trade. Long before electric lamps, keepers "
    "burned wood, coal and later whale oil on tall stone towers so that merchant ships could find the harbour."
)
OTHER = "Quantum computers store information in qubits, which can be in a superposition of zero and one."
CONTINUATION = " Visitors climb the spiral stairs to see the old lens up close, then walk down to the harbour."
CHUNKS = (5, 1, 3, 7)  # continuation chunk sizes; the rest goes in one last chunk

NATIVE_REFS = (
    "_get_size_ext",
    "_get_data_ext",
    "_set_data_ext",
    "_get_memory",
    "_seq_pos_min",
    "_seq_pos_max",
    "_seq_rm",
)


# ------------------------------------------------------------------------------------------------ helpers


def tokens_of(llm: llama_cpp.Llama, text: str) -> list[int]:
    return llm.tokenize(text.encode("utf-8"), add_bos=False)


def chunked(tokens: Sequence[int]) -> list[list[int]]:
    pieces: list[list[int]] = []
    start = 0
    for size in CHUNKS:
        pieces.append(list(tokens[start : start + size]))
        start += size
    pieces.append(list(tokens[start:]))
    return [piece for piece in pieces if piece]


def last_logits(ctx: int, n_vocab: int) -> np.ndarray:
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()


def eval_chunks(llm: llama_cpp.Llama, tokens: Sequence[int]) -> list[np.ndarray]:
    """Evaluate ``tokens`` in the CHUNKS chunking through Llama.eval; the last-token logits of each chunk."""
    out = []
    for piece in chunked(tokens):
        llm.eval(piece)
        out.append(last_logits(llm._ctx.ctx, llm.n_vocab()))
    return out


def full_seq_size(ctx: int, seq_id: int = 0) -> int:
    """Size of the whole sequence state (attention KV included): it grows with the cells the seq holds."""
    return int(llama_cpp.llama_state_seq_get_size_ext(ctx, seq_id, 0))


def pos_max(ctx: int, seq_id: int = 0) -> int:
    return int(llama_cpp.llama_memory_seq_pos_max(llama_cpp.llama_get_memory(ctx), seq_id))


class RawContext:
    """A second llama.cpp context on a loaded model, with two sequences and explicit per-sequence decoding."""

    def __init__(self, model: Any, n_vocab: int) -> None:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = 512
        params.n_batch = 512
        params.n_ubatch = 512
        params.n_seq_max = 2
        params.n_threads = params.n_threads_batch = 1
        self.ctx = llama_cpp.llama_init_from_model(model, params)
        assert self.ctx
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.n_vocab = n_vocab
        self._batch = llama_cpp.llama_batch_init(512, 0, 1)

    def decode(self, tokens: Sequence[int], seq_id: int = 0) -> np.ndarray:
        """Append ``tokens`` to ``seq_id``; return the last token's logits."""
        start = pos_max(self.ctx, seq_id) + 1
        batch = self._batch
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = start + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq_id
            batch.logits[i] = i == len(tokens) - 1
        assert llama_cpp.llama_decode(self.ctx, batch) == 0
        return last_logits(self.ctx, self.n_vocab)

    def close(self) -> None:
        llama_cpp.llama_batch_free(self._batch)
        llama_cpp.llama_free(self.ctx)


def count_native_calls(cache: HybridCheckpointCache) -> dict[str, int]:
    """Wrap the cache's cached llama.cpp references with call counters."""
    counts = dict.fromkeys(NATIVE_REFS, 0)
    for name in NATIVE_REFS:
        original = getattr(cache, name)

        def wrapper(*args: Any, _name: str = name, _original: Callable[..., Any] = original) -> Any:
            counts[_name] += 1
            return _original(*args)

        setattr(cache, name, wrapper)
    return counts


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(params=TINY_ARCHITECTURES)
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _open(path: Path) -> llama_cpp.Llama:
    # One thread: the models are tiny, and idle ggml workers only compete for the cores.
    return llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=1, n_threads_batch=1, verbose=False)


@pytest.fixture
def llm(arch: str, tiny_model_paths: dict[str, Path]) -> Iterator[llama_cpp.Llama]:
    model = _open(tiny_model_paths[arch])
    try:
        yield model
    finally:
        model.close()


@pytest.fixture(scope="module")
def lfm2(tiny_model_paths: dict[str, Path]) -> Iterator[llama_cpp.Llama]:
    model = _open(tiny_model_paths["lfm2"])
    try:
        yield model
    finally:
        model.close()


@pytest.fixture
def raw(lfm2: llama_cpp.Llama) -> Iterator[RawContext]:
    context = RawContext(lfm2.model, lfm2.n_vocab())
    try:
        yield context
    finally:
        # Closing a context first closes the caches registered on it (its address may be reused).
        for cache in registry._caches_on(context.ctx):
            cache.close()
        context.close()


@pytest.fixture
def prompt(lfm2: llama_cpp.Llama) -> list[int]:
    tokens = tokens_of(lfm2, PROMPT)
    assert len(tokens) >= 32
    return tokens[:32]


@pytest.fixture
def other(lfm2: llama_cpp.Llama) -> list[int]:
    tokens = tokens_of(lfm2, OTHER)
    assert len(tokens) >= 16
    return tokens


def save_along(
    cache: HybridCheckpointCache, raw: RawContext, tokens: Sequence[int], stops: Sequence[int], seq_id: int = 0
) -> list[HybridCheckpoint]:
    """Decode ``tokens`` into ``seq_id`` up to each stop in turn, saving a checkpoint at each; return them."""
    saved = []
    done = pos_max(raw.ctx, seq_id) + 1
    for stop in stops:
        raw.decode(tokens[done:stop], seq_id)
        done = stop
        assert cache.save_checkpoint(stop, tokens, seq_id)
        found = cache.find_best_checkpoint(tokens[:stop], seq_id)
        assert found is not None and found.pos == stop
        saved.append(found)
    return saved


# ------------------------------------------------------------------------------------ round trip, all models


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
def test_restore_gives_bit_identical_logits(arch: str, llm: llama_cpp.Llama, on_device: bool) -> None:
    ctx = llm._ctx.ctx
    text = tokens_of(llm, PROMPT)
    continuation = tokens_of(llm, CONTINUATION)
    other = tokens_of(llm, OTHER)[:6]
    cache = HybridCheckpointCache(ctx, on_device=on_device)

    llm.reset()
    llm.eval(text)
    assert cache.save_checkpoint(llm.n_tokens, text)
    full_at_save = full_seq_size(ctx)
    first = eval_chunks(llm, continuation)
    history = text + continuation
    if not on_device:  # device mode keeps one checkpoint per sequence: this would replace the first
        assert cache.save_checkpoint(llm.n_tokens, history)
        assert len(cache) == 2

    cp = cache.find_best_checkpoint(text + other)
    assert cp is not None and cp.pos == len(text) and cp.seq_id == 0
    assert cp.pos_max == len(text) - 1 and cp.hash_val == cache._hash_prefix(text, len(text))
    assert cache.restore_checkpoint(cp)

    assert pos_max(ctx) == cp.pos_max
    if arch in HYBRIDS:
        # The memory's pos_max of a hybrid is the min of its two parts, so it says nothing about the attention
        # part; the full sequence state, which counts the attention cells, shows the suffix is gone.
        assert full_seq_size(ctx) == full_at_save
    assert cache.checkpoints == [cp]  # the later checkpoint lay beyond the restored point
    llm.n_tokens = cp.pos
    second = eval_chunks(llm, continuation)
    assert len(first) == len(second) == len(chunked(continuation))
    for a, b in zip(first, second, strict=True):
        assert np.isfinite(a).all()
        assert np.array_equal(a, b)
    assert cache.find_best_checkpoint(history) is cp  # restoring keeps the restored checkpoint usable


@pytest.mark.parametrize("arch", HYBRIDS)
def test_suffix_removal_is_what_trims_the_attention_memory(arch: str, llm: llama_cpp.Llama) -> None:
    """Control: without the seq_rm after a PARTIAL_ONLY restore, a hybrid decodes fine but gives other logits."""
    ctx = llm._ctx.ctx
    n_vocab = llm.n_vocab()
    text = tokens_of(llm, PROMPT)[:40]
    continuation = tokens_of(llm, CONTINUATION)[:8]

    def run(skip_removal: bool) -> tuple[int, np.ndarray]:
        """Save after ``text``, evaluate the continuation, restore, decode it again: (full size, logits)."""
        llm.reset()
        llm.eval(text)
        cache = HybridCheckpointCache(ctx)
        assert cache.save_checkpoint(len(text), text)
        llm.eval(continuation)
        if skip_removal:
            cache._seq_rm = lambda *args: True
        cp = cache.find_best_checkpoint(text)
        assert cp is not None and cache.restore_checkpoint(cp)
        size = full_seq_size(ctx)
        # Raw decode, positions from the memory: unlike Llama.eval it removes nothing first.
        tokens = (llama_cpp.llama_token * len(continuation))(*continuation)
        assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(tokens, len(continuation))) == 0
        cache.close()
        return size, last_logits(ctx, n_vocab)

    llm.reset()
    llm.eval(text)
    size_at_save = full_seq_size(ctx)
    llm.eval(continuation)
    expected = last_logits(ctx, n_vocab)

    size_ok, logits_ok = run(skip_removal=False)
    size_bad, logits_bad = run(skip_removal=True)
    assert size_ok == size_at_save < size_bad
    assert np.array_equal(logits_ok, expected)
    assert not np.array_equal(logits_bad, expected)


# ------------------------------------------------------------------------------------------------ lookup


def test_find_best_picks_the_longest_matching_prefix(raw: RawContext, prompt: list[int], other: list[int]) -> None:
    cache = HybridCheckpointCache(raw.ctx)
    at8, at16, at24 = save_along(cache, raw, prompt, (8, 16, 24))
    assert [cp.pos for cp in cache.checkpoints] == [8, 16, 24]
    assert [cp.pos_max for cp in cache.checkpoints] == [7, 15, 23]

    assert cache.find_best_checkpoint(prompt[:20] + other[:3]) is at16
    assert cache.find_best_checkpoint(prompt) is at24
    assert cache.find_best_checkpoint(prompt[:24]) is at24  # pos == len(tokens) qualifies
    assert cache.find_best_checkpoint(np.array(prompt[:23], dtype=np.int64)) is at16
    assert cache.find_best_checkpoint(prompt[:8] + other) is at8
    assert cache.find_best_checkpoint(prompt[:7]) is None
    assert cache.find_best_checkpoint([]) is None

    # A different prompt of the same length as a checkpoint does not match it.
    same_length = other[:24]
    assert cache._hash_prefix(same_length, 24) != at24.hash_val
    assert cache.find_best_checkpoint(same_length) is None
    changed_first = [other[0], *prompt[1:24]]
    assert cache.find_best_checkpoint(changed_first) is None

    # Another sequence has no checkpoints; restoring into the wrong sequence is refused and changes nothing.
    assert cache.find_best_checkpoint(prompt, seq_id=1) is None
    assert cache.restore_checkpoint(at24, seq_id=1) is False
    assert cache.checkpoints == [at8, at16, at24]

    stats = cache.stats()
    assert isinstance(stats, CacheStats)
    assert (stats.hits, stats.misses, stats.entries, stats.bytes) == (3 + 5, 5, 3, 3 * at8.size)


def test_hash_prefix_follows_the_spec(prompt: list[int]) -> None:
    def reference(tokens: Sequence[int], length: int) -> str:
        return hashlib.sha256(array.array("i", tokens[:length]).tobytes()).hexdigest()[:32]

    hash_prefix = HybridCheckpointCache._hash_prefix
    assert hash_prefix(prompt, 0) == hash_prefix(prompt, -3) == "empty"
    assert hash_prefix([], 5) == reference([], 5)  # as the spec: "empty" is decided before clamping
    assert hash_prefix(prompt, 10) == reference(prompt, 10)
    assert hash_prefix(np.array(prompt), 10) == reference(prompt, 10)
    assert hash_prefix(prompt, 10_000) == reference(prompt, len(prompt))  # clamped
    assert len(hash_prefix(prompt, 10)) == 32


def test_save_validates_its_arguments(raw: RawContext, prompt: list[int]) -> None:
    cache = HybridCheckpointCache(raw.ctx)
    raw.decode(prompt[:8])
    with pytest.raises(ValueError, match="current_pos"):
        cache.save_checkpoint(9, prompt[:8])
    with pytest.raises(ValueError, match="current_pos"):
        cache.save_checkpoint(-1, prompt)
    with pytest.raises(ValueError, match="seq_id"):
        cache.save_checkpoint(8, prompt, seq_id=-1)
    with pytest.raises(TypeError):
        cache.save_checkpoint(8, "not tokens")  # type: ignore[arg-type]
    assert len(cache) == 0


# ------------------------------------------------------------------------------------------------ eviction


def test_fifo_eviction_by_count(raw: RawContext, prompt: list[int]) -> None:
    cache = HybridCheckpointCache(raw.ctx, max_checkpoints=3)
    saved = save_along(cache, raw, prompt, (4, 8, 12))
    size = saved[0].size
    assert cache.checkpoints == saved and cache.cache_size == 3 * size

    saved += save_along(cache, raw, prompt, (16,))
    assert cache.checkpoints == saved[1:]
    saved += save_along(cache, raw, prompt, (20,))
    assert cache.checkpoints == saved[2:]
    assert [cp.pos for cp in cache.checkpoints] == [12, 16, 20]
    assert cache.cache_size == 3 * size and len(cache) == 3
    assert cache.stats().evictions == 2
    assert cache.find_best_checkpoint(prompt[:11]) is None  # the evicted ones are gone from the index
    assert cache.restore_checkpoint(saved[0]) is False  # and stale


def test_fifo_eviction_by_bytes(raw: RawContext, prompt: list[int]) -> None:
    raw.decode(prompt[:4])
    size = int(llama_cpp.llama_state_seq_get_size_ext(raw.ctx, 0, llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY))
    cache = HybridCheckpointCache(raw.ctx, max_bytes=2 * size + size // 2)
    assert cache.save_checkpoint(4, prompt)
    saved = [cache.checkpoints[0]]
    saved += save_along(cache, raw, prompt, (8, 12, 16))
    assert all(cp.size == size for cp in saved)
    assert cache.checkpoints == saved[2:]
    assert cache.cache_size == 2 * size
    stats = cache.stats()
    assert (stats.evictions, stats.rejected, stats.capacity_bytes) == (2, 0, 2 * size + size // 2)


def test_a_checkpoint_larger_than_max_bytes_is_refused_before_extraction(raw: RawContext, prompt: list[int]) -> None:
    raw.decode(prompt[:4])
    cache = HybridCheckpointCache(raw.ctx, max_bytes=1)
    calls = count_native_calls(cache)
    assert cache.save_checkpoint(4, prompt) is False
    assert calls["_get_data_ext"] == 0 and calls["_get_size_ext"] == 1
    assert len(cache) == 0 and cache.stats().rejected == 1


def test_saving_the_same_prefix_replaces(raw: RawContext, prompt: list[int]) -> None:
    cache = HybridCheckpointCache(raw.ctx)
    (first,) = save_along(cache, raw, prompt, (8,))
    assert cache.save_checkpoint(8, [*prompt[:8], 1, 2, 3])
    second = cache.find_best_checkpoint(prompt)
    assert second is not None and second is not first and second == first
    assert cache.checkpoints == [second] and cache.cache_size == second.size
    assert cache.restore_checkpoint(first) is False  # equal, but no longer registered
    assert cache.restore_checkpoint(second)


# ------------------------------------------------------------------------------------------------ modes


@pytest.mark.parametrize("max_checkpoints", [0, -1])
def test_disabled_cache_never_calls_llama_cpp(raw: RawContext, prompt: list[int], max_checkpoints: int) -> None:
    raw.decode(prompt[:8])
    cache = HybridCheckpointCache(raw.ctx, max_checkpoints=max_checkpoints)
    calls = count_native_calls(cache)
    assert cache.save_checkpoint(8, prompt) is False
    assert cache.find_best_checkpoint(prompt) is None
    manual = HybridCheckpoint(pos=8, data=b"x", hash_val="h", size=1, seq_id=0, pos_min=0, pos_max=7)
    assert cache.restore_checkpoint(manual) is False
    assert sum(calls.values()) == 0
    assert len(cache) == 0 and cache.cache_size == 0


def test_device_mode_keeps_one_checkpoint_per_sequence(raw: RawContext, prompt: list[int], other: list[int]) -> None:
    device = HybridCheckpointCache(raw.ctx, on_device=True)
    assert device._flags == llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY | llama_cpp.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE
    (old,) = save_along(device, raw, prompt, (8,))
    (new,) = save_along(device, raw, prompt, (16,))
    assert device.checkpoints == [new]
    assert device.restore_checkpoint(old) is False  # its device slot was overwritten
    (seq1,) = save_along(device, raw, other, (8,), seq_id=1)
    assert device.checkpoints == [new, seq1]

    # Saving into the slot of seq 0 from another device cache on the context drops this cache's seq-0 checkpoint;
    # host checkpoints do not live in the slot and stay.
    host = HybridCheckpointCache(raw.ctx)
    (host_cp,) = save_along(host, raw, prompt, (20,))
    device2 = HybridCheckpointCache(raw.ctx, on_device=True)
    (newest,) = save_along(device2, raw, prompt, (24,))
    assert device.checkpoints == [seq1]
    assert host.checkpoints == [host_cp]
    assert device.restore_checkpoint(new) is False
    assert device2.restore_checkpoint(newest)
    assert device.restore_checkpoint(seq1, seq_id=1)
    assert host.cache_size == host_cp.size > device.cache_size == seq1.size  # device: host-visible bytes only


def test_stale_objects_are_refused_after_clear(raw: RawContext, prompt: list[int]) -> None:
    cache = HybridCheckpointCache(raw.ctx)
    (cp,) = save_along(cache, raw, prompt, (8,))
    assert cache.restore_checkpoint(dataclasses.replace(cp)) is False  # an equal copy is not the object
    assert cp in cache.checkpoints
    cache.clear()
    assert len(cache) == 0 and cache.cache_size == 0
    assert cache.find_best_checkpoint(prompt) is None
    assert cache.restore_checkpoint(cp) is False


# ------------------------------------------------------------------------------------------------ construction


def test_constructor_arguments(raw: RawContext) -> None:
    with pytest.raises(ValueError, match="None"):
        HybridCheckpointCache(None)
    with pytest.raises(ValueError, match="null"):
        HybridCheckpointCache(0)
    with pytest.raises(TypeError):
        HybridCheckpointCache("ctx")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_bytes"):
        HybridCheckpointCache(raw.ctx, max_bytes=0)
    with pytest.raises(TypeError):
        HybridCheckpointCache(raw.ctx, max_checkpoints=2.5)  # type: ignore[arg-type]
    cache = HybridCheckpointCache(ctypes.c_void_p(raw.ctx))
    assert cache.stats() == CacheStats(0, 0, 0, 0, cache.capacity_bytes, 0, 0)
    assert cache._flags == llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
    assert bool(cache) is True


def test_mapping_interface_is_disabled(raw: RawContext) -> None:
    cache = HybridCheckpointCache(raw.ctx)
    with pytest.raises(NotImplementedError, match="save_checkpoint"):
        cache[[1, 2]]
    with pytest.raises(NotImplementedError, match="save_checkpoint"):
        cache[[1, 2]] = object()
    with pytest.raises(NotImplementedError, match="save_checkpoint"):
        [1, 2] in cache  # noqa: B015


# ------------------------------------------------------------------------------------------------ invalidation


def test_notify_memory_cleared(raw: RawContext, lfm2: llama_cpp.Llama, prompt: list[int], other: list[int]) -> None:
    first = HybridCheckpointCache(raw.ctx)
    second = HybridCheckpointCache(raw.ctx)
    save_along(first, raw, prompt, (8,))
    save_along(second, raw, other, (8,), seq_id=1)
    elsewhere = HybridCheckpointCache(lfm2._ctx.ctx)
    lfm2.reset()
    lfm2.eval(prompt[:8])
    assert elsewhere.save_checkpoint(8, prompt)

    llama_cpp.llama_memory_clear(raw.memory, True)
    notify_memory_cleared(raw.ctx)
    assert len(first) == len(second) == 0
    assert len(elsewhere) == 1
    elsewhere.close()


def test_notify_seq_removed(raw: RawContext, prompt: list[int], other: list[int]) -> None:
    cache = HybridCheckpointCache(raw.ctx)
    at8, at16, _ = save_along(cache, raw, prompt, (8, 16, 24))  # pos_max 7, 15, 23
    (seq1,) = save_along(cache, raw, other, (8,), seq_id=1)

    notify_seq_removed(raw.ctx, 0, 10, 10)  # an empty range removes nothing
    assert len(cache) == 4
    notify_seq_removed(raw.ctx, 0, 16, -1)  # pos_max 15 < 16 survives, 23 does not
    assert cache.checkpoints == [at8, at16, seq1]
    notify_seq_removed(raw.ctx, 0, 15, -1)  # the removal starts at at16's last position
    assert cache.checkpoints == [at8, seq1]
    notify_seq_removed(raw.ctx, 0, 2, 4)  # a hole in the middle breaks every later checkpoint
    assert cache.checkpoints == [seq1]
    notify_seq_removed(raw.ctx, -1, -1, -1)  # every sequence, every position
    assert cache.checkpoints == []


def test_notify_seq_changed_and_kept(raw: RawContext, prompt: list[int], other: list[int]) -> None:
    cache = HybridCheckpointCache(raw.ctx)
    (seq0,) = save_along(cache, raw, prompt, (8,))
    (seq1,) = save_along(cache, raw, other, (8,), seq_id=1)
    notify_seq_changed(raw.ctx, 0)
    assert cache.checkpoints == [seq1]
    assert cache.restore_checkpoint(seq0) is False
    notify_seq_changed(raw.ctx, -1)
    assert cache.checkpoints == []

    (seq0_again,) = save_along(cache, raw, prompt, (16,))
    (seq1_again,) = save_along(cache, raw, other, (16,), seq_id=1)
    notify_seq_kept(raw.ctx, 1)
    assert cache.checkpoints == [seq1_again]
    assert cache.restore_checkpoint(seq0_again) is False


def test_drop_checkpoints_touches_only_this_cache(raw: RawContext, prompt: list[int], other: list[int]) -> None:
    cache = HybridCheckpointCache(raw.ctx)
    neighbour = HybridCheckpointCache(raw.ctx)
    at8, at16 = save_along(cache, raw, prompt, (8, 16))
    (seq1,) = save_along(cache, raw, other, (8,), seq_id=1)
    (theirs,) = save_along(neighbour, raw, prompt, (24,))
    cache.drop_checkpoints(0, lambda checkpoint: checkpoint.pos > 8)
    assert cache.checkpoints == [at8, seq1] and cache.cache_size == at8.size + seq1.size
    assert cache.restore_checkpoint(at16) is False
    cache.drop_checkpoints(-1, lambda checkpoint: checkpoint.seq_id == 1)
    assert cache.checkpoints == [at8]
    assert neighbour.checkpoints == [theirs]
    assert cache.stats().evictions == 0


def test_restore_drops_later_and_divergent_checkpoints_in_every_cache(
    raw: RawContext, prompt: list[int], other: list[int]
) -> None:
    mine = HybridCheckpointCache(raw.ctx)
    theirs = HybridCheckpointCache(raw.ctx)
    at4, at8, at16 = save_along(mine, raw, prompt, (4, 8, 16))
    (at24,) = save_along(theirs, raw, prompt, (24,))
    (seq1,) = save_along(theirs, raw, other, (8,), seq_id=1)

    assert mine.restore_checkpoint(at8)
    assert pos_max(raw.ctx) == 7
    assert mine.checkpoints == [at4, at8]
    assert theirs.checkpoints == [seq1]
    assert mine.restore_checkpoint(at16) is False and theirs.restore_checkpoint(at24) is False

    # A rollback to at4 the cache is not told of (raw API), then another branch. at8 stays registered although
    # its history is gone; restoring a checkpoint of the new branch drops it too, though it is not beyond the
    # restored point, because its prefix is not a prefix of the restored one.
    buffer = (ctypes.c_uint8 * at4.size).from_buffer_copy(at4.data)
    partial = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
    assert llama_cpp.llama_state_seq_set_data_ext(raw.ctx, buffer, at4.size, 0, partial) == at4.size
    assert llama_cpp.llama_memory_seq_rm(raw.memory, 0, 4, -1)
    branch = prompt[:4] + other[:8]
    branch8, branch12 = save_along(mine, raw, branch, (8, 12))
    assert mine.checkpoints == [at4, at8, branch8, branch12]
    assert mine.restore_checkpoint(branch12)
    assert mine.checkpoints == [at4, branch8, branch12]
    assert mine.restore_checkpoint(at8) is False
    assert mine.find_best_checkpoint(prompt) is at4


def test_restore_failures(raw: RawContext, prompt: list[int], other: list[int]) -> None:
    mine = HybridCheckpointCache(raw.ctx)
    theirs = HybridCheckpointCache(raw.ctx)

    def fill() -> tuple[HybridCheckpoint, HybridCheckpoint]:
        llama_cpp.llama_memory_clear(raw.memory, True)
        notify_memory_cleared(raw.ctx)
        (cp,) = save_along(mine, raw, prompt, (8,))
        save_along(theirs, raw, prompt, (16,))
        (seq1,) = save_along(theirs, raw, other, (8,), seq_id=1)
        return cp, seq1

    # A size mismatch is a preliminary rejection: nothing is invalidated. (The sequence is emptied behind
    # the cache's back, so its PARTIAL_ONLY state no longer has the checkpoint's size.)
    cp, seq1 = fill()
    llama_cpp.llama_memory_seq_rm(raw.memory, 0, -1, -1)
    assert mine.restore_checkpoint(cp) is False
    assert mine.checkpoints == [cp] and len(theirs) == 2

    # The native load reads too few bytes: every checkpoint of the sequence goes, in every cache.
    cp, seq1 = fill()
    set_data_ext, seq_rm = mine._set_data_ext, mine._seq_rm
    mine._set_data_ext = lambda *args: 0
    assert mine.restore_checkpoint(cp) is False
    assert mine.checkpoints == [] and theirs.checkpoints == [seq1]
    mine._set_data_ext = set_data_ext

    # The suffix removal fails.
    cp, seq1 = fill()
    mine._seq_rm = lambda *args: False
    assert mine.restore_checkpoint(cp) is False
    assert mine.checkpoints == [] and theirs.checkpoints == [seq1]
    mine._seq_rm = seq_rm

    # A native call raises: the exception propagates after the invalidation.
    cp, seq1 = fill()

    def boom(*args: Any) -> int:
        raise RuntimeError("native failure")

    mine._set_data_ext = boom
    with pytest.raises(RuntimeError, match="native failure"):
        mine.restore_checkpoint(cp)
    assert mine.checkpoints == [] and theirs.checkpoints == [seq1]


def test_close(raw: RawContext, prompt: list[int]) -> None:
    cache = HybridCheckpointCache(raw.ctx)
    (cp,) = save_along(cache, raw, prompt, (8,))
    address = raw.ctx
    assert cache in registry._registry[address].caches
    cache.close()
    assert cache.closed and len(cache) == 0 and cache.cache_size == 0
    assert cache.restore_checkpoint(cp) is False
    assert cache.find_best_checkpoint(prompt) is None
    assert cache.save_checkpoint(8, prompt) is False
    assert address not in registry._registry
    cache.close()  # idempotent
    notify_memory_cleared(raw.ctx)  # reaches no cache, raises nothing


def test_registry_holds_caches_weakly(raw: RawContext) -> None:
    cache = HybridCheckpointCache(raw.ctx)
    ref = weakref.ref(cache)
    del cache
    gc.collect()
    assert ref() is None
    assert raw.ctx not in registry._registry


# ------------------------------------------------------------------------------------------------ misc


def test_verbose_logs_to_the_module_logger_only(
    raw: RawContext, prompt: list[int], caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG, logger="llama_cache.checkpoints")
    cache = HybridCheckpointCache(raw.ctx, max_checkpoints=1, verbose=True)
    save_along(cache, raw, prompt, (4, 8))
    cache.clear()
    messages = [record.getMessage() for record in caplog.records if record.name == "llama_cache.checkpoints"]
    assert any("evict" in message for message in messages)
    assert any("cleared" in message for message in messages)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""

    caplog.clear()
    quiet = HybridCheckpointCache(raw.ctx, max_checkpoints=1)
    save_along(quiet, raw, prompt, (12, 16))
    assert not caplog.records


def test_concurrent_use_keeps_the_books_straight(raw: RawContext, prompt: list[int]) -> None:
    raw.decode(prompt[:8])
    cache = HybridCheckpointCache(raw.ctx, max_checkpoints=5)
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for i in range(25):
                key = [*prompt[:8], offset, i]
                assert cache.save_checkpoint(len(key), key)
                cache.find_best_checkpoint(key)
                assert len(cache) <= 5
        except BaseException as error:  # reported to the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(cache) == 5
    assert cache.cache_size == sum(cp.size for cp in cache.checkpoints)
    assert cache.stats().evictions == 4 * 25 - 5
