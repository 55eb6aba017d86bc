"""Which sequence of the engine's context holds which tokens, and how many cells they take.

A :class:`Resident` is one sequence id of the context with the tokens its cells hold (positions
``0..n-1``), the cache namespace they belong to (its fingerprint), and whether a running generation
owns it (``busy``) or it is *idle*: kept for reuse, the fastest tier of the cache, and evicted least
recently used when ids or cells run out.

Cells are shared between sequences by ``llama_memory_seq_cp``, so a sequence's tokens are not all
its own. Each resident's positions are a list of spans of *blocks*: a block is a run of cells one
sequence evaluated; copying a head to another sequence gives it the same blocks, cut at the head.
The cells in use are, for each block, the furthest any holder reaches into it
(:meth:`Residency.cells_in_use`), which is exactly what llama.cpp's unified KV keeps. Where each
sequence has a KV stream of its own (``shared_cells`` False), a copied head is a new block of the
target's.

Thread-safety: the scheduler's thread changes a residency; :meth:`Residency.reusable` and
:meth:`Residency.cells_in_use` may be called from any thread (one lock guards the tables).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

__all__ = ["Resident", "Residency", "common_prefix"]


def common_prefix(a: npt.NDArray[np.int32], b: npt.NDArray[np.int32]) -> int:
    """Length of the longest common prefix of two token arrays. O(min(len(a), len(b))), vectorised."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    different = np.flatnonzero(a[:n] != b[:n])
    return int(different[0]) if len(different) else n


@dataclass(eq=False)
class Resident:
    """One sequence id and what it holds (see the module's docstring)."""

    seq: int
    fingerprint: str = ""
    n: int = 0
    busy: bool = False
    last_used: int = 0
    stored: int = 0
    """How many of its leading tokens the cache tiers hold a state of (0: none)."""
    spans: list[tuple[int, int, int]] = field(default_factory=list)  # (block, start, end)
    open_block: int | None = None  # the block its next evaluated tokens extend
    logits: tuple[int, npt.NDArray[np.float32]] | None = None
    """(k, row): the logits row a decode gave after its first ``k`` tokens (a prompt's last), kept so
    that an exact repeat of those ``k`` tokens samples without a decode."""
    _tokens: npt.NDArray[np.int32] = field(default_factory=lambda: np.empty(64, dtype=np.int32))

    @property
    def tokens(self) -> npt.NDArray[np.int32]:
        """The tokens its cells hold (a view: copy it to keep it past the next change)."""
        return self._tokens[: self.n]


class Residency:
    """The context's ``n_seq`` sequence ids and what each holds (see the module's docstring).

    Args:
        n_seq: sequence ids (``n_seq_max`` of the context).
        whole_states_only: the model's memory cannot be cut back (recurrent or hybrid): a sequence
            is reusable only for a prompt it wholly prefixes, and copies take all of it.
        shared_cells: copies share the source's cells (a unified KV); False: they are the target's own.
    """

    def __init__(self, n_seq: int, whole_states_only: bool = False, shared_cells: bool = True) -> None:
        if n_seq < 1:
            raise ValueError(f"n_seq must be positive, got {n_seq}")
        self.whole_states_only = whole_states_only
        self.shared_cells = shared_cells
        self.residents = [Resident(seq=i) for i in range(n_seq)]
        self._blocks = itertools.count()
        self._clock = itertools.count(1)
        self._lock = threading.Lock()

    # -- queries -------------------------------------------------------------------------------

    def reusable(self, tokens: npt.NDArray[np.int32], fingerprint: str, limit: int | None = None,
                 idle_only: bool = False) -> tuple[Resident | None, int]:
        """The resident of namespace ``fingerprint`` whose tokens ``tokens`` reuse most, and how many.

        At most ``limit`` tokens are reused (None: all of ``tokens``). Between equal heads, an idle
        resident all of whose tokens are reused wins (a conversation's next turn), then the most
        recently used. O(residents x K).
        """
        cap = len(tokens) if limit is None else min(limit, len(tokens))
        best: Resident | None = None
        best_key = (0, False, 0)
        with self._lock:
            for resident in self.residents:
                if resident.n == 0 or resident.fingerprint != fingerprint or (idle_only and resident.busy):
                    continue
                if self.whole_states_only:
                    reused = resident.n if resident.n <= cap and common_prefix(resident.tokens, tokens) >= resident.n else 0
                else:
                    reused = common_prefix(resident.tokens, tokens[:cap])
                key = (reused, reused == resident.n and not resident.busy, resident.last_used)
                if reused > 0 and key > best_key:
                    best, best_key = resident, key
        return best, best_key[0]

    def free(self) -> Resident | None:
        """A sequence id holding nothing and not busy, or None."""
        with self._lock:
            return next((r for r in self.residents if r.n == 0 and not r.busy), None)

    def idle(self) -> list[Resident]:
        """The idle residents holding tokens, least recently used first."""
        with self._lock:
            return sorted((r for r in self.residents if not r.busy and r.n > 0), key=lambda r: r.last_used)

    def cells_in_use(self) -> int:
        """Cells the context's memory holds for all sequences together. O(spans)."""
        reach: dict[int, tuple[int, int]] = {}
        with self._lock:
            for resident in self.residents:
                for block, start, end in resident.spans:
                    known = reach.get(block)
                    if known is None or end > known[1]:
                        reach[block] = (start, end)
        return sum(end - start for start, end in reach.values())

    # -- changes (the scheduler's thread) ---------------------------------------------------------

    def claim(self, resident: Resident, fingerprint: str) -> None:
        """A generation takes ``resident`` (of namespace ``fingerprint``)."""
        with self._lock:
            resident.busy = True
            resident.fingerprint = fingerprint
            resident.last_used = next(self._clock)

    def release(self, resident: Resident) -> None:
        """Its generation is done: ``resident`` is idle (or free, if it holds nothing)."""
        with self._lock:
            resident.busy = False
            resident.last_used = next(self._clock)

    def appended(self, resident: Resident, tokens: npt.NDArray[np.int32]) -> None:
        """``resident`` evaluated ``tokens`` at its next positions (new cells of its own)."""
        k = len(tokens)
        if k == 0:
            return
        with self._lock:
            n = resident.n
            if n + k > len(resident._tokens):
                grown = np.empty(max(2 * len(resident._tokens), n + k), dtype=np.int32)
                grown[:n] = resident._tokens[:n]
                resident._tokens = grown
            resident._tokens[n : n + k] = tokens
            spans = resident.spans
            if resident.open_block is not None and spans and spans[-1][0] == resident.open_block and spans[-1][2] == n:
                block, start, _ = spans[-1]
                spans[-1] = (block, start, n + k)
            else:
                block = next(self._blocks)
                spans.append((block, n, n + k))
                resident.open_block = block
            resident.n = n + k
            resident.stored = min(resident.stored, n)

    def copied(self, source: Resident, target: Resident, n_tokens: int) -> None:
        """``target`` (empty) now shares ``source``'s first ``n_tokens`` cells (all of them for whole states)."""
        with self._lock:
            if self.whole_states_only:
                n_tokens = source.n
            if self.shared_cells:
                target.spans = _cut_spans(source.spans, n_tokens)
            else:
                target.spans = [(next(self._blocks), 0, n_tokens)] if n_tokens else []
            if len(target._tokens) < n_tokens:
                target._tokens = np.empty(max(64, 2 * n_tokens), dtype=np.int32)
            target._tokens[:n_tokens] = source._tokens[:n_tokens]
            target.n = n_tokens
            target.open_block = None
            target.stored = min(source.stored, n_tokens)
            target.fingerprint = source.fingerprint
            target.logits = source.logits if source.logits is not None and source.logits[0] == n_tokens else None

    def restored(self, target: Resident, tokens: npt.NDArray[np.int32], stored: bool) -> None:
        """``target`` (empty) holds a state of ``tokens`` restored into it (its own new cells)."""
        self.appended(target, tokens)
        with self._lock:
            target.logits = None
            target.open_block = None  # the state's cells were placed by llama.cpp, not extended by us
            target.stored = len(tokens) if stored else 0

    def cut(self, resident: Resident, n_tokens: int) -> None:
        """``resident`` keeps its first ``n_tokens`` positions only."""
        with self._lock:
            if n_tokens >= resident.n:
                return
            resident.spans = _cut_spans(resident.spans, n_tokens)
            resident.n = n_tokens
            resident.open_block = None
            resident.stored = min(resident.stored, n_tokens)
            if resident.logits is not None and resident.logits[0] > n_tokens:
                resident.logits = None

    def rolled_back(self, resident: Resident, n_tokens: int) -> None:
        """``resident``'s memory was taken back to its first ``n_tokens`` positions by a checkpoint
        (a recurrent model): the tiers hold no state of what it holds now."""
        self.cut(resident, n_tokens)
        with self._lock:
            resident.stored = 0

    def emptied(self, resident: Resident) -> None:
        """``resident`` holds nothing any more."""
        self.cut(resident, 0)
        with self._lock:
            resident.stored = 0
            resident.logits = None

    def kept_logits(self, resident: Resident, row: npt.NDArray[np.float32]) -> None:
        """Keep ``row``, the logits after ``resident``'s tokens so far (see :attr:`Resident.logits`)."""
        with self._lock:
            resident.logits = (resident.n, row)


def _cut_spans(spans: list[tuple[int, int, int]], n_tokens: int) -> list[tuple[int, int, int]]:
    kept = []
    for block, start, end in spans:
        if start >= n_tokens:
            break
        kept.append((block, start, min(end, n_tokens)))
    return kept
