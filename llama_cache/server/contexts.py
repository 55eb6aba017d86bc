"""A server's contexts: :class:`SlotLlama`, what the contexts share, and a chat prompt's tokens.

Each context is a :class:`SlotLlama`, a :class:`llama_cache.Llama` that evaluates on the server's one
compute thread (:mod:`.compute`), obeys its running request (stopped between prompt chunks and after
each token when cancelled) and may copy a head of tokens it needs from another context instead of
evaluating it. The contexts share their latest tokenizations (:class:`TokenizationMemo`).
:func:`prompt_tokens_for_chat` gives the tokens a chat request will evaluate, for routing.

Thread-safety: a context is used by the worker thread running its request and by the compute thread,
never by two requests at once (see :mod:`.slots`); :class:`TokenizationMemo` is thread-safe.
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

import jinja2
import llama_cpp
import numpy as np
import numpy.typing as npt

from llama_cache.llama import Llama
from llama_cache.server.limits import PromptTextBound
from llama_cache.server.compute import ComputeThread
from llama_cache.state.kv_layout import parse_seq_state
from llama_cache.state.llama_state import IncompatibleStateError, LlamaState

__all__ = ["MIN_SHARED_TOKENS", "PromptTooLong", "RenderingCancelled", "SlotLlama", "TokenizationMemo",
           "common_prefix", "live_tokens", "prompt_tokens_for_chat"]

logger = logging.getLogger(__name__)


MIN_SHARED_TOKENS = 32
"""The shortest head worth taking from a context that holds another conversation, by routing a prompt
there or by copying the head from it (chat prompts all share their template's first few tokens, which
are not worth another conversation's live tokens)."""


class SlotLlama(Llama):
    """A :class:`llama_cache.Llama` that evaluates on the server's compute thread and obeys its request.

    ``compute``, set by :meth:`use_compute`, runs every evaluation, every copy of the context's state
    out or in and every cut of its KV (see :mod:`.compute`): the tokens are checked here, then evaluated
    there in chunks, and ``request_cancelled`` (when set) is asked between chunks, so a cancelled
    request stops reading a long prompt at the next chunk (:class:`EvaluationCancelled`).

    ``siblings`` are the server's contexts (this one among them): one may lend another a head of
    tokens both need (:meth:`_take_head_from_a_sibling`).

    ``request_stop``, when set, is added to every completion's stopping criteria (chat handlers replace
    the caller's criteria with their own, so it cannot be passed as an argument): llama-cpp-python calls
    it after each sampled token, which is how a request is timed and how a cancelled one stops.

    ``token_watcher``, when set, is told every token ``generate`` yields, in order (end-of-generation
    tokens included): how a sequence learns which token it sampled (:mod:`.sequences`).

    ``prompt_substitute``, when set, is given each completion's prompt tokens (as the chat handler
    tokenized them) and returns the tokens to evaluate in their place: how a conversation continues from
    the very tokens its last answer left (:mod:`.openai_responses`), which the same text tokenized again
    need not be.
    """

    compute: ComputeThread | None = None
    siblings: Sequence[SlotLlama] = ()
    tokenized: TokenizationMemo | None = None
    request_cancelled: Callable[[], bool] | None = None
    request_stop: Callable[[npt.NDArray[np.intc], npt.NDArray[np.single]], bool] | None = None
    token_watcher: Callable[[int], None] | None = None
    prompt_substitute: Callable[[list[int]], list[int]] | None = None

    def use_compute(self, compute: ComputeThread) -> None:
        """Evaluate, copy the state and change the KV of this context on ``compute`` from now on.

        llama-cpp-python's ``generate`` also cuts the KV back itself (``kv_cache_seq_rm``, to the prefix a
        new prompt shares) in the calling thread; that call is sent to the compute thread too, so that
        everything changing this context's KV happens there, where other contexts read it (see
        :meth:`_take_head_from_a_sibling`).
        """
        self.compute = compute
        context = self._ctx
        cut = context.kv_cache_seq_rm

        def kv_cache_seq_rm(seq_id: int, p0: int, p1: int) -> bool:
            if compute.on_thread():
                return cut(seq_id, p0, p1)
            return compute.call(lambda: cut(seq_id, p0, p1))

        context.kv_cache_seq_rm = kv_cache_seq_rm  # type: ignore[method-assign]

    def eval(self, tokens: Sequence[int]) -> None:
        """Evaluate ``tokens`` on the compute thread (as :meth:`llama_cache.Llama.eval` without one).

        Raises:
            ValueError, TypeError: a token is not a vocabulary id (nothing was evaluated).
            EvaluationCancelled: the request was cancelled after the first chunk.
        """
        compute = self.compute
        if compute is None:
            return super().eval(tokens)
        checked = self._checked_tokens(tokens)  # all of them, before any chunk is evaluated
        if len(checked) > MIN_SHARED_TOKENS and self.siblings:
            evaluated = self.n_tokens
            sequence = [*self.input_ids[:evaluated].tolist(), *checked]
            reached = compute.call(lambda: self._take_head_from_a_sibling(sequence))
            checked = sequence[reached:]
        compute.evaluate(super().eval, checked, self.n_batch, cancelled=self.request_cancelled)
        return None

    def generate(self, tokens: Sequence[int], *args: Any, **kwargs: Any) -> Generator[int, Sequence[int] | None, None]:
        """As :meth:`llama_cache.Llama.generate`; every token yielded is told to ``token_watcher`` first."""
        inner = super().generate(tokens, *args, **kwargs)
        watcher = self.token_watcher
        if watcher is None:
            return (yield from inner)
        sent: Sequence[int] | None = None
        while True:
            try:
                token = inner.send(sent)  # type: ignore[arg-type]
            except StopIteration as stop:
                return stop.value
            watcher(token)
            sent = yield token

    def rewind_to_prompt(self) -> bool:
        """Put the context back at the end of the last ``generate``'s prompt, with the prompt's logits.

        The next completion of the same prompt then samples at once, evaluating nothing: how a request's
        later choices reuse the first one's prompt evaluation. The KV past the prompt is cut (on the
        compute thread). Recurrent and hybrid memory cannot be cut: nothing changes, and the next
        completion resumes from a checkpoint or the prompt cache as any other prompt would.

        Returns:
            True if the context now holds just the prompt, ready to sample.
        """
        n = self._prompt_len
        logits = self._prompt_logits
        if logits is None or self._state_is_opaque or not 0 < n <= self.n_tokens:
            return False
        if n < self.n_tokens and not self._ctx.kv_cache_seq_rm(-1, n, -1):
            return False
        self.n_tokens = n
        self._base_valid = min(self._base_valid, n)
        self._restored_logits = logits.copy()
        self._requires_eval = False
        np.copyto(self._last_logits, logits)
        self._last_logits_pos = n - 1
        return True

    def _take_head_from_a_sibling(self, sequence: list[int]) -> int:
        """Copy into this context the longest head of ``sequence`` another context holds; on the compute thread.

        Prompts sent together often share a head (a system prompt) that the prompt cache does not hold
        yet: the first context to read it lends it to the others, which then read only their own tokens
        (as a restore from the cache would: llama.cpp's bytes for those positions, cut at the shared
        head). Worth it from :data:`MIN_SHARED_TOKENS` tokens beyond what this context holds; at least
        one token of ``sequence`` is left to evaluate, for its logits. The sibling is only read: its KV
        changes on the compute thread alone (:meth:`use_compute`), where this runs, and its tokens below
        its ``n_tokens`` are written there alone too.

        Returns:
            How many leading tokens of ``sequence`` this context now holds (its ``n_tokens``): the
            evaluation goes on from there. Whatever fails leaves a consistent context.
        """
        held = self.n_tokens
        limit = len(sequence) - 1
        wanted = np.asarray(sequence[:limit], dtype=np.intc)
        best: SlotLlama | None = None
        best_common = held + MIN_SHARED_TOKENS - 1
        for sibling in self.siblings:
            if sibling is self or sibling.fingerprint != self.fingerprint or sibling._state_is_opaque:
                continue
            theirs = np.asarray(sibling.input_ids[: min(sibling.n_tokens, limit)], dtype=np.intc)
            common = common_prefix(theirs, wanted)
            if common > best_common:
                best, best_common = sibling, common
        if best is None or self._state_is_opaque:
            return held
        try:
            return self._copy_head(best, best_common)
        except Exception as error:  # noqa: BLE001 - lending is an optimisation: never fail a completion
            logger.warning("could not copy a %d-token head from another context (%s: %s); evaluating it",
                           best_common, type(error).__name__, error)
            return self.n_tokens  # what the context consistently holds: the rest is evaluated

    def _copy_head(self, lender: SlotLlama, n_tokens: int) -> int:
        """Restore ``lender``'s first ``n_tokens`` here; this context's ``n_tokens`` after it (0 if refused)."""
        try:
            raw = lender._read_seq_bytes()  # noqa: SLF001 - another context of this server, read on the compute thread
        except RuntimeError:
            return self.n_tokens
        parsed = parse_seq_state(raw)
        if parsed is None or parsed[1].n_tokens < n_tokens:
            return self.n_tokens
        tokens = np.array(lender.input_ids[: parsed[1].n_tokens], dtype=np.int32)
        head = LlamaState.from_seq_bytes(tokens, None, lender._seed, lender.fingerprint, raw).prefix(n_tokens, None)
        seed = self._seed
        try:
            Llama.load_state(self, head)  # here, not through the compute thread: this is it
        except IncompatibleStateError:
            return self.n_tokens  # the context is empty now: what it held is evaluated again with the rest
        finally:
            self._seed = seed  # the completion's seed, not the lender's
        self._forget_base()  # later saves copy this context's own KV, not a view of the lender's bytes
        return self.n_tokens

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """As ``llama_cpp.Llama.tokenize``; a text tokenized lately in this context's cache namespace
        by any context is looked up in ``tokenized``."""
        return self.tokenize_for(self.fingerprint, text, add_bos, special)

    def tokenize_for(self, fingerprint: str, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """As :meth:`tokenize`, for a request of the cache namespace ``fingerprint``: the memo's entries
        are a namespace's own, so how fast a text is tokenized tells nothing of other namespaces' texts.
        Thread-safe (it reads the shared vocabulary only)."""
        memo = self.tokenized
        if memo is None:
            return super().tokenize(text, add_bos, special)
        key = (fingerprint, bytes(text), bool(add_bos), bool(special))
        tokens = memo.get(key)
        if tokens is None:
            tokens = super().tokenize(text, add_bos, special)
            memo.put(key, tokens)
        return list(tokens)

    def set_cache_namespace(self, namespace: str | None) -> None:
        """As :meth:`llama_cache.Llama.set_cache_namespace`, on the compute thread: another context
        lending its head of tokens there (:meth:`_take_head_from_a_sibling`) never sees this one's KV
        under its new namespace."""
        change = super().set_cache_namespace
        if self.compute is None or self.compute.on_thread():
            change(namespace)
        else:
            self.compute.call(lambda: change(namespace))

    def save_state(self) -> Any:
        """As :meth:`llama_cache.Llama.save_state`, on the compute thread (see :meth:`.ComputeThread.call`)."""
        save = super().save_state
        return save() if self.compute is None else self.compute.call(save)

    def load_state(self, state: Any) -> None:
        """As :meth:`llama_cache.Llama.load_state`, on the compute thread (see :meth:`.ComputeThread.call`)."""
        load = super().load_state
        if self.compute is None:
            load(state)
        else:
            self.compute.call(lambda: load(state))

    def _create_completion(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        extra = self.request_stop
        if extra is not None:
            existing = kwargs.get("stopping_criteria") or []
            kwargs["stopping_criteria"] = llama_cpp.StoppingCriteriaList([*existing, extra])
        substitute = self.prompt_substitute
        if substitute is not None and isinstance(kwargs.get("prompt"), list):
            kwargs["prompt"] = substitute(kwargs["prompt"])
        return super()._create_completion(*args, **kwargs)


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

    def __init__(self, llama: Llama, bound: PromptTextBound | None, cancelled: Callable[[], bool] | None,
                 fingerprint: str | None = None) -> None:
        self._llama = llama
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
        if self._fingerprint is not None and isinstance(self._llama, SlotLlama):
            return self._llama.tokenize_for(self._fingerprint, text, add_bos, special)
        return self._llama.tokenize(text, add_bos, special)

    def create_completion(self, prompt: Any = None, **_: Any) -> Any:
        if isinstance(prompt, str):
            raise _Captured(self._tokenize(prompt.encode("utf-8"), True, True))
        raise _Captured(list(prompt))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llama, name)


def prompt_tokens_for_chat(llama: Llama, messages: list[dict[str, Any]], *, bound: PromptTextBound | None = None,
                           cancelled: Callable[[], bool] | None = None, fingerprint: str | None = None,
                           **template_options: Any) -> list[int]:
    """The tokens ``llama.create_chat_completion(messages, **template_options)`` would evaluate.

    Only renders and tokenizes (thread-safe on a shared model); evaluates nothing.

    Args:
        bound: a rendered prompt that cannot fit the context by it is not tokenized (:class:`PromptTooLong`).
        cancelled: asked once the template is rendered; when true, nothing is tokenized
            (:class:`RenderingCancelled`).
        fingerprint: the request's cache namespace, for a :class:`SlotLlama`'s shared tokenizations
            (None: the context's current one).

    Raises:
        ValueError: the chat handler refused the messages or options (an unknown tool, say).
        PromptTooLong, RenderingCancelled: see above.
    """
    handler = (
        llama.chat_handler
        or llama._chat_handlers.get(llama.chat_format)  # noqa: SLF001 - what create_chat_completion uses
        or llama_cpp.llama_chat_format.get_chat_completion_handler(llama.chat_format)
    )
    try:
        handler(llama=_PromptProbe(llama, bound, cancelled, fingerprint), messages=messages, **template_options)  # type: ignore[arg-type]
    except _Captured as captured:
        return captured.prompt
    except (TypeError, KeyError, AttributeError, jinja2.TemplateError) as error:
        raise ValueError(f"the chat template could not render these messages: {error}") from None
    raise ValueError("the chat handler produced no prompt")


def common_prefix(a: npt.NDArray[np.intc], b: npt.NDArray[np.intc]) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    different = np.flatnonzero(a[:n] != b[:n])
    return int(different[0]) if len(different) else n


def live_tokens(llama: Llama) -> npt.NDArray[np.intc]:
    """A copy of the tokens a context has evaluated."""
    return np.array(llama.input_ids[: llama.n_tokens], dtype=np.intc)

