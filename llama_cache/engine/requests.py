"""One completion submitted to the engine by a program: its text as it comes, then its whole response.

:meth:`~.engine.Engine.submit` returns an :class:`EngineRequest` at once, its generation already
queued; a program submits many, then reads them (an evaluation set, a RAG pipeline's questions, an
agent's branches), and the engine batches whatever runs at once. Iterating a request yields its text
as it is sampled; :meth:`EngineRequest.result` waits for the end and gives the response in
llama-cpp-python's non-streamed shape (``text_completion`` or ``chat.completion``), with usage counting
the prompt tokens reused (``prompt_tokens_details.cached_tokens``).

Thread-safety: a request may be cancelled from any thread; reading it (iteration, :meth:`result`) is
serialised by a lock, so two threads reading one request each get part of its text.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from llama_cache.engine.completions import Completions

__all__ = ["EngineRequest"]


class EngineRequest:
    """A completion running on an :class:`~.engine.Engine` (see the module's docstring).

    Made by :meth:`~.engine.Engine.submit`, not directly.

    Args:
        completions: the request's view of the engine, its generation submitted.
        chunks: the streamed response's chunks.
        chat: whether they are chat chunks (else text-completion chunks).
        cancel_event: set by :meth:`cancel`; the engine asks it every step.
    """

    def __init__(self, completions: Completions, chunks: Iterator[dict[str, Any]], chat: bool,
                 cancel_event: threading.Event) -> None:
        self._completions = completions
        self._chunks = chunks
        self._chat = chat
        self._cancel = cancel_event
        self._lock = threading.Lock()
        self._text: list[str] = []
        self._first: dict[str, Any] | None = None
        self._finish_reason: str | None = None
        self._ended = False

    def __iter__(self) -> Iterator[str]:
        """The answer's text, piece by piece, as it is sampled (pieces already read are not repeated).

        Raises:
            RuntimeError: the generation failed.
        """
        while True:
            with self._lock:
                piece = self._next_piece()
            if piece is None:
                return
            if piece:
                yield piece

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        """The whole response once the generation has ended, in llama-cpp-python's shape:
        ``{"choices": [{"text"| "message", "finish_reason"}], "usage": {...}, ...}``.

        Args:
            timeout: seconds to wait at most (None: as long as it takes).

        Raises:
            TimeoutError: it had not ended within ``timeout``.
            RuntimeError: the generation failed.
        """
        generation = self._completions.last_generation
        if timeout is not None and generation is not None and not generation.done.wait(timeout):
            raise TimeoutError(f"the completion had not ended within {timeout} s")
        with self._lock:
            while self._next_piece() is not None:
                pass
            return self._response()

    def cancel(self) -> None:
        """End the generation at the engine's next step (``finish_reason`` ``"stop"``); its sequence
        keeps what it evaluated, for reuse. Idempotent."""
        self._cancel.set()
        self._completions.engine.scheduler.wake()

    @property
    def done(self) -> bool:
        """Whether the generation has ended (its text may still be unread)."""
        generation = self._completions.last_generation
        return generation is None or generation.done.is_set()

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens taken from the context's sequences or the cache tiers, not evaluated."""
        return self._completions.last_prompt_length - self._completions.last_prompt_tokens_evaluated

    def _next_piece(self) -> str | None:
        """The next chunk's text ('' for one without), None at the end. Lock held."""
        if self._ended:
            return None
        chunk = next(self._chunks, None)
        if chunk is None:
            self._ended = True
            return None
        if self._first is None:
            self._first = chunk
        choice = chunk["choices"][0]
        if choice.get("finish_reason") is not None:
            self._finish_reason = choice["finish_reason"]
        if self._chat:
            text = choice.get("delta", {}).get("content") or ""
        else:
            text = choice.get("text") or ""
        if text:
            self._text.append(text)
        return text

    def _response(self) -> dict[str, Any]:
        first = self._first or {}
        text = "".join(self._text)
        reason = self._finish_reason or "stop"
        completions = self._completions
        prompt_tokens = completions.last_prompt_length
        completion_tokens = completions.last_completion_tokens
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        if self._chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": reason}
            kind = "chat.completion"
        else:
            choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": reason}
            kind = "text_completion"
        return {"id": first.get("id", ""), "object": kind, "created": first.get("created", 0),
                "model": first.get("model", ""), "choices": [choice], "usage": usage}
