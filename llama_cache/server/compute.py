"""One thread evaluates for every context: the server's llama.cpp compute, scheduled in rounds.

Why one thread: llama.cpp's CPU backend (built with OpenMP, as llama-cpp-python's wheel is) gives
every thread that calls ``llama_decode`` a team of worker threads that outlives the call. Once the
process holds more OpenMP threads than CPUs, libgomp stops spinning at its barriers and sleeps at each
of the hundreds a decode has: a token of the default model then takes about twice as long (measured:
8.3 ms from one calling thread, 17-18 ms as soon as a second calling thread had decoded once). Several
contexts computing at once would also share the same cores, each with all of its threads. So every
context's evaluations run here, one at a time, each with all the threads it was given.

Scheduling, in rounds like ``llama-server``'s batches: a round serves every *short* evaluation waiting
(a generated token, the new tokens of a conversation's next turn: at most :data:`SHORT_TOKENS`) once,
then one chunk of the oldest *long* one (a prompt being read). A long evaluation is cut into chunks of
at most the context's batch, :data:`FAIR_CHUNK_TOKENS` while other prompts wait, and
:data:`GENERATING_CHUNK_TOKENS` while contexts are generating (a short evaluation waits, or ran in
this round), and keeps its place at the head of the long ones: the oldest prompt is read first (the
earliest request gets its first token first) and no other context waits for more than one chunk. A
generating context's next token thus waits for at most one small chunk of someone else's prompt,
however long that prompt is: a client sending prompts that fill the context slows the others'
generation by a bounded factor, at the price of reading those prompts in smaller (slower) batches.

Copies of a context's state out and in (:meth:`ComputeThread.call`) run here too, in turn with the
short evaluations: they are memory-bound work that, on another thread, takes a core from the evaluation
running (measured: a next turn's 20 tokens took 182 ms instead of 126 ms beside another context's save).

Thread-safety: :meth:`ComputeThread.evaluate` and :meth:`ComputeThread.call` may be called from any
thread but this one; each call blocks its caller until its work is done.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

__all__ = ["FAIR_CHUNK_TOKENS", "GENERATING_CHUNK_TOKENS", "SHORT_TOKENS", "ComputeThread", "EvaluationCancelled"]

_T = TypeVar("_T")

SHORT_TOKENS = 64
"""Evaluations of at most this many tokens (generation steps, a next turn's new tokens) go first."""
FAIR_CHUNK_TOKENS = 256
"""The chunk a long evaluation is cut into while other evaluations wait (reading a prompt in chunks of
256 instead of 512 costs about 1.5% with the default model; 128 would cost 6%)."""
GENERATING_CHUNK_TOKENS = 64
"""The chunk a long evaluation is cut into while other contexts generate: each of their tokens waits for
at most this many tokens of another context's prompt."""


class EvaluationCancelled(Exception):
    """The evaluation's ``cancelled`` check answered True between two chunks; the rest was not evaluated."""


@dataclass(eq=False)
class _Evaluation:
    evaluate: Callable[[Sequence[int]], None]
    tokens: Sequence[int]
    batch: int
    cancelled: Callable[[], bool] | None
    counted: bool = True  # False for :meth:`ComputeThread.call`'s jobs
    future: Future[None] = field(default_factory=Future)
    done: int = 0

    @property
    def short(self) -> bool:
        return len(self.tokens) - self.done <= SHORT_TOKENS


class ComputeThread:
    """The one thread that runs every context's evaluations (see the module's docstring).

    Args:
        name: the thread's name.

    Counters (read them from any thread): ``evaluations`` (calls made to an ``evaluate`` function)
    and ``tokens`` (tokens evaluated).
    """

    def __init__(self, name: str = "llama-cache-compute") -> None:
        self._condition = threading.Condition()
        self._short: deque[_Evaluation] = deque()
        self._long: deque[_Evaluation] = deque()
        self._short_in_round = 0  # short evaluations the current round still serves before a long chunk
        self._generating = False  # a short evaluation ran since the last long chunk or idle spell
        self._closed = False
        self.evaluations = 0
        self.tokens = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def on_thread(self) -> bool:
        """Whether the caller is the compute thread itself."""
        return threading.current_thread() is self._thread

    @property
    def waiting(self) -> int:
        """Evaluations waiting for the thread (not counting the one it runs)."""
        with self._condition:
            return len(self._short) + len(self._long)

    def evaluate(self, evaluate: Callable[[Sequence[int]], None], tokens: Sequence[int], batch: int,
                 cancelled: Callable[[], bool] | None = None) -> None:
        """Run ``evaluate`` on consecutive slices of ``tokens`` in the compute thread; wait for the last.

        Args:
            evaluate: evaluates a slice after the previous ones (``llama_cache.Llama.eval`` of one context).
            tokens: everything to evaluate; empty: ``evaluate`` is called once with it.
            batch: the largest slice (the context's ``n_batch``).
            cancelled: asked between slices; True stops the evaluation there.

        Raises:
            EvaluationCancelled: ``cancelled()`` was True before the last slice.
            RuntimeError: the thread is closed.
            Exception: whatever ``evaluate`` raised (the slices after it are not evaluated).
        """
        if batch <= 0:
            raise ValueError(f"batch must be positive, got {batch}")
        self._submit(_Evaluation(evaluate, tokens, batch, cancelled))

    def call(self, function: Callable[[], _T]) -> _T:
        """Run ``function()`` on the compute thread, in turn with the short evaluations; return its result.

        For a context's state copied out or in (``llama_state_seq_get_data``/``set_data``: tens of MB
        of memory-bound copying), which on another thread would take a core from the evaluation
        running and stall its threads at every barrier.

        Raises:
            RuntimeError: the thread is closed, or this is called from it.
            Exception: whatever ``function`` raised.
        """
        box: list[_T] = []
        self._submit(_Evaluation(lambda _: box.append(function()), (), 1, None, counted=False))
        return box[0]

    def _submit(self, job: _Evaluation) -> None:
        if self.on_thread():
            raise RuntimeError("called from the compute thread itself, which would wait for itself")
        with self._condition:
            if self._closed:
                raise RuntimeError("the compute thread is closed")
            (self._short if job.short else self._long).append(job)
            self._condition.notify()
        job.future.result()

    def close(self) -> None:
        """Finish the evaluations already submitted, then stop the thread. Idempotent."""
        with self._condition:
            self._closed = True
            self._condition.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _next(self) -> _Evaluation | None:
        with self._condition:
            while not (self._short or self._long or self._closed):
                self._generating = False  # idle: nobody's tokens are waiting on a chunk
                self._condition.wait()
            if self._short and (self._short_in_round > 0 or not self._long):
                self._short_in_round = max(self._short_in_round - 1, 0)
                self._generating = True
                return self._short.popleft()
            if self._long:
                return self._long.popleft()
            return None  # closed, nothing left

    def _run(self) -> None:
        while (job := self._next()) is not None:
            try:
                self._step(job)
            except BaseException as error:  # noqa: BLE001 - the caller gets it; this thread serves on
                job.future.set_exception(error)

    def _chunk_limit(self, batch: int) -> int:
        """The most tokens the next chunk of a long evaluation may have (see the module's docstring)."""
        with self._condition:
            if self._short or self._generating:
                return GENERATING_CHUNK_TOKENS
            return FAIR_CHUNK_TOKENS if self._long else batch

    def _step(self, job: _Evaluation) -> None:
        """Evaluate one slice of ``job``; put it back in line or complete its future."""
        remaining = len(job.tokens) - job.done
        was_long = remaining > SHORT_TOKENS
        if job.done > 0 and job.cancelled is not None and job.cancelled():
            raise EvaluationCancelled()
        n = min(remaining, job.batch, self._chunk_limit(job.batch) if was_long else job.batch)
        job.evaluate(job.tokens[job.done : job.done + n])
        if job.counted:
            self.evaluations += 1
            self.tokens += n
        job.done += n
        finished = job.done == len(job.tokens)
        with self._condition:
            if not finished:
                if job.short:  # what is left of a prompt is short now: it waits with those
                    self._short.append(job)
                else:
                    self._long.appendleft(job)  # the oldest prompt goes on being read first
            if was_long:  # a round ends with a long chunk; the next serves every short one waiting
                self._short_in_round = len(self._short)
                self._generating = False
        if finished:
            job.future.set_result(None)
