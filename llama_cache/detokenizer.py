"""Token ids back to text: every token's exact bytes, however long its piece.

llama-cpp-python 0.3.36 renders each token into a 32-byte buffer and drops any piece that does not fit
(``llama_token_to_piece`` then answers with the size it needs, which it ignores). SmolLM2's vocabulary
holds 47 such tokens: runs of dashes, newlines followed by deep indentation. Its
``Llama.detokenize`` therefore loses generated code's indentation and Markdown's rules, and joins the
pieces with ``bytes +=``, quadratic in their number. :class:`Detokenizer` asks llama.cpp again with a
buffer of the size it names, keeps each token's piece once rendered, and joins them in linear time. It
renders as llama-cpp-python does otherwise: no leading space stripped from pieces (``lstrip`` 0), special
tokens' texts only when asked for, and the space a BOS token's first piece starts with dropped, so its
output differs from llama-cpp-python's only where llama-cpp-python loses bytes.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterable

import llama_cpp

__all__ = ["Detokenizer"]

_FIRST_BUFFER = 64  # bytes; longer pieces are rendered again into a buffer of their size


class Detokenizer:
    """The exact text of one model's tokens.

    Args:
        vocab: the model's vocabulary (``llama_cpp.llama_model_get_vocab(model)``); it must outlive
            this object.
        n_vocab: the number of tokens in it.
        bos: the BOS token id, or -1 if the model has none.

    Thread-safety: any number of threads may call it at once; a piece is rendered by llama.cpp at most
    a few times (two threads may race to render the same token; both get the same bytes).

    Memory: each distinct token's piece is kept once rendered (for a 49,152-token vocabulary, about
    0.5 MB for every piece in both renderings).
    """

    def __init__(self, vocab: llama_cpp.llama_vocab_p, n_vocab: int, bos: int = -1) -> None:
        if not isinstance(n_vocab, int) or n_vocab <= 0:
            raise ValueError(f"n_vocab must be a positive int, got {n_vocab!r}")
        self._vocab = vocab
        self.n_vocab = n_vocab
        self.bos = bos
        # Indexed by token id; None until rendered. [plain, with special tokens' texts]
        self._pieces: tuple[list[bytes | None], list[bytes | None]] = ([None] * n_vocab, [None] * n_vocab)
        self._buffer = threading.local()

    @classmethod
    def for_llama(cls, llama: llama_cpp.Llama) -> Detokenizer:
        """The detokenizer of ``llama``'s model (which must outlive it)."""
        vocab = llama_cpp.llama_model_get_vocab(llama.model)
        return cls(vocab, int(llama.n_vocab()), int(llama.token_bos()))

    def piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token: O(1) once rendered, one or two llama.cpp calls the first time.

        ``special``: render control tokens' texts (``<|im_end|>``); without it they render as nothing.

        Raises:
            ValueError: ``token`` is not in the vocabulary.
        """
        if not 0 <= token < self.n_vocab:
            raise ValueError(f"token id {token} is outside the vocabulary (0..{self.n_vocab - 1})")
        pieces = self._pieces[1 if special else 0]
        piece = pieces[token]
        if piece is None:
            piece = pieces[token] = self._render(token, special)
        return piece

    def detokenize(self, tokens: Iterable[int], special: bool = False) -> bytes:
        """The bytes of ``tokens`` one after another, as llama-cpp-python's ``Llama.detokenize`` renders
        them but with every piece whole: O(len(tokens)).

        When the first token is the BOS token and the text starts with a space, the space is dropped
        (as llama-cpp-python does, for models that add one after BOS).

        Raises:
            ValueError: a token is not in the vocabulary.
            TypeError: a token is not an int.
        """
        tokens = tokens if isinstance(tokens, (list, tuple)) else list(tokens)
        if not tokens:
            return b""
        table = self._pieces[1 if special else 0]
        try:
            parts = [table[token] for token in tokens]
        except IndexError:
            parts = []  # a token id too large: named by piece() below
        except TypeError:
            raise TypeError("tokens must be ints") from None
        if len(parts) != len(tokens) or None in parts or min(tokens) < 0:
            # Negative ids would index from the end of the table: checked one by one with the misses.
            parts = [self.piece(int(token), special) for token in tokens]
        text = b"".join(parts)  # type: ignore[arg-type]
        if tokens[0] == self.bos and text[:1] == b" ":
            return text[1:]
        return text

    def _render(self, token: int, special: bool) -> bytes:
        buffer = getattr(self._buffer, "value", None)
        if buffer is None:
            buffer = self._buffer.value = ctypes.create_string_buffer(_FIRST_BUFFER)
        size = llama_cpp.llama_token_to_piece(self._vocab, token, buffer, len(buffer), 0, special)
        if size < 0:  # the piece needs -size bytes
            buffer = self._buffer.value = ctypes.create_string_buffer(-size)
            size = llama_cpp.llama_token_to_piece(self._vocab, token, buffer, len(buffer), 0, special)
            if size < 0:
                raise RuntimeError(f"llama.cpp could not render token {token} into {len(buffer)} bytes")
        return buffer.raw[:size]
