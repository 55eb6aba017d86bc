"""Checkpoints of recurrent state for hybrid and recurrent models, and their invalidation.

- :mod:`.hybrid`: :class:`HybridCheckpoint` and :class:`HybridCheckpointCache`, saving and restoring the
  recurrent part of a sequence's state.
- :mod:`.registry`: which caches hold checkpoints of which context, the lock they share, and the
  ``notify_*`` functions reporting changes to a context's memory made outside the caches.
"""

from __future__ import annotations

from llama_cache.checkpoints.hybrid import HybridCheckpoint, HybridCheckpointCache
from llama_cache.checkpoints.registry import (
    ContextPointer,
    notify_memory_cleared,
    notify_seq_changed,
    notify_seq_kept,
    notify_seq_removed,
)

__all__ = [
    "ContextPointer",
    "HybridCheckpoint",
    "HybridCheckpointCache",
    "notify_memory_cleared",
    "notify_seq_changed",
    "notify_seq_kept",
    "notify_seq_removed",
]
