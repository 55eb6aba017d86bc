"""RecyclingPool: a buffer is lent again only once nothing refers to it, however it was viewed."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from llama_cache.state.recycling import RecyclingPool

MB = 1 << 20


def _views() -> list[tuple[str, Callable[[Any], Any]]]:
    return [
        ("the array", lambda a: a),
        ("a slice", lambda a: a[10:20]),
        ("a slice of a slice", lambda a: a[5:][3:9]),
        ("a reshaped view", lambda a: a[: 4 * 1024].reshape(4, 1024)),
        ("a memoryview", memoryview),
        ("a memoryview's slice", lambda a: memoryview(a)[100:200]),
        ("an array on a memoryview", lambda a: np.frombuffer(memoryview(a)[8:72], dtype="<i4")),
        ("an int32 view", lambda a: a[: 4 * 16].view("<i4")),
    ]


@pytest.mark.parametrize("name,make", _views(), ids=[name for name, _ in _views()])
def test_a_buffer_is_not_lent_again_while_any_view_of_it_lives(name: str, make: Callable[[Any], Any]) -> None:
    pool = RecyclingPool()
    first = pool.take(2 * MB)
    first[:] = 7
    view = make(first)
    del first
    second = pool.take(2 * MB)
    second[:] = 9
    assert np.all(np.frombuffer(view, dtype=np.uint8) == 7), name  # untouched by the second borrower
    assert (pool.allocations, pool.reuses) == (2, 0)
    del view, second
    third = pool.take(2 * MB)
    assert pool.reuses == 1 and len(third) == 2 * MB and third.flags.writeable


def test_an_idle_buffer_is_lent_again_with_what_it_held() -> None:
    pool = RecyclingPool()
    first = pool.take(3 * MB)
    first[:5] = [1, 2, 3, 4, 5]
    del first
    assert pool.idle_nbytes == 3 * MB == pool.kept_nbytes
    again = pool.take(3 * MB - 100)
    assert pool.allocations == 1 and pool.reuses == 1
    assert list(again[:5]) == [1, 2, 3, 4, 5] and len(again) == 3 * MB - 100
    assert pool.idle_nbytes == 0


def test_a_small_loan_does_not_take_a_much_larger_buffer() -> None:
    pool = RecyclingPool()
    pool.take(40 * MB)  # dropped at once: idle
    small = pool.take(30 * MB)  # 40 MB > 1.125 x 30 MB + 64 KiB: a buffer of its own
    assert pool.allocations == 2 and pool.reuses == 0
    del small
    assert pool.take(36 * MB) is not None and pool.reuses == 1  # 40 MB <= 1.125 x 36 MB


def test_small_loans_are_plain_arrays_and_bad_sizes_are_refused() -> None:
    pool = RecyclingPool()
    tiny = pool.take(1000)
    assert len(tiny) == 1000 and pool.allocations == 0 and pool.kept_nbytes == 0
    assert len(pool.take(0)) == 0
    with pytest.raises(ValueError):
        pool.take(-1)
    with pytest.raises(ValueError):
        RecyclingPool(max_buffers=0)
    with pytest.raises(ValueError):
        RecyclingPool(max_bytes=-1)


def test_the_pool_keeps_at_most_its_buffers_and_bytes() -> None:
    pool = RecyclingPool(max_buffers=2, max_bytes=10 * MB)
    held = [pool.take(2 * MB) for _ in range(3)]
    assert pool.kept_nbytes == 4 * MB  # the least recently lent is forgotten
    del held
    assert pool.idle_nbytes == 4 * MB
    big = pool.take(12 * MB)  # larger than max_bytes: lent, never kept
    assert len(big) == 12 * MB and pool.kept_nbytes == 4 * MB
    pool.clear()
    assert pool.kept_nbytes == 0


def test_threads_never_share_a_buffer() -> None:
    pool = RecyclingPool(max_buffers=3)
    errors: list[str] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(60):
            buffer = pool.take(rng.choice([MB + 1, 2 * MB]))
            view = buffer[1000:2000]
            del buffer
            view[:] = seed
            threading.Event().wait(rng.random() / 2000)
            if not np.all(view == seed):
                errors.append(f"thread {seed}: another borrower wrote into a lent buffer")
            del view

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(1, 7)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert pool.reuses > 0
