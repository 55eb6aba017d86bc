"""Exit and fork hooks for caches that write in the background: one registry, run in pipeline order.

A cache with a background writer (the disk tier's write-behind queue, a tiered cache's queue to its slower
tiers) must not lose what it queued: at interpreter exit it is flushed, and around ``fork`` it drains its
queue and holds its locks in the parent, then the child starts with no queue and no writer (those threads
belong to the parent). Caches register with a *stage*, their place in the write pipeline: a tiered cache
(stage :data:`FRONT`) writes into disk tiers (stage :data:`BACK`), so at exit and before a fork the front
drains first into the back, which then drains itself; after a fork, the back is released first and the
front last (locks are released in the reverse order of their taking).

A registered cache implements :class:`ProcessBound`: ``flush()``, ``before_fork()``,
``after_fork_in_parent()`` and ``reset_after_fork()`` (:class:`HeldAcrossFork` gives the parent's side to
a cache with one lock); the registry holds it weakly, so registering keeps nothing alive.

Thread-safety: :func:`register` and every :class:`Registry` method may be called from any thread.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from typing import Protocol

__all__ = ["BACK", "FRONT", "PROCESS", "HeldAcrossFork", "Lock", "ProcessBound", "Registry", "register"]

logger = logging.getLogger(__name__)

FRONT = 0
"""Caches that write into other caches (``TieredCache``)."""
BACK = 1
"""Caches that write to storage of their own (``LlamaDiskCache``)."""


class ProcessBound(Protocol):
    """What the hooks call on a registered cache, each from the thread that exits or forks.

    Around a fork, ``before_fork`` runs in the parent, then either ``after_fork_in_parent`` in the parent
    or ``reset_after_fork`` in the child (never both in one process). Should ``before_fork`` raise,
    ``after_fork_in_parent`` still runs and must cope with a cache that was not held.
    """

    def flush(self) -> None:
        """At interpreter exit: write everything queued so far."""

    def before_fork(self) -> None:
        """In the parent, just before ``fork``: finish the queued writes and hold the cache's locks, so
        that the child starts from a state no other thread was changing."""

    def after_fork_in_parent(self) -> None:
        """In the parent, after ``fork``: let go of what :meth:`before_fork` held."""

    def reset_after_fork(self) -> None:
        """In the child, before any other use: drop what belongs to the parent's process (fresh locks,
        an empty queue, no writer thread)."""


class Lock(Protocol):
    """A lock :class:`HeldAcrossFork` can hold: ``threading.RLock`` or the disk tier's directory lock."""

    def acquire(self) -> bool: ...

    def release(self) -> None: ...


class HeldAcrossFork:
    """The parent's side of :class:`ProcessBound` for a cache with a background writer and one lock.

    :meth:`before_fork` calls :meth:`drain`, then holds :attr:`fork_lock`; :meth:`after_fork_in_parent`
    lets it go (only if it was taken). A subclass provides :meth:`drain` and :attr:`fork_lock`, and
    extends :meth:`reset_after_fork`, calling this one, with its own fresh start in the child.

    Thread-safety: the hooks run in the thread that forks, while the cache's other threads may be using
    it; :attr:`fork_lock` is what keeps them out.
    """

    _fork_locked = False

    @property
    def fork_lock(self) -> Lock:
        """The lock every operation of the cache takes (the subclass's): held across a fork."""
        raise NotImplementedError

    def drain(self) -> None:
        """Wait until the writes this cache queued itself are done (the subclass's). Thread-safe."""
        raise NotImplementedError

    def before_fork(self) -> None:
        """Drain, then hold :attr:`fork_lock` until :meth:`after_fork_in_parent`."""
        self.drain()
        self.fork_lock.acquire()
        self._fork_locked = True

    def after_fork_in_parent(self) -> None:
        """Release :attr:`fork_lock` if :meth:`before_fork` took it."""
        if self._fork_locked:
            self._fork_locked = False
            self.fork_lock.release()

    def reset_after_fork(self) -> None:
        """In the child: the inherited hold is void (the subclass replaces or resets the lock itself)."""
        self._fork_locked = False


class Registry:
    """Caches by stage, held weakly; the hooks below run them in pipeline order.

    The process has one, :data:`PROCESS`, wired to ``atexit`` and ``os.register_at_fork``; another
    instance runs the same hooks on its own caches only (what the tests use, leaving the process's
    caches alone).

    Thread-safety: every method may be called from any thread.
    """

    def __init__(self) -> None:
        self._stages: tuple[weakref.WeakSet[ProcessBound], ...] = (weakref.WeakSet(), weakref.WeakSet())
        self._lock = threading.Lock()

    def register(self, cache: ProcessBound, *, stage: int) -> None:
        """Flush ``cache`` at exit and take it through forks, after the caches of earlier stages.

        Raises:
            ValueError: ``stage`` is neither :data:`FRONT` nor :data:`BACK`.
        """
        if stage not in (FRONT, BACK):
            raise ValueError(f"stage must be FRONT or BACK, got {stage!r}")
        with self._lock:
            self._stages[stage].add(cache)

    def _in_order(self, reverse: bool = False) -> list[ProcessBound]:
        with self._lock:
            stages = [list(stage) for stage in self._stages]
        if reverse:
            stages.reverse()
        return [cache for stage in stages for cache in stage]

    def flush_all(self) -> None:
        """Flush every cache, front first; a failure is logged and the others are still flushed."""
        for cache in self._in_order():
            try:
                cache.flush()
            except Exception:  # noqa: BLE001 - at exit, one cache's failure must not stop the others
                logger.exception("flushing %r at exit failed", cache)

    def before_fork(self) -> None:
        """Drain and hold every cache, front first."""
        for cache in self._in_order():
            cache.before_fork()

    def after_fork_in_parent(self) -> None:
        """Let every cache go, back first."""
        for cache in self._in_order(reverse=True):
            cache.after_fork_in_parent()

    def after_fork_in_child(self) -> None:
        """Give every cache a fresh start, back first."""
        self._lock = threading.Lock()  # another thread may have held it when the process forked
        for cache in self._in_order(reverse=True):
            cache.reset_after_fork()


PROCESS = Registry()
"""The registry whose caches are flushed at this process's exit and taken through its forks."""


def register(cache: ProcessBound, *, stage: int) -> None:
    """Register ``cache`` with :data:`PROCESS` (see :meth:`Registry.register`).

    Raises:
        ValueError: ``stage`` is neither :data:`FRONT` nor :data:`BACK`.
    """
    PROCESS.register(cache, stage=stage)


atexit.register(PROCESS.flush_all)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=PROCESS.before_fork, after_in_parent=PROCESS.after_fork_in_parent,
                        after_in_child=PROCESS.after_fork_in_child)
