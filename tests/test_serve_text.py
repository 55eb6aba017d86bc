"""What ``llama-cache serve`` answers with: every token's text, ``echo``, the utility endpoints, no 5xx.

One in-process server on the real model (two contexts of 1,024 tokens).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from llama_cache.server import ServerConfig
from tests.live_server import LiveServer

N_CTX = 1024
LONG_TEXT = "def f():\n" + " " * 48 + "return 1\n" + "-" * 64 + "\n"


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    live = LiveServer(ServerConfig(n_ctx=N_CTX, parallel=2, max_queue=4))
    yield live
    live.stop()


def _post(server: LiveServer, path: str, body: Any, timeout: float = 300) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=timeout)


def _stream(server: LiveServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def _dashes(server: LiveServer) -> int:
    tokens = _post(server, "/tokenize", {"content": "-" * 64}).json()["tokens"]
    assert len(tokens) == 1
    return int(tokens[0])


# -- every token's text ------------------------------------------------------------------------

def test_long_tokens_keep_their_text_in_tokenize_and_detokenize(server: LiveServer) -> None:
    tokens = _post(server, "/tokenize", {"content": LONG_TEXT}).json()["tokens"]
    assert _post(server, "/detokenize", {"tokens": tokens}).json()["content"] == LONG_TEXT
    pieces = _post(server, "/tokenize", {"content": LONG_TEXT, "with_pieces": True}).json()["tokens"]
    assert "".join(piece["piece"] for piece in pieces) == LONG_TEXT
    assert {"id": _dashes(server), "piece": "-" * 64} in pieces


def test_generated_long_tokens_keep_their_text_whole_streamed_and_in_logprobs(server: LiveServer) -> None:
    dashes = _dashes(server)
    body = {"max_tokens": 3, "temperature": 0, "logit_bias": {str(dashes): 100}}
    completion = _post(server, "/v1/completions", {"prompt": "A rule:", **body, "logprobs": 1}).json()["choices"][0]
    assert completion["text"] == "-" * 192
    assert completion["logprobs"]["tokens"] == ["-" * 64] * 3
    assert completion["logprobs"]["text_offset"][1] - completion["logprobs"]["text_offset"][0] == 64
    chunks = _stream(server, "/v1/completions", {"prompt": "A rule:", **body})
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks if chunk["choices"]) == "-" * 192
    messages = [{"role": "user", "content": "Draw a line."}]
    chat = _post(server, "/v1/chat/completions", {"messages": messages, **body, "logprobs": True}).json()
    choice = chat["choices"][0]
    assert choice["message"]["content"] == "-" * 192
    assert [entry["token"] for entry in choice["logprobs"]["content"]] == ["-" * 64] * 3
    assert choice["logprobs"]["content"][0]["bytes"] == list(b"-" * 64)
    chunks = _stream(server, "/v1/chat/completions", {"messages": messages, **body})
    text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks if chunk["choices"])
    assert text == "-" * 192


def test_a_stop_sequence_inside_long_tokens_is_found(server: LiveServer) -> None:
    body = {"prompt": "A rule:", "max_tokens": 3, "temperature": 0, "logit_bias": {str(_dashes(server)): 100},
            "stop": ["-" * 100]}
    assert _post(server, "/v1/completions", body).json()["choices"][0]["text"] == ""  # the stop starts at once


# -- echo ------------------------------------------------------------------------------------

def test_echo_starts_the_text_with_the_prompt_whole_and_streamed(server: LiveServer) -> None:
    tokens = _post(server, "/tokenize", {"content": LONG_TEXT}).json()["tokens"]
    for prompt, expected in (("Once upon a time", "Once upon a time"), (tokens, LONG_TEXT)):
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True, "n": 2}
        answer = _post(server, "/v1/completions", body)
        assert answer.status_code == 200, answer.text
        plain = _post(server, "/v1/completions", {**body, "echo": False}).json()["choices"][0]["text"]
        for choice in answer.json()["choices"]:
            assert choice["text"] == expected + plain
        chunks = _stream(server, "/v1/completions", body)
        for index in (0, 1):
            texts = [chunk["choices"][0]["text"] for chunk in chunks
                     if chunk["choices"] and chunk["choices"][0]["index"] == index]
            assert texts[0].startswith(expected) and "".join(texts) == expected + plain


# -- no 5xx from input -----------------------------------------------------------------------

def test_a_logit_bias_key_of_thousands_of_digits_is_a_counted_400(server: LiveServer) -> None:
    key = 'llama_cache_requests_total{endpoint="/v1/completions",status="400"}'
    before = server.metrics().get(key, 0)
    for bias in ({"1" * 5000: 1}, {"0" * 4400: 1}, {"9" * 50: 1}):
        response = _post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "logit_bias": bias})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "logit_bias"
    assert server.metrics()[key] == before + 3


def test_a_pattern_bound_of_thousands_of_digits_is_a_400(server: LiveServer) -> None:
    schema = {"type": "string", "pattern": "^a{" + "9" * 5000 + "}$"}
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    response = _post(server, "/v1/chat/completions", body)
    assert response.status_code == 400 and response.json()["error"]["code"] == "limit_exceeded"


def test_an_error_no_route_answered_is_a_counted_json_500(server: LiveServer, monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(server.service.tokenizer.detokenizer, "detokenize", broken)
    response = _post(server, "/detokenize", {"tokens": [1, 2]})
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error" and "a bug" not in response.text
    assert server.metrics()['llama_cache_requests_total{endpoint="/detokenize",status="500"}'] >= 1


# -- bounded utility endpoints ---------------------------------------------------------------

def test_detokenize_is_bounded_by_the_context_and_answers_a_whole_one(server: LiveServer) -> None:
    response = _post(server, "/detokenize", {"tokens": [1] * 500_000}, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tokens"
    tokens = _post(server, "/tokenize", {"content": "-" * 64 * N_CTX}).json()["tokens"]
    assert len(tokens) == N_CTX
    assert _post(server, "/detokenize", {"tokens": tokens}).json()["content"] == "-" * 64 * N_CTX


def test_utility_requests_wait_on_a_lane_of_their_own_with_a_bounded_backlog(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    detokenizer = server.service.tokenizer.detokenizer
    entered, release = threading.Event(), threading.Event()
    detokenize = detokenizer.detokenize

    def slow(tokens: Any, special: bool = False) -> bytes:
        entered.set()
        release.wait(timeout=120)
        return detokenize(tokens, special)

    monkeypatch.setattr(detokenizer, "detokenize", slow)
    statuses: list[int] = []
    posters = [threading.Thread(target=lambda: statuses.append(_post(server, "/detokenize", {"tokens": [1]}).status_code))
               for _ in range(1 + 4)]  # one running, the backlog (max_queue) full
    try:
        posters[0].start()
        assert entered.wait(timeout=60)
        for poster in posters[1:]:
            poster.start()
        deadline = threading.Event()
        while server.app.state.server.utilities.admitted < 5 and not deadline.wait(0.05):
            pass
        # One more is refused at once, and completions are served meanwhile.
        refused = _post(server, "/detokenize", {"tokens": [1]}, timeout=60)
        assert refused.status_code == 503 and refused.headers["retry-after"]
        answer = _post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, timeout=120)
        assert answer.status_code == 200
    finally:
        release.set()
        for poster in posters:
            if poster.is_alive() or poster.ident is not None:
                poster.join(timeout=120)
    assert statuses == [200] * 5


def test_the_utility_lane_runs_at_the_lowest_cpu_priority(server: LiveServer) -> None:
    import os
    import threading

    lane = server.app.state.server.utilities
    nice = asyncio.run(lane.run(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    assert nice == 19
