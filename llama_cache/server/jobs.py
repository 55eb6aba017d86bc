"""One request's run: its cancellation flag, its timing, and the worker thread that drives it.

Thread-safety: a :class:`Job` is shared by the event loop (which cancels it and reads its counts) and
its worker thread (which runs it, :func:`run_job`); its fields are written by one side each.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llama_cache.server.choices import ANSWERED, ChoiceRun, Usage

__all__ = ["Cancelled", "Job", "run_job"]


class Cancelled(Exception):
    """A job's client went away or the server is stopping (its generation was stopped)."""


@dataclass(eq=False)
class Job:
    """One request's run, as seen by the worker thread and the event loop.

    ``cancel`` stops the generation at the next step; ``first_token_at`` is the monotonic time of the
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
        """The stopping criterion told of each sampled token (on the engine's thread)."""
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        return self.cancel.is_set()


def run_job(job: Job, call: Callable[[], Any], emit: Callable[[Any], None] | None,
            answered: Callable[[], None] | None = None) -> Any:
    """Run ``call()`` in this (worker) thread; stream its chunks to ``emit`` if given.

    Args:
        job: the request's cancellation flag, marked here.
        call: runs the completion (:meth:`.ChoiceRun.complete` or :meth:`.ChoiceRun.stream`).
        emit: for streams, receives each chunk; None for a non-streamed completion, returned whole.
        answered: for streams, called right after the last chunk was emitted (:data:`~.choices.ANSWERED`),
            before the completion's state is stored in the cache tiers.

    Returns:
        The completion (non-streamed) or None.

    Raises:
        Cancelled: the job was cancelled before its answer was complete (the generation stopped).
        ValueError: the request was refused.
    """
    result = call()
    if emit is not None:
        for chunk in result:
            if chunk is ANSWERED:
                if job.cancel.is_set():
                    continue  # stopped early: not an answer
                job.answered = True
                if answered is not None:
                    answered()
            elif not (job.cancel.is_set() or job.answered):
                emit(chunk)
            # else: run the generator to its end: it stores the state there
        result = None
    job.completed = True
    if job.cancel.is_set() and not job.answered:
        raise Cancelled()
    return result
