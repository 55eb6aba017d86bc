"""One llama.cpp context made at a time in this process, by the engine and by ``llama_cache.Llama``.

The engine recognises a new context's KV buffer as the one block of its size mapped while the context
is made (:mod:`llama_cache.engine.kv_pages`), and hands its zeroed pages back while llama.cpp is still
zeroing them. A block of the same size made by another context at the same time could be taken for
it, and that other context may already be writing its cells. Making contexts one at a time rules that
out for every context this package makes; contexts a caller makes with llama-cpp-python directly, in
other threads at the same moment, are not covered.
"""

from __future__ import annotations

import threading

__all__ = ["MAKING_CONTEXTS"]

MAKING_CONTEXTS = threading.Lock()
"""Held while a context is made (with the model's loading, for ``llama_cache.Llama``); not reentrant."""
