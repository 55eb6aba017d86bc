"""The engine's library API on the real default model: ``Engine.submit`` and the requests it returns."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

import llama_cache
from llama_cache import Engine, EngineRequest

pytestmark = [pytest.mark.model]

SYSTEM = "You are a careful assistant who answers in one short sentence. " * 8


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine(n_ctx=4096, parallel=4) as engine:
        yield engine


def test_the_engine_and_its_requests_are_public() -> None:
    assert {"Engine", "EngineRequest"} <= set(llama_cache.__all__)
    assert llama_cache.Engine is Engine


def test_submit_returns_at_once_and_each_request_streams_its_own_text(engine: Engine) -> None:
    prompts = [f"List {n} colours of the rainbow:" for n in range(1, 7)]  # more than run at once
    requests = [engine.submit(prompt, max_tokens=10, temperature=0) for prompt in prompts]
    assert all(isinstance(request, EngineRequest) for request in requests)
    streamed = "".join(requests[3])  # read one while the others run or wait
    results = [request.result() for request in requests]
    assert results[3]["choices"][0]["text"] == streamed
    for prompt, result in zip(prompts, results, strict=True):
        assert result["object"] == "text_completion"
        choice = result["choices"][0]
        assert choice["finish_reason"] in ("length", "stop") and choice["text"]
        usage = result["usage"]
        assert usage["prompt_tokens"] == len(engine.model.tokenize(prompt.encode(), True, True))
        assert usage["completion_tokens"] <= 10
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # Read again, a finished request gives the same response and no more text.
    assert requests[3].result() == results[3] and list(requests[3]) == []
    assert all(request.done for request in requests)


def test_chat_messages_answer_as_chat_completions_and_count_the_reused_head(engine: Engine) -> None:
    first = engine.submit([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is rain?"}],
                          max_tokens=8, temperature=0).result()
    assert first["object"] == "chat.completion"
    assert first["choices"][0]["message"]["role"] == "assistant" and first["choices"][0]["message"]["content"]
    second = engine.submit([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is snow?"}],
                           max_tokens=8, temperature=0)
    usage = second.result()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= len(engine.model.tokenize(SYSTEM.encode()))
    assert second.cached_tokens == usage["prompt_tokens_details"]["cached_tokens"]


def test_token_ids_and_the_same_prompt_as_text_answer_alike(engine: Engine) -> None:
    text = "The capital of France is"
    ids = engine.model.tokenize(text.encode(), True, True)
    by_text = engine.submit(text, max_tokens=6, temperature=0).result()["choices"][0]["text"]
    assert engine.submit(ids, max_tokens=6, temperature=0).result()["choices"][0]["text"] == by_text


def test_a_cancelled_request_ends_early_and_its_text_so_far_stands(engine: Engine) -> None:
    request = engine.submit("Count from one to one thousand: one, two,", max_tokens=400, temperature=0)
    pieces = iter(request)
    assert next(pieces)
    request.cancel()
    request.cancel()  # idempotent
    result = request.result(timeout=60)
    assert result["usage"]["completion_tokens"] < 400
    assert request.done


def test_result_with_a_timeout_raises_while_the_generation_runs(engine: Engine) -> None:
    request = engine.submit("Write a long story about a lighthouse:", max_tokens=300, temperature=0)
    with pytest.raises(TimeoutError):
        request.result(timeout=0.01)
    request.cancel()
    started = time.monotonic()
    request.result(timeout=60)
    assert time.monotonic() - started < 60


@pytest.mark.parametrize(("prompt", "options", "message"), [
    (123, {}, "a prompt is a text, token ids or chat messages"),
    ("hello", {"stream": True}, "always streams"),
    ("hello", {"no_such_option": 1}, "no_such_option"),
    ([], {}, "Requested tokens"),
    ([10**9], {}, "vocabulary"),
])
def test_bad_input_is_a_clear_error_before_any_work(engine: Engine, prompt: object, options: dict[str, object],
                                                    message: str) -> None:
    steps = engine.scheduler.stats.steps
    with pytest.raises(ValueError, match=message):
        engine.submit(prompt, **options)  # type: ignore[arg-type]
    assert engine.scheduler.stats.steps == steps


def test_a_closed_engine_takes_no_more_requests() -> None:
    engine = Engine(n_ctx=256, parallel=1)
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit("hello", max_tokens=2)
