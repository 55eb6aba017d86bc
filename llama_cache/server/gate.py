"""How many requests run at once, and how many may wait: the server's admission gate.

:class:`RequestGate` gives ``permits`` requests at a time a place in the engine (``--parallel``) and
lets ``max_queue`` more wait, in FIFO order; one more is refused (:class:`QueueFull`, a 503 with
``Retry-After`` before any work). Which cells a request reuses is the engine's business
(:mod:`llama_cache.engine.scheduler`): there is no routing here.

Thread-safety: used from the event loop's thread only.
"""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ["QueueFull", "RequestGate"]


class QueueFull(Exception):
    """Every place is taken and the queue holds its maximum of waiting requests."""


class RequestGate:
    """``permits`` places and a FIFO queue of at most ``max_queue`` requests waiting for one.

    O(1) per acquire and release (a cancelled waiter is removed in O(queue)).
    """

    def __init__(self, permits: int, max_queue: int) -> None:
        if permits < 1:
            raise ValueError(f"permits must be positive, got {permits}")
        if max_queue < 0:
            raise ValueError(f"max_queue must not be negative, got {max_queue}")
        self.permits = permits
        self.max_queue = max_queue
        self.running = 0
        """Requests holding a place."""
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a place."""
        return sum(1 for future in self._waiters if not future.done())

    async def acquire(self) -> None:
        """Take a place, waiting in FIFO order if none is free. Cancelling the wait leaves the queue
        (or gives back a place granted meanwhile).

        Raises:
            QueueFull: every place is taken and ``max_queue`` requests already wait.
        """
        if self.running < self.permits and not self._waiters:
            self.running += 1
            return
        if len(self._waiters) >= self.max_queue:
            raise QueueFull()
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()
            else:
                try:
                    self._waiters.remove(future)
                except ValueError:
                    pass
            raise

    def release(self) -> None:
        """Give a place back; the oldest waiter takes it."""
        while self._waiters:
            future = self._waiters.popleft()
            if not future.done():
                future.set_result(None)  # the place passes on: running is unchanged
                return
        self.running -= 1
