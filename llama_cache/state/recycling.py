"""Buffers lent for as long as anything refers to them, then lent again with their pages already mapped.

Writing into fresh memory costs a page fault per page on first touch: on the project's 2-core VM, 19 ms
for 35 MB, against 2.8 ms into memory touched before (``benchmarks/redis_tier.py``, ``transfer.phases``). A Redis lookup reads a whole state's chunks
from the socket into one buffer, and the state it returns keeps views of that buffer for as long as it
lives (no copy), so the buffer cannot be given back at a known time, as
:class:`~llama_cache.state.kv_layout.StagingPool`'s are. A :class:`RecyclingPool` lends it again once
nothing refers to it any more.

How it knows: each buffer is an anonymous memory map, and an array made on it refers to it through a
``memoryview``; every view of that array, every ``memoryview`` of a view and every array made on one
of those keeps that chain, and so the map, alive. The map's CPython reference count is therefore the
pool's own references exactly when no view of it is alive. What does not count: a raw address taken
from an array (``ctypes.data``, ``__array_interface__``) outliving it, or ``release()`` called on an
array's ``base`` memoryview; code using lent buffers must not do either. Interpreters that do not count
references so (not CPython, or CPython without its GIL) get a new buffer at every loan.
"""

from __future__ import annotations

import mmap
import sys
import threading

import numpy as np

from llama_cache.state.kv_layout import Bytes

__all__ = ["RecyclingPool"]

_PAGE = mmap.PAGESIZE
# Free-threaded builds count references per thread: a count read there does not say who holds a map.
_COUNTS_REFERENCES = sys.implementation.name == "cpython" and getattr(sys, "_is_gil_enabled", lambda: True)()


def _idle_references() -> int:
    """What ``sys.getrefcount(items[i])`` reads for an object only a list holds (measured, not assumed)."""
    items = [object()]
    return sys.getrefcount(items[0])


_IDLE = _idle_references()
_POOLED_FROM = 1 << 20  # smaller buffers: np.empty (the allocator's own free lists serve them)
_SLACK = 64 << 10  # beyond an eighth, what an idle buffer may exceed a loan by


class RecyclingPool:
    """Buffers for callers that cannot say when they are done with them (see the module's docstring).

    Args:
        max_buffers: the most buffers the pool keeps track of (lent or idle); beyond it, the least
            recently lent is forgotten (freed by the last view of it, as any array).
        max_bytes: the most bytes of those buffers together.

    A loan of ``n`` bytes takes an idle buffer of ``n`` to ``1.125 n`` + 64 KiB bytes: what a caller
    keeps alive is within an eighth of what it asked for.
    Memory: at most ``max_bytes`` held beyond what callers use.
    Thread-safe: a lock guards the pool's list (reference counts are read under it; only a holder of a
    view can make another, so an idle buffer cannot become busy meanwhile).
    """

    def __init__(self, *, max_buffers: int = 4, max_bytes: int = 256 << 20) -> None:
        if max_buffers < 1 or max_bytes < 0:
            raise ValueError(f"max_buffers must be >= 1 and max_bytes >= 0, got {max_buffers}, {max_bytes}")
        self.max_buffers = max_buffers
        self.max_bytes = max_bytes
        self._maps: list[mmap.mmap] = []  # least recently lent first
        self._lock = threading.Lock()
        self.allocations = 0
        """Buffers mapped so far (each faulted in once)."""
        self.reuses = 0
        """Loans served by a buffer mapped before."""

    def take(self, nbytes: int) -> Bytes:
        """A writable array of ``nbytes`` bytes, lent until the last view of it is gone.

        Its content is whatever the previous borrower left. O(buffers kept).

        Raises:
            ValueError: ``nbytes`` is negative.
        """
        if nbytes < 0:
            raise ValueError(f"cannot take {nbytes} bytes")
        if nbytes < _POOLED_FROM or not _COUNTS_REFERENCES or not hasattr(mmap, "MAP_ANONYMOUS"):
            return np.empty(nbytes, dtype=np.uint8)
        largest = nbytes + nbytes // 8 + _SLACK
        with self._lock:
            for index in range(len(self._maps)):
                if nbytes <= len(self._maps[index]) <= largest and sys.getrefcount(self._maps[index]) <= _IDLE:
                    mapping = self._maps.pop(index)
                    self._maps.append(mapping)
                    self.reuses += 1
                    return np.frombuffer(mapping, dtype=np.uint8, count=nbytes)
        mapping = self._map(-(-nbytes // _PAGE) * _PAGE)
        with self._lock:
            self.allocations += 1
            if len(mapping) <= self.max_bytes:
                self._maps.append(mapping)
                while len(self._maps) > self.max_buffers or sum(map(len, self._maps)) > self.max_bytes:
                    del self._maps[0]
        return np.frombuffer(mapping, dtype=np.uint8, count=nbytes)

    @property
    def idle_nbytes(self) -> int:
        """Bytes of the buffers no view refers to."""
        with self._lock:
            return sum(len(self._maps[i]) for i in range(len(self._maps)) if sys.getrefcount(self._maps[i]) <= _IDLE)

    @property
    def kept_nbytes(self) -> int:
        """Bytes of every buffer the pool keeps track of, lent or idle."""
        with self._lock:
            return sum(map(len, self._maps))

    def clear(self) -> None:
        """Forget every buffer (lent ones stay valid until their last view goes)."""
        with self._lock:
            self._maps.clear()

    @staticmethod
    def _map(nbytes: int) -> mmap.mmap:
        """Anonymous memory, its pages mapped as they are first written (a lookup that fills part of
        its buffer makes only that part resident)."""
        return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
