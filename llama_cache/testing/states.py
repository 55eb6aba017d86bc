"""Synthetic transformer states for tests and benchmarks: real llama.cpp sequence bytes, random KV.

The bytes follow llama.cpp's per-sequence format (see :mod:`llama_cache.state.kv_layout`) for a
2-layer model whose values are stored transposed, so they parse into segments like a real model's
and can be cut, chunked and restored byte for byte; only the KV values are random.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from llama_cache.state.kv_layout import SEQ_STATE_MAGIC
from llama_cache.state.llama_state import LlamaState

__all__ = ["synthetic_state"]


def synthetic_state(
    tokens: npt.ArrayLike,
    row: int,
    rng: np.random.Generator,
    *,
    fingerprint: str = "test",
    logits: npt.NDArray[np.float32] | None = None,
) -> LlamaState:
    """A transformer state of ``tokens`` with ``row`` bytes (even, >= 2) per K and V row per layer.

    ``4 * row`` bytes of KV per token, drawn from ``rng``.
    """
    held = np.asarray(tokens, dtype=np.int32)
    n = len(held)
    cells = np.zeros(n, dtype=[("pos", "<i4"), ("n_seq", "<u4"), ("seq", "<i4")])
    cells["pos"] = np.arange(n)
    cells["n_seq"] = 1
    parts = [np.array([SEQ_STATE_MAGIC, 0, 1, n], "<u4").tobytes(), cells.tobytes(), np.array([1, 2], "<u4").tobytes()]
    for _ in range(2):
        parts += [np.array([1], "<i4").tobytes(), np.array([row], "<u8").tobytes(), rng.bytes(row * n)]
    for _ in range(2):
        parts += [np.array([1], "<i4").tobytes(), np.array([2, row // 2], "<u4").tobytes(), rng.bytes(row * n)]
    raw = np.frombuffer(b"".join(parts), dtype=np.uint8)
    state = LlamaState.from_seq_bytes(held, logits, 0, fingerprint, raw)
    if state.layout is None:
        raise ValueError("the synthetic bytes did not parse (row must be even and at least 2)")
    return state
