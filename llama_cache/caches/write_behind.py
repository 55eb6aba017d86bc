"""Write-behind: a bounded queue of items stored by one background thread, shared by the caches that
write to slower storage after answering their caller (the disk tier, a tiered cache's slower tiers).

:class:`WriteBehindQueue` knows nothing of states: it calls the ``store`` function it was given on each
queued item, in order, in a daemon thread started on demand that exits after ``idle_seconds`` or when
stopped. When ``max_pending`` items wait, :meth:`~WriteBehindQueue.put` either waits for room (the disk
tier: its caller must not lose a state) or drops the oldest item (a tiered cache: its caller must not
wait for a slow tier, and a conversation's newest state holds the older ones' tokens).
:meth:`~WriteBehindQueue.wait` returns once every item queued before it is done (stored, dropped, or
failed and reported through ``failed``); when no writer thread is alive (it died, or this is a forked
child) the waiting caller drains the queue itself. The writer thread never waits for itself. A ``store``
exception is logged with its traceback and reported, never raised: the writer outlives one bad item.

The owners register with :mod:`llama_cache.caches.lifecycle`, whose hooks flush them at interpreter exit
and, around ``fork``, let them drain the queue (parent) or drop what belongs to the parent (child:
:meth:`~WriteBehindQueue.reset_after_fork`).

Thread-safety: every method may be called from any thread.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["WriteBehindQueue"]

logger = logging.getLogger(__name__)


class WriteBehindQueue:
    """A bounded FIFO of items stored by one background thread.

    Args:
        store: called with each item, in the writer thread (or in a caller draining the queue).
        failed: called after ``store`` raised (the exception is logged here).
        thread_name: the writer thread's name.
        idle_seconds: how long an idle writer thread waits for an item before it exits.
    """

    def __init__(self, store: Callable[[Any], None], failed: Callable[[], None], *, thread_name: str,
                 idle_seconds: float = 5.0) -> None:
        self._store = store
        self._failed = failed
        self._thread_name = thread_name
        self._idle_seconds = idle_seconds
        self._cond = threading.Condition()
        self._queue: deque[Any] = deque()
        self._submitted = 0
        self._completed = 0
        self._writer: threading.Thread | None = None

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, item: Any, max_pending: int, *, drop_oldest: bool = False) -> Any | None:
        """Queue ``item``; start a writer if none runs. Returns the item dropped to make room, if any.

        While ``max_pending`` items are queued, this waits for room, or with ``drop_oldest`` drops the
        oldest queued item at once (it counts as done for :meth:`wait`).
        """
        dropped = None
        with self._cond:
            while len(self._queue) >= max_pending:
                if drop_oldest:
                    dropped = self._queue.popleft()
                    self._completed += 1
                else:
                    self._cond.wait()
            self._queue.append(item)
            self._submitted += 1
            if self._writer is None or not self._writer.is_alive():
                self._writer = threading.Thread(target=self._write_loop, name=self._thread_name, daemon=True)
                self._writer.start()
            self._cond.notify_all()
        return dropped

    def _run(self, item: Any) -> None:
        try:
            self._store(item)
        except Exception:  # noqa: BLE001 - the writer must outlive one bad state; logged
            self._failed()
            logger.exception("%s: unexpected error while storing", self._thread_name)

    def _write_loop(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                if not self._queue and self._writer is me:
                    self._cond.wait(timeout=self._idle_seconds)  # woken by a store or by stop()
                if not self._queue or self._writer is not me:
                    # Idle for a while, or stopped: exit (the next store starts a new writer).
                    if self._writer is me:
                        self._writer = None
                    self._cond.notify_all()
                    return
                item = self._queue.popleft()
                self._cond.notify_all()
            try:
                self._run(item)
            finally:
                with self._cond:
                    self._completed += 1
                    self._cond.notify_all()

    def wait(self) -> None:
        """Return once every item queued before this call is done; from the writer thread, at once."""
        with self._cond:
            target = self._submitted
            while self._completed < target:
                writer = self._writer
                if writer is threading.current_thread():
                    return  # never wait for ourselves
                if writer is None or not writer.is_alive():
                    # No writer (it died, or this is a forked child): drain here.
                    if not self._queue:
                        self._completed = self._submitted
                        break
                    item = self._queue.popleft()
                    self._cond.release()
                    try:
                        self._run(item)
                    finally:
                        self._cond.acquire()
                        self._completed += 1
                        self._cond.notify_all()
                    continue
                self._cond.wait(timeout=1.0)

    def stop(self) -> threading.Thread | None:
        """Tell the writer thread to exit once idle; return it (to join) or None."""
        with self._cond:
            writer = self._writer
            self._writer = None
            self._cond.notify_all()
        return writer

    def reset_after_fork(self) -> None:
        """In a forked child: forget the parent's queue and thread (the parent drained it before forking)."""
        self._cond = threading.Condition()
        self._queue.clear()
        self._completed = self._submitted
        self._writer = None
