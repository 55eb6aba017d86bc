"""Token ids: the one place where token sequences are validated and converted.

Every public entry point that takes tokens (cache keys and queries, ``Llama.eval``/``generate``, states
read back from storage) goes through :func:`as_token_array`; :func:`check_vocabulary` adds the model's
vocabulary bound where one is known.

A request is validated once, however many layers it passes through: :func:`checked_tokens` wraps the
converted array in a :class:`CheckedTokens`, which :func:`as_token_array` (and so every cache, tier and
index) takes back in O(1) without looking at the tokens again. A tiered cache converts its caller's list
once and hands the same :class:`CheckedTokens` to each tier, and each tier to its radix index.
"""

from __future__ import annotations

import array
from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np
import numpy.typing as npt

__all__ = ["TOKEN_LIMIT", "CheckedTokens", "TokenArray", "Tokens", "as_token_array", "check_vocabulary",
           "checked_tokens", "readonly"]

TOKEN_LIMIT = 2**31
"""Exclusive upper bound on token ids (they must fit in a signed 32-bit int)."""

TokenArray = npt.NDArray[np.int32]

Tokens = Sequence[int] | npt.NDArray[np.integer[Any]]
"""What the API accepts as a key or query: a sequence of ints or a 1-D numpy integer array."""

_EMPTY: TokenArray = np.empty(0, dtype=np.int32)
_EMPTY.setflags(write=False)

# array.array's typecode for a C int32 ("i" wherever numpy runs): a list converts in one C loop through it.
_INT32_CODE = next(code for code in "il" if array.array(code).itemsize == 4)


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
    bool; in a list or tuple, any object with ``__index__`` but a bool), 1-D numpy integer arrays of any
    width, ``array.array`` with an integer typecode, ``range``, any other ``collections.abc.Sequence`` of
    ints, and a :class:`CheckedTokens` (returned as it is: checked already). Every token must be in
    ``[0, 2**31)``.

    Complexity: O(K) for K tokens, O(1) for a :class:`CheckedTokens`. Numpy arrays and ``array.array``
    are checked with vectorised min/max (no per-element Python code), and an int32 (``intc``) array is not
    copied; lists and tuples are converted in one C loop (``array.array``) and checked with one vectorised
    min; other sequences are type-checked with one C-level pass (``set(map(type, ...))``) and converted
    with ``numpy.fromiter``; ``range`` is checked from its endpoints.

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
    if type(tokens) is CheckedTokens:
        return tokens.array
    if isinstance(tokens, (list, tuple)):  # what llama-cpp-python and the server pass: first
        return _from_list(tokens)
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
    return _from_sequence(tokens)


def _from_list(tokens: list[int] | tuple[int, ...]) -> TokenArray:
    """A list or tuple of ints as a read-only int32 array: one C loop converting through ``array.array``
    (which refuses anything without ``__index__`` and any int outside int32), one vectorised min.

    Bools pass ``array.array`` as 1 and 0, so only elements equal to 0 or 1 have their type looked at.
    Anything refused is handed to :func:`_from_sequence`, whose error names the offending element.
    """
    if not tokens:
        return _EMPTY
    try:
        out = np.frombuffer(array.array(_INT32_CODE, tokens), dtype=np.int32)
    except (TypeError, OverflowError):
        return _from_sequence(tokens)
    low = int(out.min())
    if low <= 1 and any(isinstance(tokens[i], bool) for i in np.flatnonzero(out <= 1).tolist()):
        return _from_sequence(tokens)  # a bool is refused before any value, as for other sequences
    if low < 0:
        raise ValueError(f"token ids must be non-negative, got {low}")
    return readonly(out)


def _from_sequence(tokens: Sequence[int]) -> TokenArray:
    """Any other sequence of ints, every element's type checked in one pass over the distinct types."""
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


class CheckedTokens(Sequence[int]):
    """Token ids validated and converted once: a read-only 1-D int32 array that every layer accepts as
    checked (:func:`as_token_array` returns :attr:`array` in O(1)).

    Made by :func:`checked_tokens` only; immutable. A sequence of Python ints to code that does not know
    it (``len``, indexing, iteration; slicing gives a :class:`CheckedTokens` viewing the same memory), and
    an array to numpy (``numpy.asarray`` gives :attr:`array` without a copy). Shares memory with an int32
    numpy input as :func:`as_token_array` does: the caller must not mutate that input while it is in use.
    Thread-safe (immutable).
    """

    __slots__ = ("array",)
    array: TokenArray

    def __init__(self, array: TokenArray) -> None:
        # Trusted: only checked_tokens (and slicing) call this, with an array as_token_array made.
        object.__setattr__(self, "array", array)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("CheckedTokens is immutable")

    def __len__(self) -> int:
        return len(self.array)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> CheckedTokens: ...

    def __getitem__(self, index: int | slice) -> int | CheckedTokens:
        if isinstance(index, slice):
            return CheckedTokens(self.array[index])
        return int(self.array[index])

    def __iter__(self) -> Iterator[int]:
        return iter(self.array.tolist())

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> TokenArray:
        if copy:
            return self.array.astype(dtype or np.int32, copy=True)
        return self.array if dtype is None else self.array.astype(dtype, copy=False)

    def tolist(self) -> list[int]:
        """The tokens as a new list of Python ints. O(K)."""
        return self.array.tolist()  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return f"CheckedTokens({self.array.tolist()!r})"


def checked_tokens(tokens: Tokens | CheckedTokens) -> CheckedTokens:
    """``tokens`` validated and converted once (see :func:`as_token_array`, whose errors it raises), for
    handing to several layers; a :class:`CheckedTokens` is returned as it is. O(K), O(1) when checked."""
    if type(tokens) is CheckedTokens:
        return tokens
    return CheckedTokens(as_token_array(tokens))
