"""The context registry: which checkpoint caches hold checkpoints of which llama.cpp context.

A checkpoint relies on the live context (see :mod:`llama_cache.checkpoints.hybrid`), so it is valid only
while the context's memory still holds its history. Every change to that memory made through a
:class:`~llama_cache.checkpoints.hybrid.HybridCheckpointCache` keeps the registered checkpoints
consistent; changes made elsewhere must be reported with :func:`notify_memory_cleared`,
:func:`notify_seq_removed`, :func:`notify_seq_changed` or :func:`notify_seq_kept`. Each cache registers
itself, weakly, under the address of its context on construction (:func:`register`), so a notification
reaches every live cache of that context, which drops the checkpoints it affects
(:meth:`~llama_cache.checkpoints.hybrid.HybridCheckpointCache.drop_checkpoints`).

Thread-safety: all caches of one context share one re-entrant lock, which :func:`register` hands out (a
llama.cpp context must not be used from two threads at once anyway), so every public method of a cache
and every notification is serialised per context and cross-cache invalidation can never deadlock. Lock
order, everywhere: the context's lock, then the registry's own.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llama_cache.checkpoints.hybrid import HybridCheckpoint, HybridCheckpointCache

__all__ = [
    "ContextPointer",
    "context_address",
    "for_each_cache",
    "notify_memory_cleared",
    "notify_seq_changed",
    "notify_seq_kept",
    "notify_seq_removed",
    "register",
    "unregister",
]

ContextPointer = int | ctypes.c_void_p
"""A raw ``llama_context *``: what llama-cpp-python returns (an int, e.g. ``Llama._ctx.ctx``) or a
``ctypes.c_void_p``."""


class _ContextRecord:
    """What the registry knows about one context address: its lock and its live caches (weakly)."""

    __slots__ = ("caches", "lock")

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.caches: weakref.WeakSet[HybridCheckpointCache] = weakref.WeakSet()


# Re-entrant: a cache's __del__ may run (through the garbage collector) while this thread holds the lock.
_registry_lock = threading.RLock()
_registry: dict[int, _ContextRecord] = {}


def context_address(ctx: object) -> int:
    """The address of a context pointer given as an int, a ``ctypes.c_void_p`` or a typed ctypes pointer.

    Raises:
        ValueError: ``ctx`` is None or a null pointer.
        TypeError: ``ctx`` is not a pointer.
    """
    if ctx is None:
        raise ValueError("ctx must be a llama.cpp context pointer, not None")
    if isinstance(ctx, bool):
        raise TypeError("ctx must be a llama.cpp context pointer, not a bool")
    if isinstance(ctx, int):
        address = ctx
    elif isinstance(ctx, ctypes.c_void_p):
        address = ctx.value or 0
    elif isinstance(ctx, ctypes._Pointer):
        address = ctypes.cast(ctx, ctypes.c_void_p).value or 0
    else:
        raise TypeError(f"ctx must be a llama.cpp context pointer, not {type(ctx).__name__}")
    if address == 0:
        raise ValueError("ctx is a null pointer")
    return address


def register(address: int, cache: HybridCheckpointCache) -> threading.RLock:
    """Add ``cache`` (held weakly) to the caches of the context at ``address``.

    Returns:
        That context's lock, shared by all its caches: the cache takes it in every public method.

    Complexity: O(1). Thread-safe.
    """
    with _registry_lock:
        record = _registry.get(address)
        if record is None:
            record = _registry[address] = _ContextRecord()
        record.caches.add(cache)
        return record.lock


def unregister(address: int, cache: HybridCheckpointCache) -> None:
    """Remove ``cache`` from the caches of ``address``, forgetting the address once none is left.

    Complexity: O(1). Thread-safe; a cache not registered there is ignored.
    """
    with _registry_lock:
        record = _registry.get(address)
        if record is not None:
            record.caches.discard(cache)
            if not record.caches:
                del _registry[address]


def _caches_on(address: int) -> list[HybridCheckpointCache]:
    """A snapshot of the live caches registered for ``address``."""
    with _registry_lock:
        record = _registry.get(address)
        if record is None:
            return []
        caches = list(record.caches)
        if not caches:
            del _registry[address]  # every cache died without close(): forget the address
        return caches


def for_each_cache(address: int, action: Callable[[HybridCheckpointCache], None]) -> None:
    """Apply ``action`` to every live cache of the context at ``address``, under the context's lock.

    The caches are those registered when the lock is taken: none slips in between. ``action`` may call
    any method of the caches (the lock is re-entrant) but must not take another context's lock.

    Complexity: O(C) calls of ``action`` for C caches. Thread-safe.
    """
    with _registry_lock:
        record = _registry.get(address)
    if record is None:
        return
    with record.lock:
        for cache in _caches_on(address):
            action(cache)


def _drop_everywhere(ctx: ContextPointer, seq_id: int, predicate: Callable[[HybridCheckpoint], bool]) -> None:
    """``drop_checkpoints(seq_id, predicate)`` in every cache registered for ``ctx``."""
    for_each_cache(context_address(ctx), lambda cache: cache.drop_checkpoints(seq_id, predicate))


def notify_memory_cleared(ctx: ContextPointer) -> None:
    """Report that the memory of ``ctx`` was cleared (``llama_memory_clear``) or fully replaced.

    Drops every checkpoint of every cache registered for ``ctx``: they all relied on the lost memory.
    Also use it after loading a whole-context state (``llama_state_set_data``, ``llama_state_load_file``).

    Complexity: O(N) for N registered checkpoints. Thread-safe.

    Raises:
        ValueError: ``ctx`` is None or null.
    """
    _drop_everywhere(ctx, -1, lambda checkpoint: True)


def notify_seq_removed(ctx: ContextPointer, seq_id: int, p0: int, p1: int) -> None:
    """Report that positions ``[p0, p1)`` of sequence ``seq_id`` were removed (``llama_memory_seq_rm``).

    Arguments follow llama.cpp: ``seq_id < 0`` means every sequence, ``p0 < 0`` means 0 and ``p1 < 0`` means
    infinity. A checkpoint survives only when its recorded native range lies strictly before the removed
    range (``pos_max < p0``): one ending inside or after it now misses part of its history. An empty range
    removes nothing and drops nothing. Call it after the removal whatever it returned (a failed partial
    removal leaves the memory alone, and dropping is the safe answer anyway).

    Complexity: O(N) for N registered checkpoints. Thread-safe.

    Raises:
        ValueError: ``ctx`` is None or null.
    """
    start = max(p0, 0)
    if 0 <= p1 <= start:
        return

    def removed(checkpoint: HybridCheckpoint) -> bool:
        return checkpoint.pos_max is None or checkpoint.pos_max >= start

    _drop_everywhere(ctx, seq_id, removed)


def notify_seq_changed(ctx: ContextPointer, seq_id: int) -> None:
    """Report that sequence ``seq_id`` of ``ctx`` changed in place (``seq_id < 0``: every sequence).

    For copies into it (``llama_memory_seq_cp``, pass the destination), position shifts
    (``llama_memory_seq_add`` / ``seq_div``) and sequence-state loads (``llama_state_seq_set_data``,
    ``llama_state_seq_load_file``, pass the destination). Drops that sequence's checkpoints in every cache
    registered for ``ctx``.

    Complexity: O(N) for N registered checkpoints. Thread-safe.

    Raises:
        ValueError: ``ctx`` is None or null.
    """
    _drop_everywhere(ctx, seq_id, lambda checkpoint: True)


def notify_seq_kept(ctx: ContextPointer, seq_id: int) -> None:
    """Report that every sequence of ``ctx`` but ``seq_id`` was removed (``llama_memory_seq_keep``).

    Drops the checkpoints of all other sequences in every cache registered for ``ctx``.

    Complexity: O(N) for N registered checkpoints. Thread-safe.

    Raises:
        ValueError: ``ctx`` is None or null.
    """
    _drop_everywhere(ctx, -1, lambda checkpoint: checkpoint.seq_id != seq_id)
