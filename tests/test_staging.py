"""StagingPool: reused buffers for assembling states, lent to one borrower at a time; prefaulted buffers."""

from __future__ import annotations

import mmap
import threading

import numpy as np
import pytest

from llama_cache.state.kv_layout import StagingPool, prefaulted

PAGE = mmap.PAGESIZE


def test_a_buffer_is_reused_once_given_back() -> None:
    pool = StagingPool()
    with pool.borrow(1000) as first:
        assert first.dtype == np.uint8 and first.shape == (1000,) and first.flags.c_contiguous
        first[:] = 7
    with pool.borrow(600) as second:
        assert second.shape == (600,)
        assert np.shares_memory(first, second)
        assert (second == 7).all()  # the same memory, not zeroed again
    assert pool.allocations == 1


def test_concurrent_borrows_get_separate_buffers() -> None:
    pool = StagingPool()
    with pool.borrow(100) as outer, pool.borrow(100) as inner:
        assert not np.shares_memory(outer, inner)
    assert pool.allocations == 2
    with pool.borrow(100) as a, pool.borrow(100) as b:
        assert not np.shares_memory(a, b)
    assert pool.allocations == 2  # both were kept (max_idle=2) and lent again


def test_buffers_grow_geometrically_and_in_whole_pages() -> None:
    pool = StagingPool(growth=2.0)
    with pool.borrow(3 * PAGE - 10):
        pass
    assert pool.idle_nbytes == 3 * PAGE
    with pool.borrow(3 * PAGE + 1) as grown:  # too big for the first buffer: replaced by one twice its size
        pass
    assert pool.allocations == 2
    assert pool.idle_nbytes == 6 * PAGE
    with pool.borrow(6 * PAGE) as again:  # fits in the grown buffer
        assert np.shares_memory(grown, again)
    assert pool.allocations == 2


def test_at_most_max_idle_buffers_are_kept_and_the_largest_survive() -> None:
    pool = StagingPool(max_idle=1)
    with pool.borrow(5_000) as small, pool.borrow(50_000) as large:
        pass
    assert pool.idle_nbytes >= 50_000
    with pool.borrow(5_000) as reused:
        assert np.shares_memory(reused, large) and not np.shares_memory(reused, small)
    pool.clear()
    assert pool.idle_nbytes == 0


def test_reserve_prepares_the_next_borrow() -> None:
    pool = StagingPool()
    pool.reserve(20_000)
    assert pool.allocations == 1
    pool.reserve(10_000)  # already covered
    assert pool.allocations == 1
    with pool.borrow(20_000):
        pass
    assert pool.allocations == 1
    pool.reserve(30_000)  # replaces the idle buffer instead of keeping both
    assert pool.allocations == 2
    assert 30_000 <= pool.idle_nbytes < 20_000 + 30_000


def test_a_buffer_is_given_back_when_the_block_raises() -> None:
    pool = StagingPool()
    with pytest.raises(RuntimeError), pool.borrow(100):
        raise RuntimeError("restore failed")
    with pool.borrow(100):
        pass
    assert pool.allocations == 1


def test_threads_never_share_a_lent_buffer() -> None:
    pool = StagingPool()
    errors: list[str] = []
    start = threading.Barrier(4)

    def work(tag: int) -> None:
        start.wait()
        for round_ in range(200):
            size = 1000 + (tag * 37 + round_ * 11) % 3000
            with pool.borrow(size) as buffer:
                buffer[:] = tag
                if not (buffer == tag).all():  # another thread wrote into a buffer lent to this one
                    errors.append(f"thread {tag} round {round_}")

    threads = [threading.Thread(target=work, args=(tag,)) for tag in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(pool._idle) <= pool.max_idle


@pytest.mark.parametrize(("argument", "value"), [("max_idle", 0), ("growth", 0.5)])
def test_bad_settings_are_refused(argument: str, value: float) -> None:
    with pytest.raises(ValueError):
        StagingPool(**{argument: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        with StagingPool().borrow(-1):
            pass


@pytest.mark.parametrize("nbytes", [0, 1, 4096, (1 << 20) - 1, 1 << 20, (3 << 20) + 5])
def test_a_prefaulted_buffer_is_a_private_writable_byte_array_of_the_size_asked(nbytes: int) -> None:
    first, second = prefaulted(nbytes), prefaulted(nbytes)
    assert first.dtype == np.uint8 and first.shape == (nbytes,) and first.flags.writeable and first.flags.c_contiguous
    first[:] = 3
    assert not np.shares_memory(first, second)
    assert (first == 3).all()
    view = first[nbytes // 2:]
    del first  # a view keeps the mapping alive
    assert (view == 3).all()
