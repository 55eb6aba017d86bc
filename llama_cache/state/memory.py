"""Memory accounting for states: which buffers a value owns, so shared buffers are charged once."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import llama_cpp

__all__ = ["MemoryBlock", "memory_blocks"]

MemoryBlock = tuple[Hashable, int]
"""One block of memory a value owns: an identity (blocks shared by several values are charged once) and
its size in bytes."""


def memory_blocks(value: Any) -> list[MemoryBlock]:
    """Return the memory blocks ``value`` owns, for byte accounting.

    - A value with a ``memory_blocks()`` method (llama-cache's own states) says which blocks it holds,
      so blocks shared between states are charged once.
    - llama-cpp-python's ``LlamaState`` is charged for everything it holds: its ``input_ids`` and
      ``scores`` arrays as well as the llama.cpp bytes. Its ``llama_state_size`` counts only the last,
      about a quarter of the real memory for the default model.
    - Any other value with ``nbytes`` is charged that; legacy objects fall back to ``llama_state_size``.

    Raises:
        TypeError: the value reports no size at all.
    """
    method = getattr(value, "memory_blocks", None)
    if callable(method):
        return list(method())
    if isinstance(value, llama_cpp.llama.LlamaState):
        owned = int(value.input_ids.nbytes) + int(value.scores.nbytes) + len(value.llama_state)
        return [(id(value), owned)]
    for attribute in ("nbytes", "llama_state_size"):
        size = getattr(value, attribute, None)
        if isinstance(size, int) and not isinstance(size, bool):
            if size < 0:
                raise ValueError(f"{type(value).__name__}.{attribute} is negative: {size}")
            return [(id(value), size)]
    raise TypeError(
        f"cannot size a {type(value).__name__}: a cached state needs an `nbytes` or "
        "`llama_state_size` attribute"
    )
