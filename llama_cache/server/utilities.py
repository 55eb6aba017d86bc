"""Where the utility endpoints (``/tokenize``, ``/detokenize``) run: a lane of their own.

Completions parse and tokenize their prompts on the event loop's default executor; a flood of utility
requests there would leave them waiting for a thread. :class:`UtilityLane` runs utility work on its own
threads, one at a time per thread, and refuses work past a bounded backlog (:class:`UtilityBusy`, a 503)
instead of queueing without end. Each request's own cost is bounded before it gets here (a text that
cannot fit the context, a token list longer than the context: 400), so one request takes at most about
what tokenizing a whole context takes. Its threads run at the lowest CPU priority (``nice`` 19, where
the system allows it): on a machine whose cores the model's threads use, utility work takes the time
they leave, rather than a core from under llama.cpp's thread pool, whose threads wait on each other
at every step.

Thread-safety: :meth:`UtilityLane.run` is called from one event loop's thread.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["UtilityBusy", "UtilityLane"]

_T = TypeVar("_T")


def _lowest_priority() -> None:
    """Give the calling thread the lowest CPU priority (Linux: a thread's own nice value)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: the default priority
        pass


class UtilityBusy(Exception):
    """The lane's threads are busy and its backlog is full."""


class UtilityLane:
    """Threads for utility work, apart from the threads completions use, with a bounded backlog.

    Args:
        threads: the lane's threads (at least 1).
        max_waiting: calls that may wait for a thread; one more is refused.
    """

    def __init__(self, threads: int = 1, max_waiting: int = 64) -> None:
        if threads < 1 or max_waiting < 0:
            raise ValueError(f"a utility lane needs a thread and a backlog >= 0, got {threads} and {max_waiting}")
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="llama-cache-utility",
                                            initializer=_lowest_priority)
        self._limit = threads + max_waiting
        self._admitted = 0

    @property
    def admitted(self) -> int:
        """Calls running or waiting now."""
        return self._admitted

    async def run(self, work: Callable[[], _T]) -> _T:
        """``work()`` on one of the lane's threads.

        Raises:
            UtilityBusy: ``threads + max_waiting`` calls are running or waiting already.
        """
        if self._admitted >= self._limit:
            raise UtilityBusy()
        loop = asyncio.get_running_loop()
        self._admitted += 1
        future = self._executor.submit(work)
        # Counted until the work itself ends, not the wait for it: a client that leaves frees no thread.
        future.add_done_callback(lambda _: self._done(loop))
        return await asyncio.wrap_future(future)

    def _done(self, loop: asyncio.AbstractEventLoop) -> None:
        def release() -> None:
            self._admitted -= 1

        try:
            loop.call_soon_threadsafe(release)
        except RuntimeError:  # the loop is closed: nothing is admitted any more
            pass

    def close(self) -> None:
        """Stop the threads once their work is done."""
        self._executor.shutdown(wait=True, cancel_futures=True)
