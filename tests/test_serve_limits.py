"""``llama-cache serve`` bounds every request's work before it starts, and refuses bad input with a 4xx.

Each hostile request here once crashed the server, stalled it, pinned its memory, answered 500 or gave a
wrong answer; now each is a 400 naming its field (or the limit), and the server keeps serving. The
drain tests stop a live server while it holds a running stream, a running completion and a queued
request: each gets an answer a client can read, never uvicorn's plain-text 500 or a cut stream.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from llama_cache import default_model_path
from llama_cache.server import ServerConfig
from llama_cache.engine.model import Model
from llama_cache.server.prompts import (
    PromptTooLong,
    RenderingCancelled,
    ServedTokenizer,
    TokenizationMemo,
    prompt_tokens_for_chat,
)
from llama_cache.server.limits import PromptTextBound, RequestLimits, check_schema
from llama_cache.server.errors import ApiError
from tests.live_server import LiveServer, rss_bytes

N_CTX = 512
_USER = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    live = LiveServer(ServerConfig(n_ctx=N_CTX, parallel=1, max_queue=8, max_messages=64))
    yield live
    live.stop()


def _post(server: LiveServer, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"},
                      timeout=120, **kwargs)


def _schema_tool(schema: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "pick", "parameters": schema}}


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


_CHAT = "/v1/chat/completions"
_COMPLETIONS = "/v1/completions"
_REFUSED: list[tuple[str, Any, str, str | None]] = [
    # Integer literals Python's JSON parser refuses (more than 4,300 digits), or past 64 bits.
    (_COMPLETIONS, b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", "invalid_json", None),
    (_COMPLETIONS, b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "invalid_json", None),
    (_COMPLETIONS, {"prompt": "x", "seed": 1 << 70}, "invalid_value", "seed"),
    # Lone surrogates have no UTF-8 form.
    (_COMPLETIONS, b'{"prompt": "abc\\ud800"}', "invalid_value", "prompt"),
    (_COMPLETIONS, b'{"prompt": "abc", "model": "m\\udfff"}', "invalid_value", "model"),
    (_COMPLETIONS, b'{"prompt": "abc", "model": "m\\udfff", "stream": true}', "invalid_value", "model"),
    (_CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "invalid_value", "messages[0].content"),
    # logit_bias keys are token ids of this vocabulary; biases are OpenAI's -100..100.
    (_COMPLETIONS, {"prompt": "x", "logit_bias": {"-5": 1}}, "invalid_value", "logit_bias"),
    (_COMPLETIONS, {"prompt": "x", "logit_bias": {"49152": 1}}, "invalid_value", "logit_bias"),
    (_COMPLETIONS, {"prompt": "x", "logit_bias": {"12": 1000}}, "invalid_value", "logit_bias"),
    (_COMPLETIONS, {"prompt": "x", "logit_bias": {"abc": 1}}, "invalid_value", "logit_bias"),
    (_COMPLETIONS, {"prompt": "x", "logit_bias": [1]}, "invalid_type", "logit_bias"),
    (_COMPLETIONS, {"prompt": "x", "top_k": 1 << 63}, "invalid_value", "top_k"),
    # Message count, text that cannot fit, tools and their schemas.
    (_CHAT, {"messages": _USER * 65}, "limit_exceeded", "messages"),
    (_CHAT, {"messages": [{"role": "user", "content": "a" * ((8 << 20) - 64)}]}, "context_length_exceeded",
     "messages"),
    (_COMPLETIONS, {"prompt": "a" * ((8 << 20) - 64)}, "context_length_exceeded", "prompt"),
    (_COMPLETIONS, {"prompt": [1] * N_CTX}, "context_length_exceeded", "prompt"),
    (_COMPLETIONS, {"prompt": "<|im_end|>" * N_CTX}, "context_length_exceeded", "prompt"),
    (_CHAT, {"messages": [{"role": "user", "content": "<|im_end|>" * N_CTX}]}, "context_length_exceeded",
     "messages"),
    (_CHAT, {"messages": _USER, "tools": [_schema_tool({"type": "object"})] * 129}, "limit_exceeded", "tools"),
    (_CHAT, {"messages": _USER, "tools": [_schema_tool({"type": "string", "maxLength": 100001})]},
     "limit_exceeded", "tools[0].parameters"),
    (_CHAT, {"messages": _USER, "tools": [_schema_tool({"type": "string", "pattern": "^c{1,200000}$"})]},
     "limit_exceeded", "tools[0].parameters"),
    (_CHAT, {"messages": _USER, "tools": [_schema_tool({"enum": list(range(50000))})]},
     "limit_exceeded", "tools[0].parameters"),
    (_CHAT, {"messages": _USER, "tools": [_schema_tool(_nested(40))]}, "limit_exceeded", "tools[0].parameters"),
    (_CHAT, {"messages": _USER, "tools": [_schema_tool({"description": "x" * (65 << 10)})]},
     "limit_exceeded", "tools[0].parameters"),
    (_CHAT, {"messages": _USER, "tools": [_schema_tool([1, 2])]}, "invalid_value", "tools"),
    (_CHAT, {"messages": _USER, "tools": [1, 2]}, "invalid_value", "tools"),
    (_CHAT, {"messages": _USER, "tool_choice": "required"}, "invalid_value", "tool_choice"),
]


@pytest.mark.model
@pytest.mark.parametrize(("path", "body", "code", "param"), _REFUSED,
                         ids=[f"{p.rsplit('/', 1)[1]}-{c}-{q}-{i}" for i, (p, _, c, q) in enumerate(_REFUSED)])
def test_hostile_input_is_a_400_naming_its_field(
    server: LiveServer, path: str, body: Any, code: str, param: str | None
) -> None:
    response = _post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == (code, param, "invalid_request_error")
    assert error["message"]


@pytest.mark.model
def test_after_every_refusal_the_server_answers_as_before(server: LiveServer) -> None:
    client = server.client(max_retries=0)
    answer = client.completions.create(model="m", prompt="The capital of France is", max_tokens=4, temperature=0)
    assert answer.choices[0].text
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


@pytest.mark.model
def test_a_completion_without_max_tokens_or_with_null_stops_at_16_tokens(server: LiveServer) -> None:
    for body in ({"prompt": "1, 2, 3, 4, 5,", "temperature": 0},
                 {"prompt": "1, 2, 3, 4, 5,", "temperature": 0, "max_tokens": None}):
        answer = _post(server, _COMPLETIONS, body).json()
        assert answer["usage"]["completion_tokens"] == 16
        assert answer["choices"][0]["finish_reason"] == "length"


@pytest.mark.model
def test_logit_bias_applies_to_the_token_it_names(server: LiveServer) -> None:
    tokenizer = server.service.tokenizer
    forced = tokenizer.tokenize(b" banana", add_bos=False)[0]
    answer = _post(server, _COMPLETIONS, {"prompt": "My favourite fruit is", "max_tokens": 1, "temperature": 0,
                                          "logit_bias": {str(forced): 100}}).json()
    assert answer["choices"][0]["text"] == tokenizer.detokenize([forced]).decode()


@pytest.mark.model
def test_schemas_within_the_limits_are_accepted(server: LiveServer) -> None:
    within = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 100_000},
                                               "colour": {"enum": [f"c{i}" for i in range(4096)]}}}
    response = _post(server, _CHAT, {"messages": _USER, "tools": [_schema_tool(within)], "max_tokens": 2})
    assert response.status_code == 200, response.text


@pytest.mark.model
def test_refused_huge_prompts_do_not_pin_memory(server: LiveServer) -> None:
    """32 different 7.8 MB prompts, each refused: the memo keeps none of them and RSS stays bounded."""
    memo = server.service.tokenizer.memo
    assert memo is not None
    size = 7_800_000
    _post(server, _COMPLETIONS, {"prompt": "warm-up " * (size // 8)})  # the first one's buffers
    before = rss_bytes()
    for index in range(32):
        words = f"prompt {index} has words " * (size // 24)
        path, body = ((_COMPLETIONS, {"prompt": words}) if index % 2 else
                      (_CHAT, {"messages": [{"role": "user", "content": words}]}))
        response = _post(server, path, body)
        assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    grown = rss_bytes() - before
    assert grown < 150 << 20, f"RSS grew by {grown >> 20} MiB"
    assert memo.nbytes <= memo.capacity_bytes
    assert all(len(key[0]) < size for key in memo._entries)  # noqa: SLF001 - what it keeps


# ------------------------------------------------------------------------------------- unit checks

def test_the_tokenization_memo_is_bounded_by_bytes_and_keeps_no_prompt_too_long_to_serve() -> None:
    memo = TokenizationMemo(capacity_bytes=1000, max_tokens=50)
    memo.put(("ns", b"a" * 100, True, False), list(range(49)))
    assert memo.get(("ns", b"a" * 100, True, False)) == list(range(49))
    memo.put(("ns", b"b" * 10, True, False), list(range(50)))  # a prompt that cannot fit: refused, so not kept
    assert memo.get(("ns", b"b" * 10, True, False)) is None
    for index in range(10):
        memo.put(("ns", bytes([index]) * 200, True, False), [1, 2])
    assert memo.nbytes <= 1000 and len(memo) == 4
    memo.put(("ns", b"c" * 2000, True, False), [1])  # larger than the whole memo
    assert memo.get(("ns", b"c" * 2000, True, False)) is None and memo.nbytes <= 1000


@pytest.mark.model
def test_a_rendered_prompt_is_not_tokenized_past_its_bound_or_for_a_client_that_left() -> None:
    model = Model(default_model_path())
    llama = ServedTokenizer(model)
    calls: list[bytes] = []
    tokenize = model.tokenize

    def counting(text: bytes, *args: Any, **kwargs: Any) -> list[int]:
        calls.append(text)
        return tokenize(text, *args, **kwargs)

    model.tokenize = counting  # type: ignore[method-assign]
    messages = [{"role": "user", "content": "hello " * 100}]
    with pytest.raises(PromptTooLong) as raised:
        prompt_tokens_for_chat(llama, messages, bound=PromptTextBound(n_ctx=256, max_bytes=300, special=None))
    assert "bytes of text" in str(raised.value) and not calls
    with pytest.raises(RenderingCancelled):
        prompt_tokens_for_chat(llama, messages, cancelled=lambda: True)
    assert not calls
    bound = PromptTextBound.for_vocabulary(model.vocab, model.detokenizer, model.n_vocab, 256)
    assert prompt_tokens_for_chat(llama, messages, bound=bound, cancelled=lambda: False)
    assert len(calls) == 1
    model.close()


@pytest.mark.model
def test_the_text_bound_refuses_only_texts_that_cannot_fit() -> None:
    import llama_cpp

    llama = llama_cpp.Llama(model_path=str(default_model_path()), n_ctx=256, verbose=False, vocab_only=True)
    bound = PromptTextBound.for_model(llama, 256)
    assert bound.max_bytes >= 256 * 8 and bound.special is not None
    # Each special token is one token: 256 of them cannot fit, 255 with a little text may.
    assert bound.overflow(b"<|im_end|>" * 256, special=True) == "at least 256 special tokens"
    assert bound.overflow(b"<|im_end|>" * 256, special=False) is None  # parsed as text, it is just bytes
    assert bound.overflow(b"<|im_end|>" * 200 + b"hello", special=True) is None
    assert bound.overflow(b"a" * (bound.max_bytes + 1), special=False) is not None
    # Each refusal is sound: the tokenizer gives the refused texts at least n_ctx tokens.
    refused = [b"<|im_start|>" * 256, b"<|im_end|>x" * 256]
    for text in refused:
        assert bound.overflow(text, special=True) is not None
        assert len(llama.tokenize(text, add_bos=False, special=True)) >= 256


@pytest.mark.parametrize(("schema", "ok"), [
    ({"type": "string", "maxLength": 100_000}, True),
    ({"type": "string", "maxLength": 100_001}, False),
    ({"type": "array", "minItems": 200_000}, False),
    ({"type": "string", "pattern": "^a{2,100000}$"}, True),
    ({"type": "string", "pattern": "^a{100001}$"}, False),
    ({"type": "string", "pattern": r"^\{99999\}$"}, True),  # an escaped brace is no quantifier
    ({"anyOf": [{"enum": list(range(2048))}, {"enum": list(range(2048))}]}, True),
    ({"anyOf": [{"enum": list(range(2048))}, {"enum": list(range(2049))}]}, False),
    ({"type": "string", "maxLength": "long"}, False),
    (_nested(31), True),
    (_nested(33), False),
    (True, True),
    ("string", False),
])
def test_schema_bounds(schema: Any, ok: bool) -> None:
    if ok:
        check_schema(schema, "tools[0].parameters", RequestLimits())
    else:
        with pytest.raises(ApiError) as raised:
            check_schema(schema, "tools[0].parameters", RequestLimits())
        assert raised.value.status == 400 and raised.value.param == "tools[0].parameters"


# ------------------------------------------------------------------------------------------- drain

def _wait_for(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


@pytest.mark.model
@pytest.mark.slow
def test_a_drain_past_its_timeout_answers_everything_it_holds() -> None:
    """Stopped with a stream and a completion running and one queued: 503 JSON bodies and an ended stream."""
    live = LiveServer(ServerConfig(n_ctx=N_CTX, parallel=2, max_queue=4), shutdown_timeout=3.0)
    long = {"prompt": "Once upon a time", "max_tokens": N_CTX - 16, "temperature": 1.0, "seed": 1,
            "logit_bias": {"2": -100, "0": -100}}  # no end of text: runs until stopped
    events: list[str] = []
    streaming = threading.Event()
    results: dict[str, httpx.Response] = {}

    def stream() -> None:
        with httpx.stream("POST", live.url + _COMPLETIONS, json={**long, "stream": True}, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    events.append(line)
                    streaming.set()

    def post(name: str) -> None:
        results[name] = httpx.post(live.url + _COMPLETIONS, json=long, timeout=60)

    threads = [threading.Thread(target=stream), threading.Thread(target=post, args=("running",))]
    try:
        for thread in threads:
            thread.start()
        assert streaming.wait(timeout=60)
        _wait_for(lambda: live.service.gate.running == 2)
        queued = threading.Thread(target=post, args=("queued",))
        queued.start()
        threads.append(queued)
        _wait_for(lambda: live.service.gate.queue_depth == 1)
    finally:
        live.stop()
        for thread in threads:
            thread.join(timeout=60)
    for name in ("running", "queued"):
        response = results[name]
        assert response.status_code == 503, (name, response.text)
        assert response.json()["error"]["code"] == "unavailable"
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["error"]["code"] == "unavailable"
