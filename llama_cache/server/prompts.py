"""A served model's prompts: tokenizing them (with a shared memo) and a chat request's prompt tokens.

:class:`ServedTokenizer` tokenizes and detokenizes for the server, remembering its latest
tokenizations per cache namespace (:class:`TokenizationMemo`). :func:`prompt_tokens_for_chat` gives the
tokens a chat request will evaluate, rendered by the model's chat handler, before it is queued (for the
context-length check and the cache estimate).

Thread-safety: everything here is thread-safe (it reads the shared vocabulary only).
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import jinja2

from llama_cache.engine.model import Model
from llama_cache.server.limits import PromptTextBound

__all__ = ["PromptTooLong", "RenderingCancelled", "ServedTokenizer", "TokenizationMemo", "prompt_tokens_for_chat"]

logger = logging.getLogger(__name__)


class ServedTokenizer:
    """The served model's tokenizer and detokenizer, with the server's memo of tokenizations.

    Thread-safe: it reads the shared vocabulary only (and the memo is thread-safe).

    Args:
        model: the engine's model.
        memo: the tokenizations to share (None: none).
    """

    def __init__(self, model: Model, memo: TokenizationMemo | None = None) -> None:
        self.model = model
        self.memo = memo
        self.detokenizer = model.detokenizer
        self.chat_handler = model.chat_handler

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """As ``llama_cpp.Llama.tokenize`` (in the model's own namespace)."""
        return self.model.tokenize(text, add_bos, special)

    def tokenize_for(self, fingerprint: str, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """As :meth:`tokenize`, for a request of the cache namespace ``fingerprint``: the memo's entries
        are a namespace's own, so how fast a text is tokenized tells nothing of other namespaces' texts."""
        memo = self.memo
        if memo is None:
            return self.model.tokenize(text, add_bos, special)
        key = (fingerprint, bytes(text), bool(add_bos), bool(special))
        tokens = memo.get(key)
        if tokens is None:
            tokens = self.model.tokenize(text, add_bos, special)
            memo.put(key, tokens)
        return list(tokens)

    def detokenize(self, tokens: Sequence[int], prev_tokens: Sequence[int] | None = None, special: bool = False) -> bytes:
        """As ``llama_cpp.Llama.detokenize``, every piece whole."""
        return self.detokenizer.detokenize(tokens, special=special)

    def token_bos(self) -> int:
        return self.model.bos

    def token_eos(self) -> int:
        return self.model.eos


MemoKey = tuple[str, bytes, bool, bool]
"""A tokenization's key: (cache namespace, text, add_bos, special)."""


class TokenizationMemo:
    """The texts a server's contexts tokenized last, with their tokens (all contexts share one vocabulary).

    A chat request's prompt is rendered and tokenized once to route it (off the event loop) and again by
    llama-cpp-python's chat handler on its context: the second is a lookup here (tokenizing a 1,000-token
    prompt takes about 3 ms). Keys hold the text itself, not a hash, so a lookup cannot return another
    text's tokens.

    Bounded by bytes (each entry is charged its text plus 4 bytes per token), and it never keeps a
    tokenization of ``max_tokens`` tokens or more: such a prompt cannot fit a context and is refused, so
    a refused prompt pins no memory. Thread-safe; O(1) per call plus hashing the text.

    Args:
        capacity_bytes: bytes kept, least recently used dropped first.
        max_tokens: tokenizations this long or longer are not kept (the context size).
    """

    def __init__(self, capacity_bytes: int = 32 << 20, max_tokens: int | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.max_tokens = max_tokens
        self.nbytes = 0
        self._entries: OrderedDict[MemoKey, array[int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: MemoKey) -> list[int] | None:
        """The tokens stored for (namespace, text, add_bos, special), or None."""
        with self._lock:
            tokens = self._entries.get(key)
            if tokens is None:
                return None
            self._entries.move_to_end(key)
            return tokens.tolist()

    def put(self, key: MemoKey, tokens: Sequence[int]) -> None:
        """Remember ``tokens`` for (namespace, text, add_bos, special), dropping the least recently used beyond capacity.

        Tokenizations of ``max_tokens`` or more tokens, and entries larger than the whole capacity, are
        not kept.
        """
        if self.max_tokens is not None and len(tokens) >= self.max_tokens:
            return
        packed = array("i", tokens)
        size = self._size(key, packed)
        if size > self.capacity_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.nbytes -= self._size(key, old)
            self._entries[key] = packed
            self.nbytes += size
            while self.nbytes > self.capacity_bytes:
                dropped_key, dropped = self._entries.popitem(last=False)
                self.nbytes -= self._size(dropped_key, dropped)

    @staticmethod
    def _size(key: MemoKey, tokens: array[int]) -> int:
        return len(key[1]) + tokens.itemsize * len(tokens)


class PromptTooLong(Exception):
    """A rendered chat prompt longer (in bytes) than any prompt a context could hold."""

    def __init__(self, size: str) -> None:
        super().__init__(f"the rendered prompt is {size}")
        self.size = size


class RenderingCancelled(Exception):
    """The request whose chat prompt was being rendered was cancelled (its client left)."""


class _Captured(Exception):
    def __init__(self, prompt: list[int]) -> None:
        super().__init__("prompt captured")
        self.prompt = prompt


class _PromptProbe:
    """Stands in for a ``Llama`` in a chat handler: tokenizes as it would, stops at ``create_completion``.

    Chat handlers render the messages with the model's template, tokenize, and call
    ``llama.create_completion(prompt=tokens, ...)``; capturing that argument gives the exact tokens
    the real call will evaluate, for routing and for the context-length check.
    """

    def __init__(self, tokenizer: ServedTokenizer, bound: PromptTextBound | None, cancelled: Callable[[], bool] | None,
                 fingerprint: str | None = None) -> None:
        self._tokenizer = tokenizer
        self._bound = bound
        self._cancelled = cancelled
        self._fingerprint = fingerprint
        self.verbose = False

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """The rendered prompt's tokens: refused unread past ``bound``, not read for a cancelled request."""
        overflow = self._bound.overflow(text, special) if self._bound is not None else None
        if overflow is not None:
            raise PromptTooLong(overflow)
        if self._cancelled is not None and self._cancelled():
            raise RenderingCancelled()
        return self._tokenize(text, add_bos, special)

    def _tokenize(self, text: bytes, add_bos: bool, special: bool) -> list[int]:
        if self._fingerprint is not None and isinstance(self._tokenizer, ServedTokenizer):
            return self._tokenizer.tokenize_for(self._fingerprint, text, add_bos, special)
        return self._tokenizer.tokenize(text, add_bos, special)

    def create_completion(self, prompt: Any = None, **_: Any) -> Any:
        if isinstance(prompt, str):
            raise _Captured(self._tokenize(prompt.encode("utf-8"), True, True))
        raise _Captured(list(prompt))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def _llama_chat_handler(llama: Any) -> Any:
    """What ``llama_cpp.Llama.create_chat_completion`` renders with (a ``llama_cpp.Llama`` given to
    :func:`prompt_tokens_for_chat`, as the benchmarks do)."""
    import llama_cpp.llama_chat_format

    return (llama._chat_handlers.get(llama.chat_format)  # noqa: SLF001 - what create_chat_completion uses
            or llama_cpp.llama_chat_format.get_chat_completion_handler(llama.chat_format))


def prompt_tokens_for_chat(tokenizer: ServedTokenizer | Any, messages: list[dict[str, Any]], *, bound: PromptTextBound | None = None,
                           cancelled: Callable[[], bool] | None = None, fingerprint: str | None = None,
                           **template_options: Any) -> list[int]:
    """The tokens a chat completion of ``messages`` with ``template_options`` evaluates on the model of
    ``tokenizer`` (a :class:`ServedTokenizer`, or a ``llama_cpp.Llama``).

    Only renders and tokenizes (thread-safe on a shared model); evaluates nothing.

    Args:
        bound: a rendered prompt that cannot fit the context by it is not tokenized (:class:`PromptTooLong`).
        cancelled: asked once the template is rendered; when true, nothing is tokenized
            (:class:`RenderingCancelled`).
        fingerprint: the request's cache namespace, for the shared tokenizations (None: none used).

    Raises:
        ValueError: the chat handler refused the messages or options (an unknown tool, say).
        PromptTooLong, RenderingCancelled: see above.
    """
    handler = tokenizer.chat_handler or _llama_chat_handler(tokenizer)
    try:
        handler(llama=_PromptProbe(tokenizer, bound, cancelled, fingerprint), messages=messages, **template_options)  # type: ignore[arg-type]
    except _Captured as captured:
        return captured.prompt
    except (TypeError, KeyError, AttributeError, jinja2.TemplateError) as error:
        raise ValueError(f"the chat template could not render these messages: {error}") from None
    raise ValueError("the chat handler produced no prompt")
