"""Contexts ("slots"), the fair queue in front of them, and the routing of a request to one.

Each slot is one :class:`llama_cache.Llama` (its own llama.cpp context); every slot shares one prompt
cache. A request holds its slot from the first prompt token to the last generated one, so a context is
never used by two requests at once, and requests never cancel one another.

Routing, in order (llama.cpp's server chooses the same way): the free slot whose live tokens the prompt
extends (the longest such; it evaluates only the new tokens, restoring nothing), else the least recently
used free slot, which restores the best prefix from the shared cache. When no slot is free the request
waits in a FIFO queue of bounded length; a full queue refuses at once (:class:`QueueFull`, a 503).

A streamed answer ends for its client as soon as its last chunk is out; its slot stays busy while the
completion's state is saved into the prompt cache (:meth:`SlotPool.answered`). A conversation's next
turn that arrives meanwhile waits for that slot, whose live tokens it extends, ahead of the queue,
rather than taking another one and restoring an older state (or none, the save being unfinished).

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import jinja2
import llama_cpp
import numpy as np
import numpy.typing as npt

from llama_cache.llama import Llama

__all__ = ["Job", "QueueFull", "Slot", "SlotLlama", "SlotPool", "prompt_tokens_for_chat", "run_job"]

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    """Every slot is busy and the queue holds its maximum of waiting requests."""


class Cancelled(Exception):
    """A job's client went away or the server is stopping (its generation was stopped)."""


class SlotLlama(Llama):
    """A :class:`llama_cache.Llama` whose completions also obey the running request's stop check.

    ``request_stop``, when set, is added to every completion's stopping criteria (chat handlers replace
    the caller's criteria with their own, so it cannot be passed as an argument): llama-cpp-python calls
    it after each sampled token, which is how a request is timed and how a cancelled one stops.
    """

    request_stop: Callable[[npt.NDArray[np.intc], npt.NDArray[np.single]], bool] | None = None

    def _create_completion(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        extra = self.request_stop
        if extra is not None:
            existing = kwargs.get("stopping_criteria") or []
            kwargs["stopping_criteria"] = llama_cpp.StoppingCriteriaList([*existing, extra])
        return super()._create_completion(*args, **kwargs)


@dataclass
class Slot:
    """One context: its ``Llama``, a copy of its live tokens (updated when it is released) and its use."""

    index: int
    llama: SlotLlama
    live: npt.NDArray[np.intc] = field(default_factory=lambda: np.empty(0, dtype=np.intc))
    last_used: int = 0


class _Captured(Exception):
    def __init__(self, prompt: list[int]) -> None:
        super().__init__("prompt captured")
        self.prompt = prompt


class _PromptProbe:
    """Stands in for a ``Llama`` in a chat handler: tokenizes as it would, stops at ``create_completion``.

    Chat handlers render the messages with the model's template, tokenize, and call
    ``llama.create_completion(prompt=tokens, ...)``; capturing that argument gives the exact tokens
    the real call will evaluate, for routing and for the context-length check.
    """

    def __init__(self, llama: Llama) -> None:
        self._llama = llama
        self.verbose = False

    def create_completion(self, prompt: Any = None, **_: Any) -> Any:
        if isinstance(prompt, str):
            raise _Captured(self._llama.tokenize(prompt.encode("utf-8"), special=True))
        raise _Captured(list(prompt))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llama, name)


def prompt_tokens_for_chat(llama: Llama, messages: list[dict[str, Any]], **template_options: Any) -> list[int]:
    """The tokens ``llama.create_chat_completion(messages, **template_options)`` would evaluate.

    Only tokenizes (thread-safe on a shared model); evaluates nothing.

    Raises:
        ValueError: the chat handler refused the messages or options (an unknown tool, say).
    """
    handler = (
        llama.chat_handler
        or llama._chat_handlers.get(llama.chat_format)  # noqa: SLF001 - what create_chat_completion uses
        or llama_cpp.llama_chat_format.get_chat_completion_handler(llama.chat_format)
    )
    try:
        handler(llama=_PromptProbe(llama), messages=messages, **template_options)  # type: ignore[arg-type]
    except _Captured as captured:
        return captured.prompt
    except (TypeError, KeyError, AttributeError, jinja2.TemplateError) as error:
        raise ValueError(f"the chat template could not render these messages: {error}") from None
    raise ValueError("the chat handler produced no prompt")


def common_prefix(a: npt.NDArray[np.intc], b: npt.NDArray[np.intc]) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    different = np.flatnonzero(a[:n] != b[:n])
    return int(different[0]) if len(different) else n


def live_tokens(llama: Llama) -> npt.NDArray[np.intc]:
    """A copy of the tokens a context has evaluated."""
    return np.array(llama.input_ids[: llama.n_tokens], dtype=np.intc)


class SlotPool:
    """The slots and the FIFO queue of requests waiting for one.

    Args:
        slots: the contexts (at least one).
        max_queue: requests that may wait while every slot is busy; one more is refused.

    Used from the event loop's thread only.
    """

    def __init__(self, slots: list[Slot], max_queue: int) -> None:
        if not slots:
            raise ValueError("a slot pool needs at least one slot")
        if max_queue < 0:
            raise ValueError(f"max_queue must not be negative, got {max_queue}")
        self.slots = slots
        self.max_queue = max_queue
        self._free: list[Slot] = list(slots)
        self._waiters: deque[tuple[npt.NDArray[np.intc], asyncio.Future[Slot]]] = deque()
        # Busy slots whose request has its whole answer (by index), with the request waiting for each.
        self._finishing: dict[int, asyncio.Future[Slot] | None] = {}
        self._clock = itertools.count(1)
        self.routed_to_live = 0
        """Requests given a slot whose live tokens they extend (nothing restored)."""

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a slot."""
        waiting = [future for _, future in self._waiters] + [f for f in self._finishing.values() if f is not None]
        return sum(1 for future in waiting if not future.done())

    @property
    def running(self) -> int:
        """Slots serving a request."""
        return len(self.slots) - len(self._free)

    async def acquire(self, prompt: list[int]) -> Slot:
        """A slot for a request with this prompt, waiting in FIFO order if none is free.

        A prompt that extends the live tokens of a slot whose request is answered but not yet released
        (see :meth:`answered`) more than any free slot's waits for that slot, ahead of the queue: the
        slot is about to be free, and the conversation goes on where its tokens are instead of
        restoring, on whichever slot frees first, a state the cache may not hold yet. Cancelling the
        wait leaves the queue (or gives back a slot granted meanwhile).

        Raises:
            QueueFull: every slot is busy and ``max_queue`` requests already wait.
        """
        tokens = np.asarray(prompt, dtype=np.intc)
        finishing = self._finishing_extended_by(tokens)
        if finishing is not None:
            return await self._wait_for_finishing(finishing)
        if self._free and not self._waiters:
            return self._take(tokens)
        if len(self._waiters) >= self.max_queue:
            raise QueueFull()
        future: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        entry = (tokens, future)
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

        The slot stays busy until :meth:`release`; meanwhile a request whose prompt extends ``live``
        (the conversation's next turn) waits for it instead of taking another slot.
        """
        if any(free is slot for free in self._free):
            return  # released already: nothing left to wait for
        slot.live = live
        self._finishing.setdefault(slot.index, None)

    def release(self, slot: Slot) -> None:
        """Give a slot back (its request finished) and hand free slots to the oldest waiters."""
        slot.live = live_tokens(slot.llama)
        slot.last_used = next(self._clock)
        waiting = self._finishing.pop(slot.index, None)
        if waiting is not None and not waiting.done():
            self.routed_to_live += 1
            waiting.set_result(slot)
            return
        self._free.append(slot)
        while self._waiters and self._free:
            tokens, future = self._waiters.popleft()
            if not future.done():
                future.set_result(self._take(tokens))

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

    def _finishing_extended_by(self, tokens: npt.NDArray[np.intc]) -> Slot | None:
        """The finishing slot nobody waits for whose live tokens ``tokens`` extend, if longer than a free one's."""
        candidates = [slot for slot in self.slots if self._finishing.get(slot.index, False) is None]
        best = _longest_extended(candidates, tokens)
        free = _longest_extended(self._free, tokens)
        if best is None or (free is not None and len(free.live) >= len(best.live)):
            return None
        return best

    def _take(self, tokens: npt.NDArray[np.intc]) -> Slot:
        best = _longest_extended(self._free, tokens)
        if best is not None:
            self.routed_to_live += 1
        else:
            best = min(self._free, key=lambda s: s.last_used)
        self._free.remove(best)
        best.last_used = next(self._clock)
        return best


def _longest_extended(slots: list[Slot], tokens: npt.NDArray[np.intc]) -> Slot | None:
    """The slot with the most live tokens that ``tokens`` extend (all of them, in order), if any."""
    best: Slot | None = None
    for slot in slots:
        n = len(slot.live)
        if 0 < n <= len(tokens) and common_prefix(slot.live, tokens) == n and (best is None or n > len(best.live)):
            best = slot
    return best


@dataclass(eq=False)
class Job:
    """One request's run on a slot, as seen by the worker thread and the event loop.

    ``cancel`` stops the generation at the next token; ``first_token_at`` is the monotonic time of the
    first sampled token; ``sampled`` counts sampled tokens; ``answered`` is set once a stream's last
    chunk (the one with a finish reason) has been emitted: what runs after is bookkeeping, which a
    cancellation no longer turns into a cancelled request.
    """

    started_at: float
    cancel: threading.Event = field(default_factory=threading.Event)
    first_token_at: float | None = None
    sampled: int = 0
    prompt_tokens: int = 0
    prompt_tokens_evaluated: int = 0
    completed: bool = False
    answered: bool = False

    def stop_check(self, input_ids: Any, logits: Any) -> bool:
        """The stopping criterion llama-cpp-python calls after each sampled token."""
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.sampled += 1
        return self.cancel.is_set()


def run_job(slot: Slot, job: Job, call: Callable[[SlotLlama], Any], emit: Callable[[Any], None] | None,
            answered: Callable[[npt.NDArray[np.intc]], None] | None = None) -> Any:
    """Run ``call(slot.llama)`` in this (worker) thread; stream its chunks to ``emit`` if given.

    Args:
        slot: the slot the request holds (released by the caller once this returns).
        job: the request's cancellation flag and counters, filled in here.
        call: starts the completion (``create_completion`` / ``create_chat_completion``).
        emit: for streams, receives each chunk; None for a non-streamed completion, returned whole.
        answered: for streams, called with the context's live tokens right after the last chunk was
            emitted, while llama-cpp-python has yet to save the completion's state into the cache.

    Returns:
        The completion (non-streamed) or None.

    Raises:
        Cancelled: the job was cancelled before its answer was complete (the generation stopped; the
            context is consistent).
        ValueError: llama-cpp-python refused the request.
    """
    llama = slot.llama
    llama.request_stop = job.stop_check
    try:
        result = call(llama)
        if emit is not None:
            for chunk in result:
                if job.cancel.is_set() or job.answered:
                    continue  # run the generator to its end: it saves the state there
                emit(chunk)
                if _finish_reason(chunk) is not None:
                    job.answered = True
                    if answered is not None:
                        answered(live_tokens(llama))
            result = None
        job.completed = True
        if job.first_token_at is not None:
            job.prompt_tokens = llama.last_prompt_length
            job.prompt_tokens_evaluated = llama.last_prompt_tokens_evaluated
    finally:
        llama.request_stop = None
        # llama-cpp-python asks the criteria once more after its loop; that call sampled nothing.
        if job.completed and job.sampled > 0:
            job.sampled -= 1
    if job.cancel.is_set() and not job.answered:
        raise Cancelled()
    return result


def _finish_reason(chunk: Any) -> str | None:
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    return choices[0].get("finish_reason") if choices and isinstance(choices[0], dict) else None
