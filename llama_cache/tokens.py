"""Token ids: the one place where token sequences are validated and converted.

Every public entry point that takes tokens (cache keys and queries, ``Llama.eval``/``generate``, states
read back from storage) goes through :func:`as_token_array`; :func:`check_vocabulary` adds the model's
vocabulary bound where one is known.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["TOKEN_LIMIT", "TokenArray", "Tokens", "as_token_array", "check_vocabulary", "readonly"]

TOKEN_LIMIT = 2**31
"""Exclusive upper bound on token ids (they must fit in a signed 32-bit int)."""

TokenArray = npt.NDArray[np.int32]

Tokens = Sequence[int] | npt.NDArray[np.integer[Any]]
"""What the API accepts as a key or query: a sequence of ints or a 1-D numpy integer array."""

_EMPTY: TokenArray = np.empty(0, dtype=np.int32)
_EMPTY.setflags(write=False)


def readonly(arr: TokenArray) -> TokenArray:
    """Return ``arr`` marked read-only (in place; views of it are unaffected)."""
    arr.setflags(write=False)
    return arr


def _check_range(arr: npt.NDArray[Any]) -> None:
    """Raise ValueError unless every element of the non-empty integer array ``arr`` is in [0, 2**31)."""
    low = int(arr.min())
    high = int(arr.max())
    if low < 0:
        raise ValueError(f"token ids must be non-negative, got {low}")
    if high >= TOKEN_LIMIT:
        raise ValueError(f"token ids must be below 2**31, got {high}")


def _from_ndarray(arr: npt.NDArray[Any]) -> TokenArray:
    """Validate an ndarray of tokens and return it as a read-only 1-D int32 array (no per-element loop)."""
    if arr.ndim != 1:
        raise TypeError(f"tokens must be a 1-D sequence of ints, got a {arr.ndim}-D array")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"tokens must be integers, got an array of dtype {arr.dtype}")
    if arr.size == 0:
        return _EMPTY
    if arr.dtype != np.int32 or arr.min() < 0:
        _check_range(arr)
    out = arr.astype(np.int32, copy=False)
    if out is arr:
        out = arr.view()  # a read-only view: never flip the caller's own array to read-only
    return readonly(out)


def as_token_array(tokens: Tokens) -> TokenArray:
    """Validate a token sequence and convert it to a read-only 1-D ``numpy.int32`` array.

    Accepted: lists and tuples of ints (Python ints, numpy integer scalars, int subclasses other than
    bool), 1-D numpy integer arrays of any width, ``array.array`` with an integer typecode, ``range`` and any
    other ``collections.abc.Sequence`` of ints. Every token must be in ``[0, 2**31)``.

    Complexity: O(K) for K tokens. Numpy arrays and ``array.array`` are checked with vectorised min/max
    (no per-element Python code); lists are type-checked with one C-level pass (``set(map(type, ...))``)
    and converted with ``numpy.fromiter``; ``range`` is checked from its endpoints.

    Side effects: none. The result may share memory with an int32 numpy input (as a read-only view), so
    callers that keep it must not mutate their input afterwards -- or must copy it.

    Args:
        tokens: The token ids.

    Returns:
        A read-only, 1-D int32 array holding the tokens.

    Raises:
        TypeError: ``tokens`` is not a sequence of ints: a str/bytes, a non-sequence (None, an int, a float,
            a set, an iterator...), a multi-dimensional array, or a sequence holding non-integers or bools.
        ValueError: A token is negative or ``>= 2**31``.
    """
    if isinstance(tokens, np.ndarray):
        return _from_ndarray(tokens)
    if isinstance(tokens, (str, bytes, bytearray)):
        raise TypeError(f"tokens must be a sequence of ints, not {type(tokens).__name__}")
    if isinstance(tokens, array.array):
        # Copied (dtype from the typecode): a view would pin the buffer and stop the array from resizing.
        return _from_ndarray(np.array(tokens))
    if isinstance(tokens, range):
        if len(tokens) == 0:
            return _EMPTY
        low, high = min(tokens[0], tokens[-1]), max(tokens[0], tokens[-1])
        if low < 0:
            raise ValueError(f"token ids must be non-negative, got {low}")
        if high >= TOKEN_LIMIT:
            raise ValueError(f"token ids must be below 2**31, got {high}")
        return readonly(np.arange(tokens.start, tokens.stop, tokens.step, dtype=np.int32))
    if not isinstance(tokens, Sequence):
        raise TypeError(f"tokens must be a sequence of ints, not {type(tokens).__name__}")
    n = len(tokens)
    if n == 0:
        return _EMPTY
    values: Sequence[int] = tokens
    types = set(map(type, tokens))
    if not types <= {int}:
        for t in types:
            if issubclass(t, (bool, np.bool_)) or not issubclass(t, (int, np.integer)):
                raise TypeError(f"tokens must be ints, got an element of type {t.__name__}")
        values = [int(x) for x in tokens]  # numpy scalars, IntEnum...: rare, so a Python loop is fine
    try:  # straight to int32: numpy refuses (OverflowError) any int outside its range
        out = np.fromiter(values, dtype=np.int32, count=n)
    except OverflowError:
        raise ValueError("token ids must be in [0, 2**31), got one outside") from None
    low = int(out.min())
    if low < 0:
        raise ValueError(f"token ids must be non-negative, got {low}")
    return readonly(out)


def check_vocabulary(tokens: TokenArray, n_vocab: int) -> TokenArray:
    """Return ``tokens`` (already an array from :func:`as_token_array`) if every id is below ``n_vocab``.

    Complexity: one vectorised max over the tokens.

    Raises:
        ValueError: a token id is not in the model's vocabulary.
    """
    if len(tokens) and int(tokens.max()) >= n_vocab:
        raise ValueError(f"token id {int(tokens.max())} is outside the vocabulary (0..{n_vocab - 1})")
    return tokens
