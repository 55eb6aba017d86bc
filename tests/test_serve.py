"""``llama-cache serve`` against live servers on loopback, called with the official ``openai`` client.

The main server runs in-process (uvicorn in a thread, 2 contexts of 1024 tokens); the queue-full test
starts a second one with one context and a queue of one; the SIGTERM test runs ``llama-cache serve``
as a subprocess. Answers are compared with ``llama_cache.Llama``'s own at temperature 0.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from llama_cache import Llama, LlamaDiskCache, LlamaRAMCache, default_model_path
from llama_cache.server import ServerConfig
from llama_cache.server.config import DEFAULT_MAX_BODY_BYTES, physical_cores
from llama_cache.testing.redis_server import RedisServer, redis_available
from tests.live_server import LiveServer, free_port

pytestmark = [pytest.mark.model, pytest.mark.slow]

N_CTX = 1024
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    # Flash attention on, here and in the reference: answers are compared bit for bit, and with it off
    # llama.cpp's attention sums depend on where a sequence's cells lie (docs/engine.md).
    live = LiveServer(ServerConfig(n_ctx=N_CTX, parallel=2, max_queue=16, flash_attn=True))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def reference() -> Iterator[Llama]:
    """The library's own Llama, as a user would call it with the server's settings, for expected answers."""
    options = ServerConfig(n_ctx=N_CTX, flash_attn=True).context_options()
    llama = Llama(model_path=str(default_model_path()), verbose=False, cache=LlamaRAMCache(), **options)
    yield llama
    llama.close()


def _wait_for(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------ basics

def test_models_and_health(server: LiveServer) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [server.service.model_name]
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_completion_streamed_and_not_equals_llama(server: LiveServer, reference: Llama) -> None:
    prompt = "The three primary colours are"
    expected = reference.create_completion(prompt, max_tokens=12, temperature=0)["choices"][0]["text"]
    client = server.client()
    whole = client.completions.create(model="anything", prompt=prompt, max_tokens=12, temperature=0)
    assert whole.choices[0].text == expected
    assert whole.usage is not None and whole.usage.completion_tokens <= 12
    chunks = list(client.completions.create(model="x", prompt=prompt, max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected


def test_chat_streamed_and_not(server: LiveServer, reference: Llama) -> None:
    messages = [{"role": "user", "content": "Name a fruit that is yellow."}]
    expected = reference.create_chat_completion(messages, max_tokens=12, temperature=0)["choices"][0]["message"]
    client = server.client()
    reply = client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=12, temperature=0)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected["content"]
    stream = client.chat.completions.create(messages=messages, model="m", max_tokens=12, temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == expected["content"]


def test_multi_turn_conversation_equals_llama_and_is_served_from_the_cache() -> None:
    # A server of its own: each turn continues the conversation's sequence, whose cells are then in
    # position order as a single context's are, so greedy answers equal the library's bit for bit (with
    # other conversations' cells freed and reused in between, the order, and so the floats, may differ).
    # The library's Llama is fresh too, each turn continuing its context as the server's sequence does:
    # one that evaluated other prompts before starts from other cells, whose floats may differ.
    reference = Llama(model_path=str(default_model_path()), verbose=False, **ServerConfig(n_ctx=N_CTX).context_options())
    live = LiveServer(ServerConfig(n_ctx=N_CTX, parallel=2))
    try:
        client = live.client()
        system = {"role": "system", "content": "You are a concise assistant. " * 8}
        questions = ["What is the capital of Italy?", "And of Spain?", "Which of the two is larger?"]
        ours: list[dict[str, Any]] = [system]
        theirs: list[dict[str, Any]] = [system]
        for question in questions:
            ours.append({"role": "user", "content": question})
            theirs.append({"role": "user", "content": question})
            reply = client.chat.completions.create(model="m", messages=ours, max_tokens=16, temperature=0)
            expected = reference.create_chat_completion(theirs, max_tokens=16, temperature=0)
            content = reply.choices[0].message.content
            assert content == expected["choices"][0]["message"]["content"]
            ours.append({"role": "assistant", "content": content})
            theirs.append({"role": "assistant", "content": content})
        after = live.metrics()
        # Turns 2 and 3 extend the conversation: most of their prompts are not evaluated again.
        assert after["llama_cache_prompt_tokens_cached_total"] > after["llama_cache_prompt_tokens_total"] / 3
    finally:
        live.stop()
        reference.close()


def test_eight_concurrent_clients_get_their_own_answers(server: LiveServer) -> None:
    # Batched together, each client must get its own sequence's tokens: each forces a token of its own
    # with a logit bias, so any mix-up between sequences would show.
    tokenizer = server.service.tokenizer
    words = [" apple", " river", " stone", " cloud", " house", " green", " music", " paper"]
    ids = [tokenizer.tokenize(word.encode(), add_bos=False)[0] for word in words]
    assert len(set(ids)) == 8
    client = server.client()

    def ask(index: int) -> str:
        options: dict[str, Any] = {"model": "m", "prompt": f"Client {index} says:", "max_tokens": 8,
                                   "temperature": 0, "logit_bias": {str(ids[index]): 100}}
        if index % 2:
            return "".join(c.choices[0].text for c in client.completions.create(stream=True, **options))
        return client.completions.create(**options).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    expected = [tokenizer.detokenize([token] * 8).decode() for token in ids]
    assert answers == expected


# --------------------------------------------------------------------------------------- bad input

_LONG = "word " * (N_CTX + 50)
_BAD_REQUESTS = [
    ("/v1/chat/completions", b"{not json", "invalid_json", None),
    ("/v1/completions", b"[1, 2]", "invalid_json", None),
    ("/v1/chat/completions", {"messages": "hello"}, "invalid_type", "messages"),
    ("/v1/chat/completions", {"messages": []}, "invalid_value", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "invalid_value", "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "invalid_type", "messages[0].content"),
    ("/v1/chat/completions", {"model": "m"}, "missing", "messages"),
    ("/v1/completions", {"prompt": 3}, "invalid_type", "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, "invalid_type", "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, "invalid_value", "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, "invalid_type", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -5}, "invalid_value", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**12}, "invalid_value", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2.5}, "invalid_type", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "invalid_type", "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": 7}, "invalid_value", "temperature"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "invalid_type", "stream"),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, "invalid_type", "stop"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "invalid_value", "n"),
    ("/v1/completions", {"prompt": "x", "n": 9}, "invalid_value", "n"),
    ("/v1/completions", {"prompt": "x", "n": "2"}, "invalid_type", "n"),
    ("/v1/completions", {"prompt": _LONG}, "context_length_exceeded", "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": _LONG}]}, "context_length_exceeded",
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": _LONG}], "stream": True},
     "context_length_exceeded", "messages"),
    # Log probabilities: 0-20 of them, for generated tokens only.
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "invalid_value", "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, "invalid_value", "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": 2, "echo": True}, "unsupported_parameter", "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": "all"}, "invalid_type", "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "invalid_value", "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "invalid_value", "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"},
     "invalid_type", "logprobs"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "invalid_value",
     "stream_options"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, "invalid_type",
     "stream_options.include_usage"),
]


@pytest.mark.parametrize(("path", "body", "code", "param"), _BAD_REQUESTS,
                         ids=[f"{p.rsplit('/', 1)[1]}-{c}-{q}" for p, _, c, q in _BAD_REQUESTS])


def test_bad_input_is_a_400_with_an_openai_error_body(
    server: LiveServer, path: str, body: Any, code: str, param: str | None
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["param"], error["type"]) == (code, param, "invalid_request_error")
    assert error["message"]


def test_the_openai_client_sees_bad_input_as_bad_request(server: LiveServer) -> None:
    client = server.client(max_retries=0)
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": _LONG}], max_tokens=4)
    assert raised.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt="x", max_tokens=-1)
    # Nothing is left hung: the server still answers.
    assert client.completions.create(model="m", prompt="Hello", max_tokens=2, temperature=0).choices


def test_prompt_log_probabilities_are_refused_and_absent_log_probabilities_are_none(server: LiveServer) -> None:
    client = server.client(max_retries=0)
    messages = [{"role": "user", "content": "Name a colour."}]
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="m", prompt="Hello", max_tokens=2, logprobs=1, echo=True)
    assert raised.value.code == "unsupported_parameter" and "not supported" in raised.value.message
    reply = client.chat.completions.create(model="m", messages=messages, max_tokens=4, logprobs=False)
    assert reply.choices[0].message.content is not None and reply.choices[0].logprobs is None


# ------------------------------------------------------------------------------------ big requests

def test_a_body_over_the_limit_is_a_413_whether_declared_or_streamed(server: LiveServer) -> None:
    request = json.dumps({"prompt": "Hello", "max_tokens": 1}).encode()
    # Valid JSON whatever its length (trailing whitespace): only the limit can refuse it.
    at_limit = request + b" " * (DEFAULT_MAX_BODY_BYTES - len(request))
    over = at_limit + b" "
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.post("/v1/completions", content=at_limit, headers=headers).status_code == 200

        def chunks() -> Iterator[bytes]:  # no Content-Length: sent chunked
            for start in range(0, len(over), 1 << 16):
                yield over[start : start + (1 << 16)]

        for content in (over, chunks()):
            response = http.post("/v1/completions", content=content, headers=headers)
            assert response.status_code == 413
            error = response.json()["error"]
            assert (error["code"], error["type"]) == ("request_too_large", "invalid_request_error")
            assert str(DEFAULT_MAX_BODY_BYTES) in error["message"]
    with pytest.raises(openai.APIStatusError) as raised:
        server.client(max_retries=0).completions.create(model="m", prompt="x" * DEFAULT_MAX_BODY_BYTES, max_tokens=1)
    assert raised.value.status_code == 413
    assert server.client().completions.create(model="m", prompt="Hi", max_tokens=2, temperature=0).choices


def test_a_prompt_being_tokenized_does_not_hold_up_other_requests(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = server.service.tokenizer  # the one the app tokenizes prompts with
    entered, release = threading.Event(), threading.Event()
    tokenize = tokenizer.tokenize_for

    def slow_tokenize(fingerprint: str, text: bytes, *args: Any, **kwargs: Any) -> list[int]:
        if b"slow to tokenize" in text:  # stands in for a huge prompt
            entered.set()
            release.wait(timeout=60)
        return tokenize(fingerprint, text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "tokenize_for", slow_tokenize)
    answers: list[int] = []

    def post(path: str, body: dict[str, Any]) -> None:
        answers.append(httpx.post(server.url + path, json=body, timeout=120).status_code)

    for path, body in (("/v1/completions", {"prompt": "slow to tokenize", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "slow to tokenize"}],
                                                 "max_tokens": 2})):
        entered.clear()
        release.clear()
        slow = threading.Thread(target=post, args=(path, body))
        slow.start()
        try:
            assert entered.wait(timeout=60)
            # The event loop is free: other requests are answered while that prompt is tokenized.
            assert httpx.get(server.url + "/health", timeout=30).status_code == 200
            fast = server.client(max_retries=0, timeout=60).completions.create(model="m", prompt="Hi", max_tokens=1)
            assert fast.choices
        finally:
            release.set()
            slow.join(timeout=120)
    assert answers == [200, 200]


def test_a_streamed_answers_next_turn_continues_its_sequence(server: LiveServer) -> None:
    tokenizer = server.service.tokenizer
    prompt = tokenizer.tokenize(f"A stream {time.monotonic_ns()} about rivers:".encode())
    before = server.metrics()
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        assert [line for line in response.iter_lines() if line.startswith("data:")][-1] == "data: [DONE]"
    # One token asked for: it is never evaluated, so the sequence holds exactly the prompt.
    more = prompt + tokenizer.tokenize(b" The longest river is", add_bos=False)
    reply = server.client().completions.create(model="m", prompt=more, max_tokens=2, temperature=0)
    assert reply.usage.prompt_tokens_details.cached_tokens == len(prompt)  # only its own tokens evaluated
    after = server.metrics()
    status = 'llama_cache_requests_total{endpoint="/v1/completions",status="%s"}'
    assert after[status % 200] - before.get(status % 200, 0) == 2


def test_another_conversation_on_the_same_head_shares_its_cells(server: LiveServer) -> None:
    tokenizer = server.service.tokenizer
    # A system prompt no other test sends: only the first conversation's sequence holds it.
    head = tokenizer.tokenize(f"Rules {time.monotonic_ns()}: ".encode() + b"answer briefly and politely. " * 8)
    first = head + tokenizer.tokenize(b" Question one: what is a river?", add_bos=False)
    second = head + tokenizer.tokenize(b" Question two: what is a lake?", add_bos=False)
    client = server.client()
    before = server.metrics()
    assert client.completions.create(model="m", prompt=first, max_tokens=2, temperature=0).choices
    reply = client.completions.create(model="m", prompt=second, max_tokens=2, temperature=0)
    assert reply.usage.prompt_tokens_details.cached_tokens >= len(head)  # evaluated only its own question
    after = server.metrics()
    shared = after["llama_cache_engine_shared_tokens_total"] - before["llama_cache_engine_shared_tokens_total"]
    assert shared >= len(head)  # taken from the first conversation's cells, not restored from a tier


# ------------------------------------------------------------------------------------ cancellation

def test_a_client_that_disconnects_mid_stream_stops_its_generation(server: LiveServer) -> None:
    before = server.metrics()
    body = {"prompt": "Count from 1 to 1000: 1, 2, 3, 4,", "max_tokens": 600, "stream": True,
            "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        received = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
    assert received

    def settled() -> bool:
        now = server.metrics()
        return (now["llama_cache_requests_running"] == 0
                and now.get('llama_cache_requests_total{endpoint="/v1/completions",status="499"}', 0)
                > before.get('llama_cache_requests_total{endpoint="/v1/completions",status="499"}', 0))

    _wait_for(settled)
    after = server.metrics()
    generated = after["llama_cache_generation_tokens_total"] - before["llama_cache_generation_tokens_total"]
    assert generated < 300  # stopped long before max_tokens
    # The context is free and consistent: it serves the next request.
    assert server.client().completions.create(model="m", prompt="Hi", max_tokens=2, temperature=0).choices


def test_the_engine_counts_every_token_it_evaluates(server: LiveServer) -> None:
    stats = server.service.engine.scheduler.stats
    tokens_before, before = stats.tokens, server.metrics()
    prompt = f"Note {time.monotonic_ns()}: the three primary colours are"  # asked by no other test
    reply = server.client().completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0)
    after = server.metrics()
    evaluated_prompt = (after["llama_cache_prompt_tokens_total"] - before["llama_cache_prompt_tokens_total"]
                        - (after["llama_cache_prompt_tokens_cached_total"]
                           - before["llama_cache_prompt_tokens_cached_total"]))
    assert evaluated_prompt > 0
    # The prompt's new tokens, then each sampled token but the last of a completion cut at max_tokens
    # (it stops before evaluating it); an end-of-generation token is neither counted nor evaluated.
    generated = reply.usage.completion_tokens - (1 if reply.choices[0].finish_reason == "length" else 0)
    assert stats.tokens - tokens_before == evaluated_prompt + generated
    assert after["llama_cache_evaluated_tokens_total"] == stats.tokens  # as /metrics reports it
    assert after["llama_cache_evaluations_waiting"] == 0
    assert 0 < after["llama_cache_kv_cells_in_use"] <= after["llama_cache_kv_cells"]
    # The step budget's measurements: a prompt was read and tokens generated alone, so both are known.
    assert after["llama_cache_engine_decode_step_seconds"] > 0 and after["llama_cache_engine_prompt_row_seconds"] > 0
    assert 8 <= after["llama_cache_engine_prompt_rows_while_generating"] <= 128
    # Steps' seconds, and of those llama_decode's: both grew, the decodes within the steps.
    step = after["llama_cache_engine_step_seconds_total"] - before["llama_cache_engine_step_seconds_total"]
    decode = after["llama_cache_engine_decode_seconds_total"] - before["llama_cache_engine_decode_seconds_total"]
    assert 0 < decode < step


def test_a_client_that_disconnects_while_its_prompt_is_read_stops_it_at_the_next_chunk(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = server.service.engine
    batch = engine.context.n_batch
    words = " ".join(["river", "stone", "garden", "window"] * 200)  # over one batch of tokens, under N_CTX
    prompt_tokens = len(server.service.tokenizer.tokenize(words.encode()))
    assert batch < prompt_tokens < N_CTX - 8
    # The prompt's first chunk, once evaluated, waits until the server has seen the client leave.
    reading, left = threading.Event(), threading.Event()
    chunks: list[int] = []
    decode = engine.context.decode
    jobs = server.app.state.server.jobs

    def held_decode(rows: int) -> None:
        decode(rows)
        if rows > 1:
            chunks.append(rows)
            if len(chunks) == 1:
                reading.set()
                assert left.wait(timeout=30)
                _wait_for(lambda: all(job.cancel.is_set() for job in list(jobs)))

    monkeypatch.setattr(engine.context, "decode", held_decode)
    before, tokens_before = server.metrics(), engine.scheduler.stats.tokens
    status = 'llama_cache_requests_total{endpoint="/v1/completions",status="499"}'
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                      json={"prompt": words, "max_tokens": 4, "stream": True}) as response:
        assert response.status_code == 200
        assert reading.wait(timeout=30)  # the first chunk is evaluated; leave
    left.set()
    _wait_for(lambda: server.metrics().get(status, 0) > before.get(status, 0)
              and server.metrics()["llama_cache_requests_running"] == 0)
    assert len(chunks) == 1 and 0 < chunks[0] <= batch  # one chunk, not the whole prompt
    assert engine.scheduler.stats.tokens - tokens_before == chunks[0]
    # Its sequence holds that chunk consistently: the next request is answered as usual.
    assert server.client().completions.create(model="m", prompt=words[:200], max_tokens=2, temperature=0).choices


def test_a_full_queue_answers_503_with_retry_after() -> None:
    live = LiveServer(ServerConfig(n_ctx=N_CTX, parallel=1, max_queue=1))
    try:
        body = {"prompt": "Count from 1 to 1000: 1, 2, 3, 4,", "max_tokens": 600, "stream": True, "temperature": 0}
        first = httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60)
        response = first.__enter__()
        lines = response.iter_lines()  # kept referenced: a collected iterator would close the stream
        assert next(lines).startswith("data:")
        waiting = threading.Thread(
            target=lambda: httpx.post(live.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1}, timeout=60))
        waiting.start()
        _wait_for(lambda: live.metrics()["llama_cache_queue_depth"] == 1)
        refused = httpx.post(live.url + "/v1/completions", json={"prompt": "b", "max_tokens": 1})
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "queue_full"
        with pytest.raises(openai.APIStatusError) as raised:
            live.client(max_retries=0).completions.create(model="m", prompt="c", max_tokens=1)
        assert raised.value.status_code == 503
        first.__exit__(None, None, None)  # disconnect: the running request stops, the queued one runs
        waiting.join(timeout=60)
        assert not waiting.is_alive()
        assert live.metrics()['llama_cache_requests_total{endpoint="/v1/completions",status="503"}'] == 2
    finally:
        live.stop()


# ------------------------------------------------------------------------------------------ metrics

def test_metrics_parse_and_show_the_hits_a_request_caused(server: LiveServer) -> None:
    client = server.client()
    prompt = "A cache hit is counted when this exact prompt is asked again. " * 4
    client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0)
    before = server.metrics()
    client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0)
    after = server.metrics()
    requested = after["llama_cache_prompt_tokens_total"] - before["llama_cache_prompt_tokens_total"]
    cached = after["llama_cache_prompt_tokens_cached_total"] - before["llama_cache_prompt_tokens_cached_total"]
    assert requested > 40 and cached >= requested - 1
    # The RAM tier as it stands (states reach it when sequences are evicted: other tests' doing).
    ram = server.service.cache
    assert after['llama_cache_cache_entries{tier="ram"}'] == len(ram)
    assert after['llama_cache_cache_bytes{tier="ram"}'] == ram.cache_size
    for name in ('llama_cache_cache_misses_total{tier="ram"}', 'llama_cache_cache_evictions_total{tier="ram"}',
                 "llama_cache_queue_depth", "llama_cache_requests_running", "llama_cache_generation_tokens_total",
                 'llama_cache_time_to_first_token_seconds_count{endpoint="/v1/completions"}'):
        assert name in after
    assert after['llama_cache_requests_total{endpoint="/v1/completions",status="200"}'] >= 2
    # A registry per app: the global registry holds none of these.
    from prometheus_client import REGISTRY
    assert REGISTRY.get_sample_value("llama_cache_prompt_tokens_total") is None


# ------------------------------------------------------------------------------------------ SIGTERM

def test_sigterm_finishes_the_running_request_flushes_the_disk_cache_and_exits(tmp_path: Path) -> None:
    port = free_port()
    cache_dir = tmp_path / "cache"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "llama_cache.cli", "serve", "--port", str(port), "--n-ctx", str(N_CTX),
             "--parallel", "1", "--cache-dir", str(cache_dir), "--shutdown-timeout", "60"],
            env=env, stdout=sink, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            assert process.poll() is None, log.read_text()
            try:
                return httpx.get(url + "/health").status_code == 200
            except httpx.TransportError:
                return False

        _wait_for(up, timeout=60)
        body = {"prompt": "Once upon a time, in a land far away,", "max_tokens": 48, "stream": True,
                "temperature": 0}
        events: list[str] = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                if not events:
                    process.send_signal(signal.SIGTERM)
                events.append(line)
        assert events[-1] == "data: [DONE]"  # the running request was finished, not cut
        finished = json.loads(events[-2].removeprefix("data: "))
        assert finished["choices"][0]["finish_reason"] in ("length", "stop")
        assert process.wait(timeout=60) == 0  # a drain is a clean exit, not a death by SIGTERM
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = log.read_text()
    assert "Traceback" not in output
    assert "Finished server process" in output
    cache = LlamaDiskCache(cache_dir)
    try:
        assert len(cache) >= 1  # the write-behind queue was flushed before exit
    finally:
        cache.close()


# ------------------------------------------------------------------------------ routing and settings

def test_the_tokenization_memo_keeps_the_latest_texts_and_their_exact_tokens() -> None:
    from llama_cache.server.prompts import TokenizationMemo

    memo = TokenizationMemo(capacity_bytes=8)  # room for one one-byte text of one token (1 + 4 bytes)
    memo.put(("ns", b"a", True, False), [1])
    memo.put(("ns", b"b", True, False), [3])  # 10 bytes in all: "a" goes
    assert memo.get(("ns", b"a", True, False)) is None and memo.get(("ns", b"b", True, False)) == [3]
    memo = TokenizationMemo(capacity_bytes=16)
    memo.put(("ns", b"a", True, False), [1, 2])  # 9 bytes
    memo.put(("ns", b"b", True, False), [3])  # 5 bytes
    assert memo.get(("ns", b"a", True, False)) == [1, 2]  # now the most recently used
    assert memo.get(("ns", b"a", False, False)) is None and memo.get(("ns", b"a", True, True)) is None
    memo.put(("ns", b"c", True, False), [4])
    assert memo.get(("ns", b"b", True, False)) is None  # the least recently used went
    assert memo.get(("ns", b"a", True, False)) == [1, 2] and memo.get(("ns", b"c", True, False)) == [4]
    assert memo.get(("other", b"a", True, False)) is None  # another namespace's tokenization is not found
    with pytest.raises(ValueError):
        TokenizationMemo(capacity_bytes=0)


def test_requests_share_tokenizations_and_get_the_tokens_llama_cpp_does(
    server: LiveServer, reference: Llama
) -> None:
    tokenizer = server.service.tokenizer
    assert tokenizer.memo is not None
    fingerprint = server.service.model_fingerprint
    text = f"<|im_start|>user\nName {time.monotonic_ns()} colours.<|im_end|>\n".encode()
    for add_bos, special in ((True, True), (False, True), (True, False)):
        expected = reference.tokenize(text, add_bos=add_bos, special=special)
        assert tokenizer.tokenize_for(fingerprint, text, add_bos=add_bos, special=special) == expected
        assert tokenizer.memo.get((fingerprint, text, add_bos, special)) == expected
        assert tokenizer.memo.get(("another namespace", text, add_bos, special)) is None
        again = tokenizer.tokenize_for(fingerprint, text, add_bos=add_bos, special=special)  # the memo's answer
        assert again == expected
        again.append(0)  # a caller's list is its own
        assert tokenizer.tokenize_for(fingerprint, text, add_bos=add_bos, special=special) == expected


def test_settings_come_from_options_then_environment_then_defaults() -> None:
    import argparse

    from llama_cache.server.config import add_serve_command, config_from_args

    parser = argparse.ArgumentParser()
    add_serve_command(parser.add_subparsers(), [])
    args = parser.parse_args(["serve", "--port", "9000"])
    config = config_from_args(args, {"LLAMA_CACHE_PORT": "1", "LLAMA_CACHE_PARALLEL": "3",
                                     "LLAMA_CACHE_CACHE_DIR": "/tmp/x"})
    assert (config.port, config.parallel, config.cache_dir, config.n_ctx) == (9000, 3, Path("/tmp/x"), 4096)
    with pytest.raises(ValueError, match="LLAMA_CACHE_N_CTX"):
        config_from_args(args, {"LLAMA_CACHE_N_CTX": "many"})
    with pytest.raises(ValueError, match="parallel"):
        config_from_args(parser.parse_args(["serve", "--parallel", "0"]), {})


# ------------------------------------------------------------------------------------ tiered caches

@pytest.mark.skipif(not redis_available(), reason="redis-server is not installed")
def test_two_servers_share_prompt_states_through_disk_and_redis(tmp_path: Path) -> None:
    """Two servers, each with its own RAM tier, share one Redis; the second hits what the first computed."""
    prompt = "A long shared preamble about the rivers of Europe and their ports. " * 10 + "Name one river:"
    with RedisServer() as redis_server:
        first = LiveServer(ServerConfig(n_ctx=N_CTX, parallel=1, cache_dir=tmp_path / "one",
                                       redis_url=redis_server.url))
        try:
            assert [name for name, _ in first.service.tiers] == ["ram", "disk", "redis"]
            expected = first.client().completions.create(model="x", prompt=prompt, max_tokens=8, temperature=0)
        finally:
            first.stop()  # drains: the Redis tier is written behind
        second = LiveServer(ServerConfig(n_ctx=N_CTX, parallel=1, cache_dir=tmp_path / "two",
                                        redis_url=redis_server.url))
        try:
            answer = second.client().completions.create(model="x", prompt=prompt, max_tokens=8, temperature=0)
            metrics = second.metrics()
        finally:
            second.stop()
    assert answer.choices[0].text == expected.choices[0].text
    assert metrics['llama_cache_cache_hits_total{tier="redis"}'] >= 1
    assert metrics["llama_cache_prompt_tokens_cached_total"] >= answer.usage.prompt_tokens - 2


def test_physical_cores_counts_sibling_sets_among_the_cpus_it_may_use(tmp_path: Path) -> None:
    # A host of 2 cores with 2 hyperthreads each: CPUs 0 and 2 are one core, 1 and 3 the other.
    for cpu, mask in ((0, "5"), (1, "a"), (2, "5"), (3, "a")):
        folder = tmp_path / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        (folder / "thread_siblings").write_text(mask + "\n")
    assert physical_cores({0, 2}, tmp_path) == 1  # a cpuset of one core's two siblings
    assert physical_cores({0, 1}, tmp_path) == physical_cores({0, 1, 2, 3}, tmp_path) == 2
    assert physical_cores({3}, tmp_path) == 1
    assert physical_cores({0, 1, 2}, tmp_path / "absent") == 3  # no topology: every CPU counts


def test_threads_flash_attention_and_body_limit_settings() -> None:
    import argparse

    from llama_cache.server.config import add_serve_command, config_from_args

    parser = argparse.ArgumentParser()
    add_serve_command(parser.add_subparsers(), [])
    default = config_from_args(parser.parse_args(["serve"]), {})
    # Counted independently: distinct (package, core) ids of the CPUs this process may use.
    topology = Path("/sys/devices/system/cpu")
    cores = {
        (topology.joinpath(f"cpu{cpu}/topology/physical_package_id").read_text(),
         topology.joinpath(f"cpu{cpu}/topology/core_id").read_text())
        for cpu in os.sched_getaffinity(0)
    }
    assert physical_cores() == len(cores)
    options = default.context_options()
    # llama-server's defaults: a thread per physical core for prompts and generation alike, flash attention.
    assert (options["n_threads"], options["n_threads_batch"]) == (physical_cores(), physical_cores())
    # Flash attention auto: on (a request's rows skip the other conversations' cells in the pool).
    assert default.flash_attn is None and default.max_body_bytes == DEFAULT_MAX_BODY_BYTES == 8 << 20
    assert options["flash_attn"] is True
    assert config_from_args(parser.parse_args(["serve", "--flash-attn", "off"]), {}).context_options()["flash_attn"] is False
    assert config_from_args(parser.parse_args(["serve", "--deterministic"]), {}).context_options()["flash_attn"] is True
    with pytest.raises(ValueError, match="deterministic mode needs flash attention"):
        config_from_args(parser.parse_args(["serve", "--deterministic", "--flash-attn", "off"]), {})
    for argv, environ, expected in ((["serve", "--flash-attn", "on"], {}, True),
                                    (["serve", "--flash-attn", "auto"], {"LLAMA_CACHE_FLASH_ATTN": "on"}, None),
                                    (["serve"], {"LLAMA_CACHE_FLASH_ATTN": "AUTO"}, None),
                                    (["serve"], {"LLAMA_CACHE_FLASH_ATTN": "on"}, True)):
        assert config_from_args(parser.parse_args(argv), environ).flash_attn is expected
    with pytest.raises(ValueError, match="flash_attn must be True, False or None"):
        ServerConfig(flash_attn="auto")  # type: ignore[arg-type]
    for argv, environ in ((["serve", "--threads", "3"], {}), (["serve", "--n-threads", "3"], {}),
                          (["serve"], {"LLAMA_CACHE_THREADS": "3"})):
        options = config_from_args(parser.parse_args(argv), environ).context_options()
        assert (options["n_threads"], options["n_threads_batch"]) == (3, 3)
    config = config_from_args(parser.parse_args(["serve", "--flash-attn", "off", "--max-body-bytes", "1024"]), {})
    assert (config.flash_attn, config.max_body_bytes) == (False, 1024)
    assert config_from_args(parser.parse_args(["serve"]), {"LLAMA_CACHE_FLASH_ATTN": "off"}).flash_attn is False
    with pytest.raises(ValueError, match="LLAMA_CACHE_FLASH_ATTN must be auto, on or off"):
        config_from_args(parser.parse_args(["serve"]), {"LLAMA_CACHE_FLASH_ATTN": "maybe"})
    with pytest.raises(SystemExit):  # argparse: "invalid on_off value"
        parser.parse_args(["serve", "--flash-attn", "maybe"])
    with pytest.raises(ValueError, match="max_body_bytes"):
        config_from_args(parser.parse_args(["serve", "--max-body-bytes", "0"]), {})


def test_the_context_runs_with_the_configured_threads_flash_attention_and_a_unified_pool(server: LiveServer) -> None:
    import llama_cpp

    params = server.service.engine.context.params
    assert (params.n_threads, params.n_threads_batch) == (physical_cores(), physical_cores())
    # A batch as large as a step can fill: a generated token per sequence and 64 prompt rows.
    assert params.n_batch == params.n_ubatch == min(512, params.n_seq_max + 64)
    assert server.service.engine.flash_attn is True  # as the fixture asks
    assert params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    assert ServerConfig(n_ctx=N_CTX).context_options()["flash_attn"] is True  # auto: on
    assert params.kv_unified and params.n_ctx == N_CTX and params.n_seq_max >= 2


def test_deterministic_serving_answers_concurrent_requests_as_each_alone() -> None:
    import argparse

    from llama_cache.server.config import add_serve_command, config_from_args

    parser = argparse.ArgumentParser()
    add_serve_command(parser.add_subparsers(), [])
    assert config_from_args(parser.parse_args(["serve", "--deterministic"]), {}).deterministic is True
    assert config_from_args(parser.parse_args(["serve"]), {"LLAMA_CACHE_DETERMINISTIC": "on"}).deterministic is True
    assert config_from_args(parser.parse_args(["serve"]), {}).deterministic is False
    questions = ["What is rain?", "Name a red fruit.", "What is a river?", "Why do birds sing?"]

    def ask(live: LiveServer, question: str) -> str:
        reply = live.client().chat.completions.create(
            model="m", messages=[{"role": "system", "content": "Answer briefly."},
                                 {"role": "user", "content": question}], max_tokens=16, temperature=0)
        return reply.choices[0].message.content or ""

    answers = []
    for together in (True, False):  # each on a fresh server: no request repeats one it served
        live = LiveServer(ServerConfig(n_ctx=4 * 512, parallel=4, deterministic=True))
        try:
            params = live.service.engine.context.params
            assert not params.kv_unified and live.service.n_ctx == 511  # a stream of its own per request
            if together:
                with concurrent.futures.ThreadPoolExecutor(4) as pool:
                    answers.append(list(pool.map(lambda q, s=live: ask(s, q), questions)))
            else:
                answers.append([ask(live, question) for question in questions])
        finally:
            live.stop()
    assert answers[0] == answers[1] and all(answers[0])


def test_a_damaged_disk_index_is_moved_aside_and_counted_the_server_starts(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    LlamaDiskCache(cache_dir).close()
    index = next(path for path in cache_dir.iterdir() if path.name.startswith("index") and path.suffix == ".sqlite3")
    index.write_bytes(b"garbage, not SQLite" * 100)
    live = LiveServer(ServerConfig(n_ctx=N_CTX, parallel=1, cache_dir=cache_dir))
    try:
        assert live.client().completions.create(model="m", prompt="Hi", max_tokens=2).choices
        assert live.metrics()['llama_cache_cache_index_resets_total{tier="disk"}'] == 1
    finally:
        live.stop()
    assert any(path.name.startswith(index.name + ".damaged-") for path in cache_dir.iterdir())
