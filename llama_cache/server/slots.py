"""Slots (the contexts a request can hold), the fair queue in front of them, and the routing to one.

Each slot is one :class:`~.contexts.SlotLlama` (its own llama.cpp context); every slot shares one prompt
cache. A request holds its slot from the first prompt token to the last generated one, so a context is
never used by two requests at once, and requests never cancel one another.

Routing: a request goes to the free slot whose live tokens it reuses most, when that beats what the
prompt cache holds for it (asked of every tier by the app, off the event loop, without loading
anything: a state another instance stored in a shared tier counts as much as one in RAM): all of the slot's live
tokens (the conversation goes on where it is: nothing restored), or a shared head of at least
:data:`MIN_SHARED_TOKENS` longer than the cache's match (the slot's KV is cut back to it; llama.cpp's
server chooses by such a shared prefix too). Otherwise the least recently used free slot takes it and
restores the cache's best prefix. When no slot is free the request waits in a FIFO queue of bounded
length; a full queue refuses at once (:class:`QueueFull`, a 503).

A streamed answer ends for its client as soon as its last chunk is out; its slot stays busy while the
completion's state is saved into the prompt cache (:meth:`SlotPool.answered`). A request that would
reuse more of that slot's live tokens than of any free slot's or the cache's (a conversation's next
turn, or another conversation on the same system prompt right after the first) waits for that slot,
ahead of the queue, rather than taking another one and evaluating what the unfinished save would have
given it.

Namespaces: a slot's live tokens belong to the cache namespace of the request that left them (its
``fingerprint``, see :meth:`llama_cache.Llama.set_cache_namespace`). A request is routed by, and waits
for, the live tokens of its own namespace's slots only: another tenant's conversation is neither reused
nor waited for, so routing reveals nothing across namespaces either.

Thread-safety: :class:`SlotPool` is used from the event loop's thread only; each slot's ``Llama`` is
used by the worker thread running its request only (see :func:`run_job`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from llama_cache.server.choices import ANSWERED, ChoiceRun, Usage
from llama_cache.server.compute import EvaluationCancelled
from llama_cache.server.contexts import MIN_SHARED_TOKENS, SlotLlama, common_prefix, live_tokens

__all__ = ["Job", "QueueFull", "Slot", "SlotPool", "run_job"]

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    """Every slot is busy and the queue holds its maximum of waiting requests."""


class Cancelled(Exception):
    """A job's client went away or the server is stopping (its generation was stopped)."""


@dataclass
class Slot:
    """One context: its ``Llama``, a copy of its live tokens and their namespace (updated when it is
    released), and its use."""

    index: int
    llama: SlotLlama
    live: npt.NDArray[np.intc] = field(default_factory=lambda: np.empty(0, dtype=np.intc))
    last_used: int = 0
    fingerprint: str = ""


class SlotPool:
    """The slots and the FIFO queue of requests waiting for one.

    Args:
        slots: the contexts (at least one).
        max_queue: requests that may wait while every slot is busy; one more is refused.
        cached: how many leading tokens of a prompt the prompt cache would restore in a namespace
            (``(tokens, fingerprint) -> int``: its fastest tier's ``match_length``, O(K), loads nothing);
            None: routing does not consult the cache.

    Used from the event loop's thread only.
    """

    def __init__(self, slots: list[Slot], max_queue: int,
                 cached: Callable[[npt.NDArray[np.intc], str], int] | None = None) -> None:
        if not slots:
            raise ValueError("a slot pool needs at least one slot")
        if max_queue < 0:
            raise ValueError(f"max_queue must not be negative, got {max_queue}")
        self.slots = slots
        self.max_queue = max_queue
        self._model_fingerprint = slots[0].llama.fingerprint
        self._cached = cached
        self._free: list[Slot] = list(slots)
        for slot in slots:
            if not slot.fingerprint:
                slot.fingerprint = slot.llama.fingerprint
        self._waiters: deque[tuple[npt.NDArray[np.intc], int, str, asyncio.Future[Slot]]] = deque()
        # Busy slots whose request has its whole answer (by index), with the request waiting for each.
        self._finishing: dict[int, asyncio.Future[Slot] | None] = {}
        self._clock = itertools.count(1)
        self.routed_to_live = 0
        """Requests given a slot whose live tokens they reuse (nothing restored from the cache)."""

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a slot."""
        waiting = [future for _, _, _, future in self._waiters] + [f for f in self._finishing.values() if f is not None]
        return sum(1 for future in waiting if not future.done())

    @property
    def running(self) -> int:
        """Slots serving a request."""
        return len(self.slots) - len(self._free)

    async def acquire(self, prompt: list[int], cached: int | None = None, fingerprint: str | None = None) -> Slot:
        """A slot for a request with this prompt, waiting in FIFO order if none is free.

        ``fingerprint`` is the request's cache namespace (None: the model's own, the first slot's
        fingerprint when the pool was made): only slots whose live tokens are of that namespace are
        routed to for them.

        ``cached`` is how many leading tokens of the prompt the prompt cache would restore, when the
        caller asked it already (every tier's match, asked off the event loop); None: the pool asks
        its ``cached`` callable.

        A prompt that reuses more live tokens of a slot whose request is answered but not yet released
        (see :meth:`answered`) than of any free slot, and more than the cache holds, waits for that
        slot, ahead of the queue: it is about to be free, and its tokens are there, while the cache may
        not hold them yet. Cancelling the wait leaves the queue (or gives back a slot granted meanwhile).

        Raises:
            QueueFull: every slot is busy and ``max_queue`` requests already wait.
        """
        tokens = np.asarray(prompt, dtype=np.intc)
        namespace = fingerprint if fingerprint is not None else self._model_fingerprint
        if cached is None:
            cached = self._cached_length(tokens, namespace)
        finishing = self._finishing_worth_waiting_for(tokens, cached, namespace)
        if finishing is not None:
            return await self._wait_for_finishing(finishing)
        if self._free and not self._waiters:
            return self._take(tokens, cached, namespace)
        if len(self._waiters) >= self.max_queue:
            raise QueueFull()
        future: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        entry = (tokens, cached, namespace, future)
        self._waiters.append(entry)
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(future.result())
            else:
                try:
                    self._waiters.remove(entry)
                except ValueError:
                    pass
            raise

    def answered(self, slot: Slot, live: npt.NDArray[np.intc]) -> None:
        """The request on ``slot`` has its whole answer; ``live`` are the tokens its context now holds.

        The slot stays busy until :meth:`release`; meanwhile a request that would reuse ``live`` more
        than anything free (the conversation's next turn) waits for it instead of taking another slot.
        """
        if any(free is slot for free in self._free):
            return  # released already: nothing left to wait for
        slot.live = live
        self._finishing.setdefault(slot.index, None)

    def release(self, slot: Slot) -> None:
        """Give a slot back (its request finished) and hand free slots to the oldest waiters."""
        slot.live = live_tokens(slot.llama)
        slot.fingerprint = slot.llama.fingerprint
        slot.last_used = next(self._clock)
        waiting = self._finishing.pop(slot.index, None)
        if waiting is not None and not waiting.done():
            self.routed_to_live += 1
            waiting.set_result(slot)
            return
        self._free.append(slot)
        while self._waiters and self._free:
            tokens, cached, namespace, future = self._waiters.popleft()
            if not future.done():
                future.set_result(self._take(tokens, cached, namespace))

    async def _wait_for_finishing(self, slot: Slot) -> Slot:
        future: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        self._finishing[slot.index] = future
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(future.result())
            elif self._finishing.get(slot.index) is future:
                self._finishing[slot.index] = None
            raise

    def _cached_length(self, tokens: npt.NDArray[np.intc], fingerprint: str) -> int:
        if self._cached is None:
            return 0
        try:
            return int(self._cached(tokens, fingerprint))
        except Exception as error:  # noqa: BLE001 - routing only: a failing cache is an empty one
            logger.debug("prompt cache match_length failed: %s: %s", type(error).__name__, error)
            return 0

    def _finishing_worth_waiting_for(self, tokens: npt.NDArray[np.intc], cached: int, fingerprint: str
                                     ) -> Slot | None:
        """The finishing slot of the namespace nobody waits for whose live tokens the prompt reuses more
        than anything else's."""
        free, free_reused = _most_reused(self._free, tokens, cached, fingerprint)
        floor = max(cached, free_reused if free is not None else 0)
        candidates = [slot for slot in self.slots if self._finishing.get(slot.index, False) is None]
        best, reused = _most_reused(candidates, tokens, floor, fingerprint)
        return best if best is not None and reused > floor else None

    def _take(self, tokens: npt.NDArray[np.intc], cached: int, fingerprint: str) -> Slot:
        best, _ = _most_reused(self._free, tokens, cached, fingerprint)
        if best is not None:
            self.routed_to_live += 1
        else:
            best = min(self._free, key=lambda s: s.last_used)
        self._free.remove(best)
        best.last_used = next(self._clock)
        return best


def _most_reused(slots: list[Slot], tokens: npt.NDArray[np.intc], cached: int, fingerprint: str
                 ) -> tuple[Slot | None, int]:
    """The slot of namespace ``fingerprint`` whose live tokens ``tokens`` reuse most, if worth more than
    ``cached`` tokens from the cache.

    Worth it: all of the slot's live tokens, at least ``cached`` of them (nothing to restore, nothing
    lost); or a shared head of at least :data:`MIN_SHARED_TOKENS`, more than ``cached``. Between equal
    heads, one that is all of a slot's live tokens wins. Returns (slot, tokens reused) or (None, 0).
    """
    best: Slot | None = None
    best_key = (0, False)
    for slot in slots:
        n = len(slot.live)
        if n == 0 or slot.fingerprint != fingerprint:
            continue
        reused = common_prefix(slot.live, tokens)
        extends = reused == n
        if not ((extends and reused >= cached) or (reused >= MIN_SHARED_TOKENS and reused > cached)):
            continue
        if best is None or (reused, extends) > best_key:
            best, best_key = slot, (reused, extends)
    return best, best_key[0]


@dataclass(eq=False)
class Job:
    """One request's run on a slot, as seen by the worker thread and the event loop.

    ``cancel`` stops the generation at the next token; ``first_token_at`` is the monotonic time of the
    first sampled token; ``run`` is the request's :class:`~.choices.ChoiceRun`, whose counts the
    metrics read; ``answered`` is set once a stream's last chunk has been emitted (see
    :data:`~.choices.ANSWERED`): what runs after is bookkeeping, which a cancellation no longer turns
    into a cancelled request.
    """

    started_at: float
    cancel: threading.Event = field(default_factory=threading.Event)
    first_token_at: float | None = None
    run: ChoiceRun | None = None
    completed: bool = False
    answered: bool = False
    key: str | None = None  # the API key's id in the metrics, when keys are configured

    @property
    def sampled(self) -> int:
        """Tokens sampled for the request, over all its choices (end-of-generation tokens included)."""
        return sum(len(sampling.sampled) for sampling in self.run.samplings) if self.run is not None else 0

    @property
    def usage(self) -> Usage | None:
        """The request's token counts, once its prompt is evaluated (None before)."""
        return self.run.usage if self.run is not None and self.run.usage.prompt_known else None

    def stop_check(self, input_ids: Any, logits: Any) -> bool:
        """The stopping criterion llama-cpp-python calls after each sampled token."""
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        return self.cancel.is_set()


def run_job(slot: Slot, job: Job, call: Callable[[SlotLlama], Any], emit: Callable[[Any], None] | None,
            answered: Callable[[npt.NDArray[np.intc]], None] | None = None) -> Any:
    """Run ``call(slot.llama)`` in this (worker) thread; stream its chunks to ``emit`` if given.

    Args:
        slot: the slot the request holds (released by the caller once this returns).
        job: the request's cancellation flag, marked here.
        call: runs the completion (:meth:`.ChoiceRun.complete` or :meth:`.ChoiceRun.stream`).
        emit: for streams, receives each chunk; None for a non-streamed completion, returned whole.
        answered: for streams, called with the context's live tokens right after the last chunk was
            emitted (:data:`~.choices.ANSWERED`), while llama-cpp-python has yet to save the
            completion's state into the cache.

    Returns:
        The completion (non-streamed) or None.

    Raises:
        Cancelled: the job was cancelled before its answer was complete (the generation stopped; the
            context is consistent).
        ValueError: llama-cpp-python refused the request.
    """
    llama = slot.llama
    llama.request_stop = job.stop_check
    llama.request_cancelled = job.cancel.is_set
    try:
        result = call(llama)
        if emit is not None:
            for chunk in result:
                if chunk is ANSWERED:
                    if job.cancel.is_set():
                        continue  # stopped early: not an answer
                    job.answered = True
                    if answered is not None:
                        answered(live_tokens(llama))
                elif not (job.cancel.is_set() or job.answered):
                    emit(chunk)
                # else: run the generator to its end: it saves the state there
            result = None
        job.completed = True
    except EvaluationCancelled:
        raise Cancelled() from None  # stopped while reading its prompt; the context holds what was read
    finally:
        llama.request_stop = None
        llama.request_cancelled = None
        llama.token_watcher = None
        llama.prompt_substitute = None
    if job.cancel.is_set() and not job.answered:
        raise Cancelled()
    return result

