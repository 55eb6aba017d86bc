"""TieredCache: prompt caches stacked fastest first, read through with promotion, written behind.

``TieredCache([LlamaRAMCache(...), LlamaDiskCache(...), ...])`` is itself a
:class:`~llama_cache.caches.base.BaseLlamaCache`, so ``llama_cache.Llama(cache=...)`` and a plain
``llama_cpp.Llama.set_cache(...)`` use it like any cache. Any of this package's prompt caches can be a
tier (a cache whose :attr:`~llama_cache.caches.base.BaseLlamaCache.usable_as_tier` is True).

**Which tier answers.** A faster tier may hold a shorter prefix than a slower one (RAM the system
prompt, disk the whole conversation). A lookup asks the tiers, fastest first, how many leading tokens
of the query they would restore (:meth:`~llama_cache.caches.base.BaseLlamaCache.match_length`: an
index lookup, nothing loaded), stopping at a tier that matches the whole query (slower ones could only
tie). It loads from the longest match, ties going to the faster tier; should that tier miss after all
(a damaged entry), the next is tried. Tiers answering 0 (a miss, or a cache that cannot tell without
loading) are tried last, fastest first; each counts its own miss.

**Promotion.** What tier ``j`` answered is stored, under the tokens it holds, in tier 0 at once and in
tiers ``1..j-1`` through the background writer; never again in tier ``j`` nor in slower tiers.

**Recency.** A hit served by a faster tier is not a lookup of the slower ones, yet it is their use too:
without a word from it, a slower tier would evict an entry that the faster tier answers every minute. So
the tokens of each hit are noted, and the background writer passes them in one batch to every slower
tier that has a ``touch(keys)`` method (the Redis tier: one round trip per batch), which makes the
entries stored under exactly those keys the most recently used. At most :data:`_MAX_TOUCHES` keys wait;
further hits are not noted until the writer took them; the batch takes one slot of the queue, never a
state's.

**Stores.** ``cache[key] = state`` stores in tier 0 in the caller's thread and queues the state for the
slower tiers (or, with ``write_through``, stores it in every tier before returning, but for tiers that
take an announcement of the store, see :meth:`TieredCache.announce`), written in order by one background
thread per cache (``llama-cache-tier-writer``,
started on demand, gone after five idle seconds). The queue holds ``max_pending`` states; a store
finding it full drops the *oldest* queued one (``stats().dropped``): in a conversation the newest state
holds the earlier ones' tokens, so it is the one worth keeping, and the caller never waits for a slow
tier. :meth:`TieredCache.flush` waits for the queue, then flushes the tiers that have ``flush``.

**Failures.** Bad keys raise ``TypeError``/``ValueError`` before any tier is asked; after that nothing a
tier raises leaves the tiered cache. A failing store is counted in ``stats().store_errors``, a failing
lookup is a miss of that tier counted in ``stats().lookup_errors``; each is logged at WARNING once per
tier, action and exception type, then at DEBUG.

**Exit and fork.** Live tiered caches are flushed at interpreter exit. Before ``fork`` each drains its
queue into its tiers and holds its locks; the child starts with an empty queue and no writer. They
register with :mod:`llama_cache.caches.lifecycle` as the pipeline's front, so a queue is drained into
a disk tier before that tier drains its own.

The module is a little past the ~400 lines DESIGN.md asks for: it is one class whose lookups, writer
thread and fork hooks share one queue and two locks; half of it is docstrings.
"""

from __future__ import annotations

import functools

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from typing import Any, NamedTuple, TypeVar

import llama_cpp
import numpy as np

from llama_cache.caches import lifecycle
from llama_cache.caches.base import BaseLlamaCache, CacheStats
from llama_cache.caches.write_behind import WriteBehindQueue
from llama_cache.state.values import state_tokens
from llama_cache.tokens import CheckedTokens, TokenArray, as_token_array, checked_tokens, readonly

__all__ = ["TieredCache"]

logger = logging.getLogger(__name__)

_IDLE_SECONDS = 5.0  # a writer thread with nothing to do exits after this long
_MAX_TOUCHES = 256  # keys of hits waiting to refresh recency in slower tiers
_TOUCH: Any = object()  # the queue item that passes the noted hits to the slower tiers
_FAILED: Any = object()  # what a failing tier's lookup gives
_T = TypeVar("_T")


class _Pending(NamedTuple):
    """A state queued for tiers ``first..stop-1``."""

    key: TokenArray
    value: Any
    first: int
    stop: int


class TieredCache(BaseLlamaCache, lifecycle.HeldAcrossFork):
    """Several caches used as one, fastest first: lookups read through and promote, stores write behind.

    See the module docstring for which tier answers, promotion, the background writer and failures.

    Counting: ``len`` is the largest tier's entry count (every store reaches every tier, so the slowest,
    largest tier holds nearly every key: a lower bound of the distinct keys held, exact when one tier
    holds them all). ``cache_size`` and ``capacity_bytes`` are sums over the tiers, each of which keeps
    its own budget. ``stats()`` gives this cache's hits and misses, ``entries`` as ``len``, the tiers'
    bytes, evictions, rejections, writes and errors summed (an entry evicted from two tiers counts
    twice), the writer's drops, and each tier's own statistics in ``tiers``. ``len``, ``cache_size``
    and ``stats()`` first wait for the states queued before them (as the disk tier does for its own
    writes); lookups never wait for the queue.

    Thread-safe: tiers are called from callers' threads and the writer thread at once (this package's
    caches are thread-safe). Values are kept by reference, never copied.

    Args:
        tiers: the caches, fastest first: distinct :class:`~llama_cache.caches.base.BaseLlamaCache`
            instances whose :attr:`~llama_cache.caches.base.BaseLlamaCache.usable_as_tier` is True
            (prompt caches, not checkpoint caches).
        max_pending: states queued for the slower tiers before the oldest is dropped (default 64).
        write_through: whoever looks a stored key up next, in this process or another sharing a
            tier, finds it (how ``llama-cache serve`` stores in a Redis tier shared by several
            instances: the conversation's next request may land on another one at once). A tier that
            takes announcements (``announce``: the Redis tier) is told of the store in the caller's
            thread (one round trip) and written by the background writer, its lookups elsewhere
            waiting for it meanwhile; any other tier is stored in the caller's thread before the
            store returns. Promotions stay behind.

    Raises:
        TypeError: ``tiers`` is not a sequence of prompt caches, or ``max_pending`` is not an int.
        ValueError: no tier, a tier given twice, or ``max_pending < 1``.
    """

    def __init__(self, tiers: Sequence[BaseLlamaCache], *, max_pending: int = 64, write_through: bool = False) -> None:
        if not isinstance(tiers, Sequence) or isinstance(tiers, (str, bytes)):
            raise TypeError(f"tiers must be a sequence of caches, got {type(tiers).__name__}")
        for tier in tiers:
            if not isinstance(tier, BaseLlamaCache) or not tier.usable_as_tier:
                raise TypeError(f"a tier must be a llama_cache prompt cache, got {type(tier).__name__}")
        if not tiers:
            raise ValueError("a tiered cache needs at least one tier")
        if len({id(tier) for tier in tiers}) != len(tiers):
            raise ValueError("a cache cannot be two tiers")
        if not isinstance(max_pending, int) or isinstance(max_pending, bool):
            raise TypeError(f"max_pending must be an int, got {type(max_pending).__name__}")
        if max_pending < 1:
            raise ValueError(f"max_pending must be positive, got {max_pending}")
        super().__init__(sum(tier.capacity_bytes for tier in tiers))
        self.tiers: tuple[BaseLlamaCache, ...] = tuple(tiers)
        self.max_pending = max_pending
        self.write_through = bool(write_through)
        # Counters, under `_lock`.
        self._hits = self._misses = self._store_errors = self._lookup_errors = 0
        self._logged: set[tuple[int, str, str]] = set()  # failure kinds already logged at WARNING
        self._pending = WriteBehindQueue(self._write_pending, lambda: None, thread_name="llama-cache-tier-writer",
                                         idle_seconds=_IDLE_SECONDS)
        self._dropped = 0  # under `_lock`
        # Hits to refresh in slower tiers: key bytes -> (tokens, first tier to touch); under `_lock`.
        self._touches: dict[tuple[str | None, bytes], tuple[TokenArray, int]] = {}
        self._touch_queued = False
        lifecycle.register(self, stage=lifecycle.FRONT)

    @property
    def finds_keys_extending_the_query(self) -> bool:
        """Whether every tier finds keys that run past the query (see the base class)."""
        return all(tier.finds_keys_extending_the_query for tier in self.tiers)

    # ------------------------------------------------------------------------------------ lookups

    def __getitem__(self, key: Sequence[int]) -> Any:
        """The whole state of the best entry of the tier holding the longest prefix of ``key``.

        Within a tier its own policy applies (longest common prefix or whole-key prefix, ties to its
        most recently used); across tiers the longest match wins, ties to the faster tier. The state is
        promoted to the faster tiers.

        Raises:
            KeyError: no tier answers ``key``.
            TypeError, ValueError: ``key`` is not a sequence of token ids.
        """
        return self._lookup(key, shared_only=False)

    def lookup_prefix(self, key: Sequence[int], *, namespace: str | None = None) -> Any:
        """As ``cache[key]`` through the tiers' ``lookup_prefix``: the state may hold only the prefix
        ``key`` shares with the entry (the disk tier then reads only those chunks), and that is what is
        promoted. ``llama_cache.Llama`` looks up through this method. ``namespace``: every tier answers
        from the states of that fingerprint only (see :meth:`BaseLlamaCache.lookup_prefix`).

        Raises:
            KeyError: no tier answers ``key``.
            TypeError, ValueError: ``key`` is not a sequence of token ids.
        """
        return self._lookup(key, shared_only=True, namespace=namespace)

    def match_length(self, key: Sequence[int], *, namespace: str | None = None) -> int:
        """The longest of the tiers' match lengths (a failing tier's is 0). O(K) per tier asked.

        Raises:
            TypeError, ValueError: ``key`` is not a sequence of token ids.
        """
        answers, _ = self._ask_tiers(checked_tokens(key), namespace)
        return max((length for length, _ in answers), default=0)

    def __contains__(self, key: Sequence[int]) -> bool:  # type: ignore[override]
        """Whether some tier would answer ``key``; changes neither recency nor counters.

        Raises:
            TypeError, ValueError: ``key`` is not a sequence of token ids.
        """
        query = checked_tokens(key)
        return any(self._guard(i, "look up", tier.__contains__, False, query) for i, tier in enumerate(self.tiers))

    def _ask_tiers(self, query: CheckedTokens, namespace: str | None = None) -> tuple[list[tuple[int, int]], int]:
        """(match length, tier index) of the tiers asked, fastest first, up to one matching all of
        ``query`` (failing tiers left out); and the index of the first tier not asked."""
        answers = []
        ask = (lambda tier: tier.match_length) if namespace is None else (
            lambda tier: functools.partial(tier.match_length, namespace=namespace))
        for index, tier in enumerate(self.tiers):
            length = self._guard(index, "look up", ask(tier), None, query)
            if length is None:
                continue
            answers.append((length, index))
            if length and length >= len(query):
                return answers, index + 1
        return answers, len(self.tiers)

    def _lookup(self, key: Sequence[int], shared_only: bool, namespace: str | None = None) -> Any:
        query = checked_tokens(key)  # once: every tier takes it as checked
        answers, not_asked = self._ask_tiers(query, namespace)
        order = [index for _, index in sorted(answers, key=lambda answer: (-answer[0], answer[1]))]
        for index in order + list(range(not_asked, len(self.tiers))):
            tier = self.tiers[index]
            if namespace is not None:
                load: Callable[..., Any] = functools.partial(tier.lookup_prefix, namespace=namespace)
            else:
                load = tier.lookup_prefix if shared_only else tier.__getitem__
            try:
                value = self._guard(index, "load", load, _FAILED, query)
            except KeyError:
                continue
            if value is _FAILED:
                continue
            with self._lock:
                self._hits += 1
            self._promote(index, value)
            self._note_use(index, value)
            return value
        with self._lock:
            self._misses += 1
        raise KeyError("no cached prefix for this key")

    def _promote(self, found_in: int, value: Any) -> None:
        """Store what tier ``found_in`` answered in the faster tiers (tier 0 now, the others behind)."""
        tokens = state_tokens(value)
        if found_in == 0 or tokens is None:
            return  # a value that does not say which tokens it holds cannot be filed anywhere else
        try:
            key = readonly(np.array(as_token_array(tokens), dtype=np.int32))
        except (TypeError, ValueError):
            return  # tokens no cache accepts as a key
        self._store_in(0, key, value)
        if found_in > 1:
            self._enqueue(key, value, 1, found_in)

    def _note_use(self, found_in: int, value: Any) -> None:
        """Note a hit of tier ``found_in`` for the slower tiers that have ``touch`` (see the module)."""
        tokens = state_tokens(value)
        if tokens is None or not any(callable(getattr(tier, "touch", None)) for tier in self.tiers[found_in + 1 :]):
            return
        with self._lock:
            if len(self._touches) >= _MAX_TOUCHES:
                return
            key = np.ascontiguousarray(tokens, dtype=np.int32)
            own = getattr(value, "fingerprint", None)
            namespace = own if isinstance(own, str) and own else None
            self._touches[(namespace, key.tobytes())] = (readonly(key.copy()), found_in + 1)
            if self._touch_queued:
                return
            self._touch_queued = True
        # One slot more than the states': the batch never makes the queue drop a state.
        self._pending.put(_TOUCH, self.max_pending + 1, drop_oldest=True)

    def _touch_slower(self) -> None:
        """Pass the noted hits to the slower tiers' ``touch``, one call per tier; in the writer thread."""
        with self._lock:
            touches, self._touches, self._touch_queued = self._touches, {}, False
        namespaces = {namespace for namespace, _ in touches}
        for index, tier in enumerate(self.tiers):
            if not callable(touch := getattr(tier, "touch", None)):
                continue
            for namespace in namespaces:  # each state's recency is refreshed in its own namespace
                keys = [tokens for (filed, _), (tokens, first) in touches.items() if filed == namespace and first <= index]
                if keys:
                    call = touch if namespace is None else functools.partial(touch, namespace=namespace)
                    self._guard(index, "touch", call, None, keys)

    # ------------------------------------------------------------------------------------- stores

    def __setitem__(self, key: Sequence[int], value: Any) -> None:
        """Store ``value`` in the fastest tier now and queue it for the others (every tier now with
        ``write_through``). Never raises for the value or a failing tier (counted and logged).

        Raises:
            TypeError, ValueError: ``key`` is not a sequence of token ids.
        """
        tokens = readonly(np.array(as_token_array(key), dtype=np.int32))  # the queue keeps its own copy
        self._store_in(0, tokens, value)
        if len(self.tiers) > 1:
            if self.write_through:
                namespace = getattr(value, "fingerprint", None)
                for index in range(1, len(self.tiers)):
                    if callable(announce := getattr(self.tiers[index], "announce", None)):
                        # Announced now, stored behind: whoever looks it up meanwhile waits for it.
                        call = functools.partial(announce, namespace=namespace if isinstance(namespace, str) else None)
                        self._guard(index, "announce", call, None, tokens)
                        self._enqueue(tokens, value, index, index + 1)
                    else:
                        self._store_in(index, tokens, value)
            else:
                self._enqueue(tokens, value, 1, len(self.tiers))

    def announce(self, key: Sequence[int], *, namespace: str | None = None) -> None:
        """Pass an announcement of ``key``'s coming store to the tiers that take one (``announce``: the
        Redis tier, whose lookups in other processes then wait for the store); one call per such tier,
        in the caller's thread. Never raises for a failing tier.

        Raises:
            TypeError, ValueError: ``key`` is not a sequence of token ids.
        """
        tokens = as_token_array(key)
        for index, tier in enumerate(self.tiers):
            if callable(announce := getattr(tier, "announce", None)):
                self._guard(index, "announce", functools.partial(announce, namespace=namespace), None, tokens)

    def _store_in(self, index: int, key: TokenArray, value: Any) -> None:
        self._guard(index, "store", self.tiers[index].__setitem__, None, key, value)

    def _enqueue(self, key: TokenArray, value: Any, first: int, stop: int) -> None:
        dropped = self._pending.put(_Pending(key, value, first, stop), self.max_pending, drop_oldest=True)
        if dropped is not None:
            with self._lock:
                self._dropped += 1
            logger.debug("tiered cache: queue full, dropped a %d-token state", len(dropped.key))

    def _write_pending(self, item: _Pending) -> None:
        """Store a queued state in its tiers, or pass the noted hits on; in the writer thread (never
        raises: ``_guard`` guards)."""
        if item is _TOUCH:
            self._touch_slower()
            return
        for index in range(item.first, item.stop):
            self._store_in(index, item.key, item.value)

    def flush(self) -> None:
        """Wait until every state queued before this call reached its tiers (or was dropped), then flush
        the tiers that have a ``flush`` method (the disk tier's own write-behind)."""
        self._pending.wait()
        for index, tier in enumerate(self.tiers):
            if callable(flush := getattr(tier, "flush", None)):
                self._guard(index, "store", flush, None)

    def close(self) -> None:
        """Flush, stop the writer thread and close the tiers that have a ``close`` method. Idempotent;
        the cache stays usable as far as its tiers do (the disk tier reopens itself)."""
        self.flush()
        writer = self._pending.stop()
        if writer is not None and writer is not threading.current_thread():
            writer.join()
        for index, tier in enumerate(self.tiers):
            if callable(close := getattr(tier, "close", None)):
                self._guard(index, "close", close, None)

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---------------------------------------------------------------------------------- counting

    @property
    def cache_size(self) -> int:
        """Bytes charged by all tiers (after the queued stores); a failing tier counts 0."""
        self._pending.wait()
        size = attrgetter("cache_size")
        return sum(self._guard(index, "count", size, 0, tier) for index, tier in enumerate(self.tiers))

    def __len__(self) -> int:
        """The largest tier's entry count (after the queued stores); a failing tier counts 0."""
        self._pending.wait()
        return max(stats.entries for stats in self._tier_stats())

    def stats(self) -> CacheStats:
        """This cache's lookups and drops, the tiers' sums, and each tier's statistics (see the class)."""
        self._pending.wait()
        tiers = self._tier_stats()
        with self._lock:
            return CacheStats(
                hits=self._hits,
                misses=self._misses,
                entries=max(stats.entries for stats in tiers),
                bytes=sum(stats.bytes for stats in tiers),
                capacity_bytes=self.capacity_bytes,
                evictions=sum(stats.evictions for stats in tiers),
                rejected=sum(stats.rejected for stats in tiers),
                writes=sum(stats.writes for stats in tiers),
                store_errors=self._store_errors + sum(stats.store_errors for stats in tiers),
                lookup_errors=self._lookup_errors + sum(stats.lookup_errors for stats in tiers),
                dropped=self._dropped + sum(stats.dropped for stats in tiers),
                round_trips=sum(stats.round_trips for stats in tiers),
                tiers=tiers,
            )

    def _tier_stats(self) -> tuple[CacheStats, ...]:
        return tuple(
            self._guard(index, "count", tier.stats, CacheStats(0, 0, 0, 0, tier.capacity_bytes, 0, 0))
            for index, tier in enumerate(self.tiers)
        )

    def _guard(self, index: int, action: str, call: Callable[..., _T], fallback: _T, *args: Any) -> _T:
        """``call(*args)`` for tier ``index``, or ``fallback`` if it raised (a ``load``'s KeyError, a miss,
        is raised on).

        A failure is counted (a ``store`` in ``store_errors``, a ``look up`` or ``load`` in
        ``lookup_errors``) and logged, at WARNING the first time for this tier, action and exception
        type, then at DEBUG.
        """
        try:
            return call(*args)
        except Exception as error:  # noqa: BLE001 - nothing a tier raises leaves the tiered cache
            if action == "load" and isinstance(error, KeyError):
                raise
            kind = (index, action, type(error).__name__)
            with self._lock:
                if action == "store":
                    self._store_errors += 1
                elif action in ("look up", "load"):
                    self._lookup_errors += 1
                first = kind not in self._logged
                self._logged.add(kind)
            logger.log(
                logging.WARNING if first else logging.DEBUG,
                "tiered cache: tier %d (%s) failed to %s: %s: %s%s",
                index, type(self.tiers[index]).__name__, action, type(error).__name__, error,
                " (further failures of this kind are logged at DEBUG)" if first else "",
            )
            return fallback

    # -------------------------------------------------------------------------------- namespaces

    @property
    def fingerprint(self) -> str | None:
        """The model fingerprint of the tiers that have ``bind``; None if one is unbound (or none has it)."""
        bound = [getattr(tier, "fingerprint", None) for tier in self.tiers if callable(getattr(tier, "bind", None))]
        return None if not bound or None in bound else bound[0]

    def bind(self, fingerprint: str | llama_cpp.Llama | None, *, model_info: Mapping[str, str] | None = None) -> None:
        """Bind every tier that has a ``bind`` method (the disk tier: answer one model's states only).

        ``llama_cache.Llama.set_cache`` calls it with its model's fingerprint while ``fingerprint`` is
        None.

        Raises:
            TypeError, ValueError: as the tiers' ``bind``.
        """
        for tier in self.tiers:
            if callable(bind := getattr(tier, "bind", None)):
                bind(fingerprint, model_info=model_info)

    # -------------------------------------------------------------------------------- fork hooks

    @property
    def fork_lock(self) -> lifecycle.Lock:
        """The lock guarding this cache's counters and noted hits, held across a fork (see
        :class:`~llama_cache.caches.lifecycle.HeldAcrossFork`)."""
        return self._lock

    def drain(self) -> None:
        """Wait until every state queued before this call reached its tiers (or was dropped); unlike
        :meth:`flush`, flush nothing else. Before a fork the tiers then drain themselves. Thread-safe."""
        self._pending.wait()

    def reset_after_fork(self) -> None:
        """In a forked child: no writer, an empty queue (the parent drained it), fresh locks."""
        super().reset_after_fork()
        self._lock = threading.RLock()
        self._touches, self._touch_queued = {}, False
        self._pending.reset_after_fork()

    def __repr__(self) -> str:
        return f"{type(self).__name__}([{', '.join(map(repr, self.tiers))}], max_pending={self.max_pending})"
