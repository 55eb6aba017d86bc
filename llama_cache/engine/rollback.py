"""Taking a sequence of a recurrent or hybrid model back to a head of its history: checkpoints per sequence.

A recurrent memory cannot be cut back, so a sequence holding prompt + answer serves only prompts it
wholly prefixes. While a sequence reads a prompt, :class:`Rollback` saves its recurrent state
(``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``, through :class:`~llama_cache.checkpoints.HybridCheckpointCache`:
a few KiB to a few MiB, whatever the length) just before the prompt's last token and every
``interval`` tokens. A later prompt that leaves that sequence's path (the same question asked again,
an edited last message, another conversation on the same system prompt) takes the idle sequence
back to the furthest checkpoint on its own path and evaluates only the rest. The attention memory of
a hybrid model stays in the context: a checkpoint is valid only while its sequence still holds its
history, which the context reports to the checkpoint registry at every change
(:class:`~llama_cache.engine.context.BatchContext`).

Thread-safety: the scheduler's thread only.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from llama_cache.checkpoints import HybridCheckpoint, HybridCheckpointCache
from llama_cache.checkpoints.registry import ContextPointer

__all__ = ["CHECKPOINTS_PER_SEQUENCE", "DEFAULT_CHECKPOINT_BYTES", "DEFAULT_CHECKPOINT_INTERVAL", "Rollback"]

DEFAULT_CHECKPOINT_INTERVAL = 512
"""Prompt tokens between two checkpoints of a sequence (besides the one before a prompt's last token)."""

CHECKPOINTS_PER_SEQUENCE = 4
"""Checkpoints kept per sequence id on average: the oldest of the context's go first."""

DEFAULT_CHECKPOINT_BYTES = 1 << 30
"""The most bytes all checkpoints of a context hold (a large Mamba-2's recurrent state takes over
100 MiB; a small LFM2's well under one)."""


class Rollback:
    """The checkpoints of one context's sequences (see the module's docstring).

    Args:
        context: the raw ``llama_context *`` (borrowed: :meth:`close` before freeing it).
        n_seq: the context's sequence ids.
        interval: prompt tokens between checkpoints (positive).
        max_bytes: the most bytes the checkpoints hold together (the oldest go first; a checkpoint
            larger than that is not saved).

    Raises:
        ValueError: ``interval`` or ``max_bytes`` is not positive.
    """

    def __init__(self, context: ContextPointer, n_seq: int, interval: int = DEFAULT_CHECKPOINT_INTERVAL,
                 max_bytes: int = DEFAULT_CHECKPOINT_BYTES) -> None:
        if interval < 1:
            raise ValueError(f"checkpoint_interval must be positive, got {interval}")
        self.interval = interval
        self._checkpoints = HybridCheckpointCache(context, max_checkpoints=CHECKPOINTS_PER_SEQUENCE * n_seq,
                                                  max_bytes=max_bytes)

    def until_next(self, n: int, prompt_len: int, todo: int) -> int:
        """How many of the next ``todo`` prompt tokens to evaluate after the first ``n`` before a
        checkpoint is due (``todo`` if none is on the way). O(1)."""
        stops = [(n // self.interval + 1) * self.interval]
        if n < prompt_len - 1:
            stops.append(prompt_len - 1)
        return max(1, min(todo, min(stops) - n))

    def due(self, n: int, prompt_len: int) -> bool:
        """Whether a sequence that has evaluated ``n`` tokens of a ``prompt_len``-token prompt (more
        to come) is at a checkpoint. O(1)."""
        return 0 < n < prompt_len and (n == prompt_len - 1 or n % self.interval == 0)

    def save(self, seq: int, tokens: npt.NDArray[np.int32]) -> bool:
        """Checkpoint sequence ``seq``, which holds exactly ``tokens``. O(its recurrent state's bytes)."""
        return self._checkpoints.save_checkpoint(len(tokens), tokens, seq_id=seq)

    def best(self, seq: int, tokens: npt.NDArray[np.int32]) -> HybridCheckpoint | None:
        """The checkpoint of ``seq`` on the longest head of ``tokens`` (all of it included). O(K)."""
        return self._checkpoints.find_best_checkpoint(tokens, seq_id=seq)

    def restore(self, seq: int, checkpoint: HybridCheckpoint) -> bool:
        """Take ``seq`` back to ``checkpoint`` (its memory after it removed). False: refused, and
        ``seq``'s checkpoints dropped (its memory must then be emptied by the caller)."""
        return self._checkpoints.restore_checkpoint(checkpoint, seq_id=seq)

    def __len__(self) -> int:
        return len(self._checkpoints)

    @property
    def nbytes(self) -> int:
        """Bytes the checkpoints hold together. O(1)."""
        return self._checkpoints.cache_size

    def close(self) -> None:
        """Drop every checkpoint and let go of the context (once is enough; again is harmless)."""
        self._checkpoints.close()
