"""The server's compute thread: one thread evaluates for every context, in rounds, in chunks."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

from llama_cache.server.compute import (
    FAIR_CHUNK_TOKENS,
    GENERATING_CHUNK_TOKENS,
    SHORT_TOKENS,
    ComputeThread,
    EvaluationCancelled,
)


class _Recorder:
    """Evaluate functions that record (name, slice length, thread) in one shared list.

    ``held`` is set when a slice starts waiting for its gate: the compute thread is then busy with it.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.held = threading.Event()

    def evaluator(self, name: str, gate: threading.Event | None = None):  # type: ignore[no-untyped-def]
        def evaluate(tokens: Sequence[int]) -> None:
            if gate is not None and not gate.is_set():
                self.held.set()
                assert gate.wait(10)
            self.calls.append((name, len(tokens), threading.get_ident()))
        return evaluate


def _submit(compute: ComputeThread, evaluate, tokens: Sequence[int], batch: int = 512) -> threading.Thread:  # type: ignore[no-untyped-def]
    thread = threading.Thread(target=compute.evaluate, args=(evaluate, tokens, batch))
    thread.start()
    return thread


def _wait_until(condition, timeout: float = 10) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


def test_every_slice_runs_on_the_one_compute_thread_in_order() -> None:
    compute = ComputeThread()
    recorder = _Recorder()
    seen: list[int] = []
    try:
        compute.evaluate(lambda tokens: seen.extend(tokens), list(range(1200)), batch=500)
        compute.evaluate(recorder.evaluator("a"), [1, 2, 3], batch=500)
        compute.evaluate(recorder.evaluator("empty"), [], batch=500)
        threads = [_submit(compute, recorder.evaluator(f"t{i}"), [i] * 7) for i in range(4)]
        for thread in threads:
            thread.join()
    finally:
        compute.close()
    assert seen == list(range(1200))  # 500 + 500 + 200, in order
    assert compute.evaluations == 3 + 1 + 1 + 4 and compute.tokens == 1200 + 3 + 7 * 4
    assert {ident for _, _, ident in recorder.calls} == {compute._thread.ident}  # noqa: SLF001
    assert ("empty", 0, compute._thread.ident) in recorder.calls  # noqa: SLF001


def test_short_evaluations_go_between_the_chunks_of_a_long_one_and_the_oldest_prompt_first() -> None:
    compute = ComputeThread()
    recorder = _Recorder()
    gate = threading.Event()
    try:
        long_one = _submit(compute, recorder.evaluator("long", gate), list(range(1000)))
        assert recorder.held.wait(10)  # the first chunk is running (blocked on the gate)
        later = _submit(compute, recorder.evaluator("later"), list(range(300)))
        _wait_until(lambda: compute.waiting == 1)
        shorts = []
        for i in range(2):  # one at a time: two threads started together may queue in either order
            shorts.append(_submit(compute, recorder.evaluator(f"short{i}"), [i]))
            _wait_until(lambda: compute.waiting == 2 + i)  # noqa: B023 (read before i changes)
        gate.set()
        for thread in [long_one, later, *shorts]:
            thread.join()
    finally:
        compute.close()
    order = [(name, n) for name, n, _ in recorder.calls]
    # The first chunk is a whole batch (nothing waited when it started); the short ones go next; the
    # chunk right after them is small (contexts were generating), then the oldest prompt is read in fair
    # chunks while the later one waits, and finished first.
    assert order[:3] == [("long", 512), ("short0", 1), ("short1", 1)]
    rest = 1000 - 512 - GENERATING_CHUNK_TOKENS - FAIR_CHUNK_TOKENS
    assert order[3:] == [("long", GENERATING_CHUNK_TOKENS), ("long", FAIR_CHUNK_TOKENS), ("long", rest),
                         ("later", 300)]


def test_what_is_left_of_a_long_evaluation_waits_with_the_short_ones() -> None:
    compute = ComputeThread()
    recorder = _Recorder()
    gate = threading.Event()
    tokens = 512 + SHORT_TOKENS  # after one batch, SHORT_TOKENS are left: a short evaluation
    try:
        first = _submit(compute, recorder.evaluator("prompt", gate), list(range(tokens)))
        assert recorder.held.wait(10)
        step = _submit(compute, recorder.evaluator("step"), [1])
        _wait_until(lambda: compute.waiting == 1)
        gate.set()
        first.join()
        step.join()
    finally:
        compute.close()
    assert [(name, n) for name, n, _ in recorder.calls] == [("prompt", 512), ("step", 1), ("prompt", SHORT_TOKENS)]


def test_errors_reach_their_caller_and_stop_the_rest_of_its_slices() -> None:
    compute = ComputeThread()
    calls: list[int] = []

    def failing(tokens: Sequence[int]) -> None:
        calls.append(len(tokens))
        if len(calls) == 2:
            raise ValueError("token 7 is not in the vocabulary")

    try:
        with pytest.raises(ValueError, match="vocabulary"):
            compute.evaluate(failing, list(range(300)), batch=100)
        assert calls == [100, 100]
        compute.evaluate(lambda tokens: calls.append(-len(tokens)), [1], batch=100)  # the thread lives on
        assert calls[-1] == -1

        def broken_check() -> bool:
            raise RuntimeError("the cancellation check failed")

        with pytest.raises(RuntimeError, match="cancellation check"):
            compute.evaluate(lambda tokens: calls.append(len(tokens)), list(range(150)), batch=100,
                             cancelled=broken_check)
        assert calls[-1] == 100  # the first slice ran, the check failed before the second
        compute.evaluate(lambda tokens: calls.append(-2), [1], batch=100)
        assert calls[-1] == -2
        with pytest.raises(ValueError, match="batch"):
            compute.evaluate(lambda tokens: None, [1], batch=0)
    finally:
        compute.close()
    with pytest.raises(RuntimeError, match="closed"):
        compute.evaluate(lambda tokens: None, [1], batch=1)
    compute.close()  # idempotent


def test_a_cancelled_evaluation_stops_between_chunks() -> None:
    compute = ComputeThread()
    cancel = threading.Event()
    calls: list[int] = []

    def evaluate(tokens: Sequence[int]) -> None:
        calls.append(len(tokens))
        cancel.set()  # cancelled while its first chunk runs

    try:
        with pytest.raises(EvaluationCancelled):
            compute.evaluate(evaluate, list(range(1000)), batch=512, cancelled=cancel.is_set)
        assert calls == [512]
        # Cancellation is asked between chunks only: a one-chunk evaluation runs whole.
        compute.evaluate(evaluate, [1, 2], batch=512, cancelled=cancel.is_set)
        assert calls == [512, 2]
    finally:
        compute.close()


def test_the_compute_thread_cannot_wait_for_itself() -> None:
    compute = ComputeThread()
    errors: list[BaseException] = []

    def nested(tokens: Sequence[int]) -> None:
        try:
            compute.evaluate(lambda t: None, [1], batch=1)
        except RuntimeError as error:
            errors.append(error)

    try:
        compute.evaluate(nested, [1], batch=1)
    finally:
        compute.close()
    assert len(errors) == 1 and "compute thread itself" in str(errors[0])


def test_calls_run_on_the_compute_thread_in_turn_with_short_evaluations() -> None:
    compute = ComputeThread()
    recorder = _Recorder()
    gate = threading.Event()
    results: list[int] = []
    try:
        prompt = _submit(compute, recorder.evaluator("prompt", gate), list(range(600)))
        assert recorder.held.wait(10)
        step = _submit(compute, recorder.evaluator("step"), [1])
        _wait_until(lambda: compute.waiting == 1)
        copier = threading.Thread(target=lambda: results.append(
            compute.call(lambda: recorder.calls.append(("copy", 0, threading.get_ident())) or 42)))
        copier.start()
        _wait_until(lambda: compute.waiting == 2)
        gate.set()
        for thread in (prompt, step, copier):
            thread.join()
        with pytest.raises(ZeroDivisionError):
            compute.call(lambda: 1 // 0)
    finally:
        compute.close()
    assert results == [42]
    assert [(name, n) for name, n, _ in recorder.calls] == [("prompt", 512), ("step", 1), ("copy", 0),
                                                                 ("prompt", GENERATING_CHUNK_TOKENS),
                                                                 ("prompt", 88 - GENERATING_CHUNK_TOKENS)]
    assert {ident for _, _, ident in recorder.calls} == {compute._thread.ident}  # noqa: SLF001
    assert compute.evaluations == 4 and compute.tokens == 601  # calls are not evaluations


# ------------------------------------------------------------------ contexts lending heads to each other

@pytest.fixture(scope="module")
def contexts():  # type: ignore[no-untyped-def]
    """Two server contexts on one compute thread, siblings of each other, as ``load_engine`` makes them."""
    from llama_cache import default_model_path
    from llama_cache.server.config import ServerConfig
    from llama_cache.server.contexts import SlotLlama

    options = ServerConfig(n_ctx=1024).context_options()
    compute = ComputeThread()
    pair = [SlotLlama(model_path=str(default_model_path()), verbose=False, **options) for _ in range(2)]
    for llama in pair:
        llama.use_compute(compute)
        llama.siblings = pair
    yield pair
    compute.close()
    for llama in pair:
        llama.close()


@pytest.fixture(scope="module")
def alone():  # type: ignore[no-untyped-def]
    from llama_cache import Llama, default_model_path
    from llama_cache.server.config import ServerConfig

    llama = Llama(model_path=str(default_model_path()), verbose=False, **ServerConfig(n_ctx=1024).context_options())
    yield llama
    llama.close()


def _head(llama, words: int) -> list[int]:  # type: ignore[no-untyped-def]
    text = f"Rules {time.monotonic_ns()}: " + "answer briefly, politely and in plain words. " * words
    return llama.tokenize(text.encode())


@pytest.mark.model
def test_a_context_reads_a_head_another_context_holds_instead_of_evaluating_it(contexts, alone) -> None:  # type: ignore[no-untyped-def]
    """A borrowed head is the lender's KV: the answer is the one a context that had evaluated it gives.

    (llama.cpp's numbers depend on how tokens were split into batches, so the reference replays the
    lender's batches on one context instead of reading the prompt in one go.)
    """
    from llama_cache.server.contexts import MIN_SHARED_TOKENS

    first, second = contexts
    head = _head(first, 12)
    assert len(head) > MIN_SHARED_TOKENS
    river = first.tokenize(b" Name a river.", add_bos=False)
    question = second.tokenize(b" Which colour is the sky on a clear day?", add_bos=False)
    first.reset()
    second.reset()
    first.create_completion(head + river, max_tokens=2, temperature=0)
    reply = second.create_completion(head + question, max_tokens=12, temperature=0)
    assert second.last_prompt_tokens_evaluated == len(question)  # the head came from the first context
    alone.reset()
    alone.eval(head + river)  # as the first context did
    alone.n_tokens = len(head)  # cut back to the head: the completion evaluates the question only
    expected = alone.create_completion(head + question, max_tokens=12, temperature=0)
    assert alone.last_prompt_tokens_evaluated == len(question)
    assert reply["choices"][0]["text"] == expected["choices"][0]["text"]
    # The same prompt on the first context, emptied: all but its last token are lent (it needs logits).
    first.reset()
    again = first.create_completion(head + question, max_tokens=12, temperature=0)
    assert first.last_prompt_tokens_evaluated == 1
    alone.reset()
    alone.eval(head + river)
    alone.n_tokens = len(head)
    alone.eval(question)  # as the second context did
    alone.n_tokens = len(head) + len(question) - 1
    expected = alone.create_completion(head + question, max_tokens=12, temperature=0)
    assert again["choices"][0]["text"] == expected["choices"][0]["text"]


@pytest.mark.model
def test_short_heads_and_foreign_contexts_are_not_borrowed(contexts) -> None:  # type: ignore[no-untyped-def]
    from llama_cache.server.contexts import MIN_SHARED_TOKENS

    first, second = contexts
    head = _head(first, 12)
    first.reset()
    second.reset()
    first.create_completion(head, max_tokens=1, temperature=0)
    short = head[: MIN_SHARED_TOKENS - 1] + second.tokenize(b" Unrelated words follow here.", add_bos=False)
    second.create_completion(short, max_tokens=1, temperature=0)
    assert second.last_prompt_tokens_evaluated == len(short)  # too short a head to be worth it
    fingerprint = first.fingerprint
    try:
        first.fingerprint = "another model"  # a context of another model or configuration lends nothing
        second.reset()
        prompt = head + second.tokenize(b" And now a question.", add_bos=False)
        second.create_completion(prompt, max_tokens=1, temperature=0)
        assert second.last_prompt_tokens_evaluated == len(prompt)
    finally:
        first.fingerprint = fingerprint


@pytest.mark.model
def test_every_change_to_a_contexts_kv_happens_on_the_compute_thread(contexts, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import llama_cpp

    first, _ = contexts
    threads: list[threading.Thread] = []
    cut = llama_cpp.llama_memory_seq_rm

    def recorded(*args):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread())
        return cut(*args)

    monkeypatch.setattr(llama_cpp, "llama_memory_seq_rm", recorded)  # as llama_cache.Llama calls it
    monkeypatch.setattr(llama_cpp.llama_cpp, "llama_memory_seq_rm", recorded)  # as llama-cpp-python does
    head = _head(first, 4)
    first.reset()
    first.create_completion(head + first.tokenize(b" One.", add_bos=False), max_tokens=2, temperature=0)
    # A prompt sharing the head: llama-cpp-python's generate cuts the KV back to it before evaluating.
    first.create_completion(head + first.tokenize(b" Two, three.", add_bos=False), max_tokens=2, temperature=0)
    assert threads and all(thread is first.compute._thread for thread in threads)  # noqa: SLF001


@pytest.mark.model
def test_a_failing_copy_from_another_context_is_evaluated_instead(contexts, alone, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    import logging

    first, second = contexts
    head = _head(first, 12)
    first.reset()
    second.reset()
    first.create_completion(head, max_tokens=1, temperature=0)

    def broken() -> None:
        raise ValueError("bytes went missing")

    monkeypatch.setattr(first, "_read_seq_bytes", broken)
    prompt = head + second.tokenize(b" And now a question.", add_bos=False)
    with caplog.at_level(logging.WARNING, logger="llama_cache.server.contexts"):
        reply = second.create_completion(prompt, max_tokens=4, temperature=0)
    assert second.last_prompt_tokens_evaluated == len(prompt)  # nothing borrowed, all evaluated
    alone.reset()
    assert reply["choices"][0]["text"] == alone.create_completion(prompt, max_tokens=4, temperature=0)["choices"][0]["text"]
    assert "could not copy" in caplog.text and "bytes went missing" in caplog.text
