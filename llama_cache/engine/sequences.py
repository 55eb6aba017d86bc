"""One generated sequence's sampling state: its logit biases, its structured output and its log probabilities.

A request's choices are sequences; each has a :class:`SequenceSampling`, which owns what must not be
shared between sequences (a constraint's grammar state, the tokens sampled so far, the log probabilities
recorded) and is given to the engine as the sequence's ``logits_processor`` list, applied to its logits
row in place before its sampler chain (:mod:`.sampling`). Nothing here touches a context: the same
objects serve a sequence whatever else its batch holds.

Log probabilities (:class:`TokenLogprobs`) are the log-softmax of the logits the sampler works on at each
step: the model's row with the ``logit_bias`` added, the tokens a structured output forbids removed, and
the repetition, frequency and presence penalties applied as llama.cpp's penalties sampler applies them
(to the last ``penalty_last_n`` tokens sampled). Temperature and the truncations (top-k, top-p, min-p)
are not applied: the values do not depend on them, as OpenAI's do not.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["LogitBias", "Penalties", "SequenceSampling", "TokenLogprob", "TokenLogprobs"]


class LogitBias:
    """A ``logits_processor`` adding fixed biases to some tokens' logits (``logit_bias``).

    O(len(biases)) per step. Stateless: one can serve every sequence of a request.
    """

    def __init__(self, biases: Mapping[int, float]) -> None:
        self._ids = np.fromiter(biases.keys(), dtype=np.intp, count=len(biases))
        self._values = np.fromiter(biases.values(), dtype=np.float32, count=len(biases))

    def __call__(self, input_ids: npt.NDArray[np.intc], scores: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        scores[self._ids] += self._values
        return scores


@dataclass(frozen=True)
class Penalties:
    """llama.cpp's penalties sampler's settings: applied to the last ``last_n`` sampled tokens."""

    repeat: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0
    last_n: int = 64

    @property
    def active(self) -> bool:
        return self.last_n > 0 and (self.repeat != 1.0 or self.frequency != 0.0 or self.presence != 0.0)

    def apply(self, row: npt.NDArray[np.float32], recent: Counter[int]) -> None:
        """Penalise ``row`` in place for the tokens ``recent`` counts, as ``llama_sampler_penalties_apply``."""
        if not recent or not self.active:
            return
        ids = np.fromiter(recent.keys(), dtype=np.intp, count=len(recent))
        counts = np.fromiter(recent.values(), dtype=np.float32, count=len(recent))
        logits = row[ids]
        logits = np.where(logits <= 0, logits * np.float32(self.repeat), logits / np.float32(self.repeat))
        row[ids] = logits - counts * np.float32(self.frequency) - np.float32(self.presence)


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token's log probability, and the likeliest tokens' at its step (most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class TokenLogprobs:
    """A ``logits_processor`` recording each step's log probabilities; put it last among the processors.

    At each step :meth:`__call__` computes the log-softmax of the (penalised, see the module's docstring)
    row and keeps it; :meth:`took` is then told which token was sampled and records its
    :class:`TokenLogprob`. O(n_vocab) numpy work per step (about 0.1-0.2 ms for 49,152 tokens), one row
    kept. Not thread-safe: one sequence, one thread at a time.

    Args:
        top: how many of the likeliest tokens to list at each step (0 to 20).
        penalties: the sampler's penalties (None: none).
    """

    def __init__(self, top: int, penalties: Penalties | None = None) -> None:
        if not 0 <= top <= 20:
            raise ValueError(f"top must be between 0 and 20, got {top}")
        self._top = top
        self._penalties = penalties if penalties is not None and penalties.active else None
        self._recent: deque[int] = deque(maxlen=penalties.last_n if self._penalties is not None else 0)
        self._counts: Counter[int] = Counter()
        self._row: npt.NDArray[np.float32] | None = None
        self._best: tuple[tuple[int, float], ...] = ()
        self.tokens: list[TokenLogprob] = []
        """The sampled tokens' records, in order."""

    def __call__(self, input_ids: npt.NDArray[np.intc], scores: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        row = self._row
        if row is None or len(row) != len(scores):
            row = self._row = np.empty(len(scores), dtype=np.float32)
        np.copyto(row, scores)
        if self._penalties is not None:
            self._penalties.apply(row, self._counts)
        finite = np.isfinite(row)
        peak = row.max(initial=-np.inf, where=finite)
        if not np.isfinite(peak):
            self._best = ()
            return scores
        with np.errstate(under="ignore"):
            total = np.exp(row - peak, where=finite, out=np.zeros_like(row)).sum(dtype=np.float64)
        row -= np.float32(peak + np.log(total))
        row[~finite] = -np.inf
        self._best = self._likeliest(row, finite)
        return scores

    def _likeliest(self, row: npt.NDArray[np.float32], finite: npt.NDArray[np.bool_]) -> tuple[tuple[int, float], ...]:
        k = min(self._top, int(finite.sum()))
        if k == 0:
            return ()
        candidates = np.argpartition(row, len(row) - k)[len(row) - k :]
        ordered = candidates[np.lexsort((candidates, -row[candidates]))]  # likeliest first, ties by id
        return tuple((int(t), float(row[t])) for t in ordered)

    def took(self, token: int) -> None:
        """The token sampled from the row seen last."""
        row = self._row
        value = float(row[token]) if row is not None and 0 <= token < len(row) else float("-inf")
        self.tokens.append(TokenLogprob(int(token), value, self._best))
        if self._penalties is not None:
            if len(self._recent) == self._recent.maxlen:
                dropped = self._recent[0]
                self._counts[dropped] -= 1
                if self._counts[dropped] == 0:
                    del self._counts[dropped]
            self._recent.append(int(token))
            self._counts[int(token)] += 1


@dataclass
class SequenceSampling:
    """What one sequence samples with, besides llama-cpp-python's own options, and what it recorded.

    ``processors()`` is its ``logits_processor`` list, in order: the constraint (masks), the biases,
    the log probabilities (which see the row the sampler's next stages see). :meth:`took` is told every
    sampled token, in order (end-of-generation tokens included).
    """

    seed: int | None = None
    constraint: Callable[[Any, Any], Any] | None = None
    """A structured output's mask, a ``logits_processor`` (the server's ``SequenceConstraint``)."""
    bias: LogitBias | None = None
    logprobs: TokenLogprobs | None = None
    sampled: list[int] = field(default_factory=list)

    def processors(self) -> list[Callable[[Any, Any], Any]]:
        chain: list[Callable[[Any, Any], Any]] = []
        if self.constraint is not None:
            chain.append(self.constraint)
        if self.bias is not None:
            chain.append(self.bias)
        if self.logprobs is not None:
            chain.append(self.logprobs)
        return chain

    def took(self, token: int) -> None:
        self.sampled.append(int(token))
        if self.logprobs is not None:
            self.logprobs.took(token)
