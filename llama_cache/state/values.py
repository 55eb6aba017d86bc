"""What every cache tier needs to know about a stored value, whichever library made it.

A cache holds llama-cache's :class:`~llama_cache.state.llama_state.LlamaState` or llama-cpp-python's own
``LlamaState``. These helpers answer, for either kind, the questions that decide where a value is
filed and whether it can serve a query:

- :func:`state_tokens`: the tokens the state really holds;
- :func:`filing_key`: the key a state is stored under (llama-cpp-python stores a completion's state under
  ``prompt + completion`` although a state taken right after the prompt holds only the prompt: such a
  state is filed under the prompt, so that the same prompt finds it again);
- :func:`can_be_cut`: whether the state can serve a query that diverges from it (transformer KV can be
  cut back to the common prefix; recurrent memory cannot);
- :func:`holds_same_state`: whether storing a new value under a key would only rewrite what is there.
"""

from __future__ import annotations

from typing import Any

import llama_cpp
import numpy as np

from llama_cache.tokens import TokenArray

__all__ = ["can_be_cut", "filing_key", "holds_same_state", "state_tokens"]


def state_tokens(value: Any) -> TokenArray | None:
    """The tokens ``value`` holds, or None when it does not say (an arbitrary sized object).

    Complexity: O(1) (a view, no copy).
    """
    tokens = getattr(value, "tokens", None)
    if isinstance(tokens, np.ndarray) and tokens.ndim == 1:
        return tokens
    if isinstance(value, llama_cpp.llama.LlamaState):
        n_tokens = int(value.n_tokens)
        input_ids = np.asarray(value.input_ids)
        if input_ids.ndim == 1 and 0 <= n_tokens <= len(input_ids):
            return input_ids[:n_tokens]
    return None


def filing_key(key: TokenArray, value: Any) -> TokenArray:
    """The key to store ``value`` under when asked to store it under ``key``.

    When the state holds a proper prefix of ``key`` (``prompt + completion`` with a state taken at the
    prompt's end: one-token completions, a stop on the first token), that prefix: the state answers
    every query ``key`` answered under the trie's policy, and also the prompt itself. Otherwise ``key``.

    Complexity: O(len(key)).
    """
    tokens = state_tokens(value)
    if tokens is None or len(tokens) >= len(key) or not np.array_equal(key[: len(tokens)], tokens):
        return key
    return key[: len(tokens)]


def can_be_cut(value: Any) -> bool:
    """Whether a restored ``value`` can be cut back to a shorter prefix (transformer KV).

    llama-cache's opaque states (recurrent and hybrid memory) cannot; llama-cpp-python's states are
    treated as cuttable (llama-cpp-python itself re-evaluates when its memory refuses a cut).
    """
    if hasattr(value, "layout") and hasattr(value, "segments"):
        return value.layout is not None
    return True


def holds_same_state(old: Any, new: Any) -> bool:
    """Whether ``old`` already holds what ``new`` would store: the same tokens, the same kind of state,
    and logits if ``new`` has them. Storing ``new`` over ``old`` would then only rewrite equal bytes.

    Complexity: O(tokens).
    """
    if type(old) is not type(new):
        return False
    old_tokens, new_tokens = state_tokens(old), state_tokens(new)
    if old_tokens is None or new_tokens is None or not np.array_equal(old_tokens, new_tokens):
        return False
    if getattr(old, "fingerprint", None) != getattr(new, "fingerprint", None):
        return False
    if hasattr(new, "logits") and getattr(new, "logits", None) is not None:
        return getattr(old, "logits", None) is not None
    return True
