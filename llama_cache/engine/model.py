"""A GGUF model loaded once for an engine: its weights, vocabulary, tokenizer and chat template.

:class:`Model` holds what every sequence of an engine shares and nothing that changes while it
serves: tokenizing, rendering tokens' text and a chat request's template all read the vocabulary only,
so they are thread-safe and need no context.

The chat handler is chosen the way ``llama_cpp.Llama`` chooses it for the same file (a format its
metadata's template is recognised as, else that template through llama-cpp-python's sandboxed
Jinja2 formatter, else ``llama-2``), so a chat prompt renders to the same tokens on either.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import llama_cpp
import llama_cpp.llama_chat_format
import numpy as np

from llama_cache.detokenizer import Detokenizer
from llama_cache.native_log import route_llama_cpp_logs

__all__ = ["Model", "quiet_llama_cpp"]

logger = logging.getLogger(__name__)

ChatHandler = Callable[..., Any]


def quiet_llama_cpp() -> None:
    """Keep llama.cpp's own log lines off stderr, as ``llama_cpp.Llama(verbose=False)`` means to:
    they go to Python logging (:mod:`llama_cache.native_log`)."""
    route_llama_cpp_logs()
    library = logging.getLogger("llama-cpp-python")
    if library.level == logging.NOTSET or library.level < logging.ERROR:
        library.setLevel(logging.ERROR)


class Model:
    """One GGUF file's weights and vocabulary, loaded on the CPU and memory-mapped.

    Args:
        path: the GGUF file.
        chat_template: a Jinja2 chat template to use instead of the file's (None: the file's).

    Raises:
        FileNotFoundError: ``path`` is not a file.
        ValueError: llama.cpp could not load it, or ``chat_template`` is not valid Jinja2.

    Thread-safety: every method may be called from any thread at once. :meth:`close` frees the
    weights: call it once, after every context made from the model is freed.
    """

    def __init__(self, path: str | Path, chat_template: str | None = None) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"model file not found: {self.path}")
        quiet_llama_cpp()
        params = llama_cpp.llama_model_default_params()
        pointer = llama_cpp.llama_model_load_from_file(str(self.path).encode("utf-8"), params)
        if not pointer:
            raise ValueError(f"llama.cpp could not load the model {self.path}")
        self.pointer: Any = pointer
        """The ``llama_model *`` (valid until :meth:`close`)."""
        self.vocab: Any = llama_cpp.llama_model_get_vocab(pointer)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_train = int(llama_cpp.llama_model_n_ctx_train(pointer))
        self.bos = int(llama_cpp.llama_vocab_bos(self.vocab))
        self.eos = int(llama_cpp.llama_vocab_eos(self.vocab))
        self.recurrent = bool(llama_cpp.llama_model_is_recurrent(pointer) or llama_cpp.llama_model_is_hybrid(pointer))
        """Its memory holds a state per sequence that cannot be cut back (recurrent or hybrid)."""
        self.metadata = self._read_metadata()
        self.detokenizer = Detokenizer(self.vocab, self.n_vocab, self.bos)
        """The exact text of this model's tokens."""
        self._eog = np.fromiter((bool(llama_cpp.llama_vocab_is_eog(self.vocab, t)) for t in range(self.n_vocab)),
                                dtype=np.bool_, count=self.n_vocab)
        self.chat_handler = self._chat_handler(chat_template)
        """llama-cpp-python's chat completion handler for this model (see the module's docstring)."""
        self._closed = False

    # -- vocabulary --------------------------------------------------------------------------------

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """``text``'s tokens, as ``llama_cpp.Llama.tokenize`` gives them. O(len(text))."""
        capacity = len(text) + 2
        buffer = (llama_cpp.llama_token * capacity)()
        n = llama_cpp.llama_tokenize(self.vocab, text, len(text), buffer, capacity, add_bos, special)
        if n < 0:
            capacity = -n
            buffer = (llama_cpp.llama_token * capacity)()
            n = llama_cpp.llama_tokenize(self.vocab, text, len(text), buffer, capacity, add_bos, special)
            if n < 0:
                raise RuntimeError(f"llama.cpp could not tokenize a {len(text)}-byte text")
        return list(buffer[:n])

    def is_end(self, token: int) -> bool:
        """Whether ``token`` ends a generation (an end-of-generation token of the vocabulary). O(1)."""
        return 0 <= token < self.n_vocab and bool(self._eog[token])

    @property
    def end_tokens(self) -> list[int]:
        """Every end-of-generation token id."""
        return np.flatnonzero(self._eog).tolist()

    def token_text(self, token: int) -> str:
        """The vocabulary's text of ``token`` (``llama_vocab_get_text``; how templates name BOS and EOS)."""
        return llama_cpp.llama_vocab_get_text(self.vocab, token).decode("utf-8", "replace")

    def description(self) -> str:
        """llama.cpp's one-line description of the model (architecture, size, quantization)."""
        buffer = ctypes.create_string_buffer(256)
        llama_cpp.llama_model_desc(self.pointer, buffer, 256)
        return buffer.value.decode("utf-8", "replace")

    def close(self) -> None:
        """Free the weights (once); nothing may use the model after."""
        if not self._closed:
            self._closed = True
            llama_cpp.llama_model_free(self.pointer)

    # -- loading -----------------------------------------------------------------------------------

    def _read_metadata(self) -> dict[str, str]:
        metadata: dict[str, str] = {}
        size = 1024
        buffer = ctypes.create_string_buffer(size)
        for index in range(int(llama_cpp.llama_model_meta_count(self.pointer))):
            values = []
            for read in (llama_cpp.llama_model_meta_key_by_index, llama_cpp.llama_model_meta_val_str_by_index):
                n = read(self.pointer, index, buffer, size)
                if n >= size:
                    size = n + 1
                    buffer = ctypes.create_string_buffer(size)
                    n = read(self.pointer, index, buffer, size)
                values.append(buffer.value.decode("utf-8", "replace"))
            metadata[values[0]] = values[1]
        return metadata

    def _chat_handler(self, template: str | None) -> ChatHandler:
        eos = self.token_text(self.eos) if self.eos != -1 else ""
        bos = self.token_text(self.bos) if self.bos != -1 else ""
        formats = llama_cpp.llama_chat_format
        if template is not None:
            try:
                jinja2.sandbox.ImmutableSandboxedEnvironment().parse(template)
            except jinja2.TemplateSyntaxError as error:
                raise ValueError(f"the chat template is not valid Jinja2: {error}") from None
        else:
            own = self.metadata.get("tokenizer.chat_template")
            if own is None:
                return formats.get_chat_completion_handler("llama-2")
            known = formats.guess_chat_format_from_gguf_metadata(self.metadata)
            if known is not None:
                return formats.get_chat_completion_handler(known)
            template = own
        formatter = formats.Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos,
                                                stop_token_ids=[self.eos] if self.eos != -1 else None)
        return formatter.to_chat_handler()
