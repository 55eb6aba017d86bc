"""The KV pool's zeroed pages handed back (llama_cache/engine/kv_pages.py): on blocks glibc really maps,
while they are being zeroed and after, and on the engine's context with the default model."""

from __future__ import annotations

import ctypes
import mmap
import platform
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from llama_cache import Engine
from llama_cache.context_lock import MAKING_CONTEXTS
from llama_cache.engine import context as context_module
from llama_cache.engine.kv_pages import KvPageWatch, anonymous_ranges, kv_bytes, pool_cells, release_zeroed_block

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                                reason="Linux's /proc and madvise, glibc's block layout")

SIZE = 48 << 20  # well past glibc's largest threshold for serving a block from its heap (32 MiB)


def _resident_pages(address: int, length: int) -> int:
    """How many of the pages in ``[address, address + length)`` are in memory (``mincore``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pages = (length + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vector = (ctypes.c_ubyte * pages)()
    start = address // mmap.PAGESIZE * mmap.PAGESIZE
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(address + length - start), vector) == 0
    return sum(byte & 1 for byte in vector)


def _heap_bytes() -> int:
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith("[heap]"):
            start, _, end = line.split()[0].partition("-")
            return int(end, 16) - int(start, 16)
    return 0


@contextmanager
def _glibc_block() -> Iterator[tuple[list[tuple[int, int]], int]]:
    """A block as ggml allocates a KV buffer (``posix_memalign(64, SIZE)``), mapped by glibc of its own,
    not written yet, with the mappings read just before it was made."""
    libc = ctypes.CDLL(None)
    held: list[ctypes.c_void_p] = []
    try:
        # A block past glibc's mmap threshold is mapped of its own unless a free chunk of the heap fits it
        # (after other tests freed large buffers): such blocks are held aside, at most the heap's size of
        # them, until one is mapped (IS_MMAPPED in its header).
        for _ in range(_heap_bytes() // SIZE + 2):
            before = anonymous_ranges()
            pointer = ctypes.c_void_p()
            assert libc.posix_memalign(ctypes.byref(pointer), 64, ctypes.c_size_t(SIZE)) == 0
            held.append(pointer)
            address = int(pointer.value or 0)
            if ctypes.c_uint64.from_address(address - 8).value & 2:
                break
        assert ctypes.c_uint64.from_address(address - 8).value & 2, "glibc mapped no block of its own"
        yield before, address
    finally:
        for pointer in held:
            libc.free(pointer)


@pytest.fixture
def aligned_block() -> Iterator[tuple[list[tuple[int, int]], int]]:
    """A :func:`_glibc_block` zeroed as llama.cpp zeroes it."""
    with _glibc_block() as (before, address):
        ctypes.memset(address, 0, SIZE)
        yield before, address


def _view(address: int) -> npt.NDArray[np.uint8]:
    return np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(ctypes.c_uint8)), shape=(SIZE,))


def test_a_zeroed_block_is_handed_back_and_still_reads_and_writes(aligned_block: tuple[list, int]) -> None:
    before, address = aligned_block
    assert _resident_pages(address, SIZE) >= SIZE // mmap.PAGESIZE - 1
    released = release_zeroed_block(before, SIZE)
    assert SIZE - 2 * mmap.PAGESIZE <= released < SIZE
    assert _resident_pages(address, SIZE) <= 2  # the pages holding the block's ends, shared with its header
    view = _view(address)
    assert not view.any()  # zeros still
    view[SIZE // 2] = 7
    view[-1] = 9
    assert view[SIZE // 2] == 7 and view[-1] == 9 and int(view.sum()) == 16


def test_a_block_holding_data_is_left_alone(aligned_block: tuple[list, int]) -> None:
    before, address = aligned_block
    view = _view(address)
    view[SIZE // 3] = 1
    assert release_zeroed_block(before, SIZE) == 0
    assert view[SIZE // 3] == 1 and _resident_pages(address, SIZE) >= SIZE // mmap.PAGESIZE - 1


def test_only_a_block_of_the_size_asked_for_made_since_then_is_released(aligned_block: tuple[list, int]) -> None:
    before, address = aligned_block
    assert release_zeroed_block(before, SIZE - mmap.PAGESIZE) == 0  # another size
    assert release_zeroed_block(before, SIZE + mmap.PAGESIZE) == 0
    assert release_zeroed_block(anonymous_ranges(), SIZE) == 0  # mapped before "before"
    assert _resident_pages(address, SIZE) >= SIZE // mmap.PAGESIZE - 1


def test_a_plain_malloc_block_is_not_taken_for_one(aligned_block: tuple[list, int]) -> None:
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    before = anonymous_ranges()
    address = libc.malloc(ctypes.c_size_t(SIZE))  # another allocation's layout (numpy's, say)
    try:
        ctypes.memset(address, 0, SIZE)
        assert release_zeroed_block(before, SIZE) == 0
        assert _resident_pages(address, SIZE) >= SIZE // mmap.PAGESIZE - 1
    finally:
        libc.free(ctypes.c_void_p(address))


def test_pages_zeroed_so_far_are_handed_back_while_the_block_is_made() -> None:
    with KvPageWatch(SIZE, follow=False) as watch, _glibc_block() as (_, address):
        half = SIZE // 2
        ctypes.memset(address, 0, half)  # the zeroing half done
        released = watch.poll()
        assert watch.block == address - 64
        front = 512 * mmap.PAGESIZE  # the last pages zeroed are left to the zeroing
        assert half - front - 2 * mmap.PAGESIZE <= released <= half - front
        assert _resident_pages(address, half) <= 512 + 1
        ctypes.memset(address + half, 0x5A, SIZE - half)  # then something else writes: never handed back
        assert watch.poll() == 0
        view = _view(address)
        assert not view[:half].any() and bool((view[half:] == 0x5A).all())
        assert _resident_pages(address + half, SIZE - half) >= (SIZE - half) // mmap.PAGESIZE - 1
        assert watch.finish(SIZE) == 0  # not zero throughout: the rest is kept
        assert bool((view[half:] == 0x5A).all())
        assert watch.released_while_made == released


def test_a_block_zeroed_while_watched_is_handed_back_while_and_after() -> None:
    with KvPageWatch(SIZE) as watch, _glibc_block() as (_, address):
        for _ in range(500):  # zeroed as llama.cpp zeroes it, outside the GIL, until the thread has acted
            ctypes.memset(address, 0, SIZE)
            if watch.released_while_made:
                break
        assert watch.released_while_made > 0
        released = watch.finish(SIZE)
        assert SIZE - 2 * mmap.PAGESIZE <= released < SIZE
        assert _resident_pages(address, SIZE) <= 2
        view = _view(address)
        assert not view.any()
        view[123] = 4
        assert int(view.sum()) == 4


def test_two_blocks_of_the_size_are_both_left_alone_at_the_end() -> None:
    with KvPageWatch(SIZE, follow=False) as watch, _glibc_block() as (_, first), _glibc_block() as (_, second):
        ctypes.memset(first, 0, SIZE)
        ctypes.memset(second, 0, SIZE)
        watch.poll()
        assert watch.block in (first - 64, second - 64)
        assert watch.finish(SIZE) == 0  # which one the context's is cannot be told
        assert not _view(first).any() and not _view(second).any()


def test_a_watch_without_a_size_looks_for_nothing() -> None:
    with KvPageWatch(None) as watch, _glibc_block() as (_, address):
        ctypes.memset(address, 0, SIZE)
        assert watch.poll() == 0 and watch.block is None
        assert watch.finish(None) == 0
        assert _resident_pages(address, SIZE) >= SIZE // mmap.PAGESIZE - 1


def test_another_size_is_not_taken_for_the_block() -> None:
    with KvPageWatch(SIZE - mmap.PAGESIZE, follow=False) as watch, _glibc_block() as (_, address):
        ctypes.memset(address, 0, SIZE)
        assert watch.poll() == 0 and watch.block is None
        assert watch.finish(SIZE - mmap.PAGESIZE) == 0
        assert _resident_pages(address, SIZE) >= SIZE // mmap.PAGESIZE - 1


def test_one_context_is_made_at_a_time_and_the_lock_is_let_go_on_errors() -> None:
    with KvPageWatch(SIZE) as watch:
        assert MAKING_CONTEXTS.locked()
        watch.finish(SIZE)
        assert MAKING_CONTEXTS.locked()  # until the block ends
    assert not MAKING_CONTEXTS.locked()
    with pytest.raises(RuntimeError), KvPageWatch(SIZE):
        raise RuntimeError("llama.cpp failed")
    assert not MAKING_CONTEXTS.locked()
    assert not [thread for thread in threading.enumerate() if thread.name == "llama-cache-kv-pages"]


def _anonymous_rss() -> int:
    return int(next(line.split()[1] for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith("RssAnon:"))) * 1024


def _answer(engine: Engine) -> str:
    request = engine.submit([{"role": "user", "content": "Name three colours and say why."}], max_tokens=24,
                            temperature=0)
    return str(request.result()["choices"][0]["message"]["content"])


@pytest.mark.model
def test_the_engine_holds_only_the_kv_pages_its_cells_use_and_answers_as_before(
        monkeypatch: pytest.MonkeyPatch) -> None:
    before = _anonymous_rss()
    with Engine(n_ctx=16_384, parallel=2, n_threads=2) as engine:
        size = kv_bytes(engine.model, engine.context.n_ctx)
        assert size == 16_384 * 30 * 3 * (64 + 64) * 2  # the default model: 30 layers, 3 KV heads of 64
        assert size - 2 * mmap.PAGESIZE <= engine.context.kv_bytes_released < size
        released = _answer(engine)
        assert _anonymous_rss() - before < size // 2  # the model, buffers and touched cells: not the pool's 360 MiB
    with monkeypatch.context() as patched:  # the same engine with every page of its pool kept
        patched.setattr(context_module, "kv_bytes", lambda *_: None)
        with Engine(n_ctx=16_384, parallel=2, n_threads=2) as engine:
            assert engine.context.kv_bytes_released == 0
            kept = _answer(engine)
    assert released == kept and len(kept) > 20


@pytest.mark.model
@pytest.mark.parametrize(("n_ctx", "parallel", "deterministic"), [(1000, 2, False), (3000, 3, True), (4096, 1, True), (5000, 4, False)])
def test_the_pool_size_watched_for_is_the_one_llama_cpp_makes(n_ctx: int, parallel: int, deterministic: bool) -> None:
    with Engine(n_ctx=n_ctx, parallel=parallel, n_threads=1, deterministic=deterministic) as engine:
        settings = engine.context.settings
        assert engine.context.n_ctx == pool_cells(settings.n_ctx, settings.n_seq_max, settings.kv_unified)


@pytest.mark.model
def test_llama_makes_its_context_one_at_a_time_too() -> None:
    import llama_cache

    made = threading.Event()

    def make() -> None:
        llama_cache.Llama(model_path=str(llama_cache.default_model_path()), n_ctx=256, verbose=False).close()
        made.set()

    with MAKING_CONTEXTS:
        thread = threading.Thread(target=make)
        thread.start()
        assert not made.wait(1.5)  # alone, making it takes a fraction of that
    thread.join(60)
    assert made.is_set()
