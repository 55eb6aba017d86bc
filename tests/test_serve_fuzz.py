"""A seeded fuzz loop against a live ``llama-cache serve``: valid and hostile bodies, schemas, disconnects.

Hypothesis draws request bodies (derandomized: the same sequence every run): well-formed requests with
random fields (``echo``, ``cache_salt``, tokenize and detokenize among them), random JSON values in every field, random JSON schemas in tools, huge and malformed
values, raw bytes that are not JSON, and clients that leave before their answer. Whatever it sends:

- no answer is a 5xx other than 503 (and no 503 while the server is not shutting down or full);
- every request is answered within its bound (the client's timeout), and the server stays up;
- the server's RSS stays within a bound;
- a fixed greedy request gets the same answer before and after.

``LLAMA_CACHE_FUZZ_EXAMPLES`` sets the number of requests (default 60, a minute or two here; try 2000).
"""

from __future__ import annotations

import json
import os
import string
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llama_cache.server import ServerConfig
from tests.live_server import LiveServer, rss_bytes

pytestmark = [pytest.mark.model, pytest.mark.slow]

N_CTX = 512
EXAMPLES = int(os.environ.get("LLAMA_CACHE_FUZZ_EXAMPLES", "60"))
ANSWER_TIMEOUT = 120.0
RSS_BOUND = 3 << 30

_CHAT = "/v1/chat/completions"
_COMPLETIONS = "/v1/completions"
_TOKENIZE = "/tokenize"
_DETOKENIZE = "/detokenize"
_FIXED = {"prompt": "The first three planets are", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    live = LiveServer(ServerConfig(n_ctx=N_CTX, parallel=2, max_queue=32))
    yield live
    live.stop()


_json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40),
    st.sampled_from(["\ud800", "x" * 5000, "<|im_start|>", "{{ 7*7 }}", "{% for %}", "\x00"]),
)
_json = st.recursive(_json_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)), max_leaves=20)

_names = st.text(alphabet=string.ascii_letters, min_size=1, max_size=8)
_schema = st.recursive(
    st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null"])}),
        st.fixed_dictionaries({"type": st.just("string"), "maxLength": st.integers(0, 200_000)}),
        st.fixed_dictionaries({"type": st.just("string"), "pattern": st.sampled_from(
            ["^c{1,2000}$", "^[a-z]+$", "(", "^a{3}$", "\\d{1,9}", "a{99999}"])}),
        st.fixed_dictionaries({"enum": st.lists(st.integers() | st.text(max_size=5), max_size=20)}),
        st.builds(lambda n: {"enum": list(range(n))}, st.sampled_from([10, 4096, 50_000])),
        _json,
    ),
    lambda inner: st.one_of(
        st.builds(lambda props: {"type": "object", "properties": props, "required": list(props)[:1]},
                  st.dictionaries(_names, inner, max_size=4)),
        st.builds(lambda items, low: {"type": "array", "items": items, "minItems": low},
                  inner, st.integers(0, 10_000)),
        st.builds(lambda options: {"anyOf": options}, st.lists(inner, max_size=3)),
    ),
    max_leaves=8,
)
_tool = st.one_of(
    st.builds(lambda name, schema: {"type": "function", "function": {"name": name, "parameters": schema}},
              _names, _schema),
    _json,
)
_valid_sampling = st.fixed_dictionaries({"max_tokens": st.integers(1, 4)}, optional={
    "temperature": st.floats(0, 2), "top_p": st.floats(0, 1), "top_k": st.integers(0, 100),
    "seed": st.integers(0, 1 << 32), "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100), max_size=3),
    "stream": st.booleans(), "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "n": st.integers(1, 3), "grammar": st.sampled_from(['root ::= "a" | "b"', 'root ::= [0-9]+ "."']),
    "cache_salt": st.text(min_size=1, max_size=20),
})
_any_sampling = st.fixed_dictionaries({}, optional={
    "temperature": st.one_of(st.floats(-1, 3, allow_nan=False), _json_leaf),
    "top_p": st.floats(0, 1), "top_k": st.one_of(st.integers(-5, 60_000), st.just(1 << 63)),
    "seed": st.integers(-(1 << 64), 1 << 64), "max_tokens": st.one_of(st.integers(-2, 6), st.none(), _json_leaf),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=6), _json_leaf),
    "logit_bias": st.one_of(st.dictionaries(st.integers(-10, 60_000).map(str), st.floats(-200, 200), max_size=3),
                            st.just({"1" * 5000: 1}), st.just({"0" * 40 + "7": 1}), _json),
    "cache_salt": st.one_of(st.text(max_size=300), _json_leaf),
    "stream": st.one_of(st.booleans(), _json_leaf),
    "n": st.integers(0, 3), "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3),
    "model": st.one_of(st.text(max_size=10), _json_leaf),
    "response_format": st.one_of(st.just({"type": "json_object"}), _json,
                                 st.builds(lambda schema: {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
                                           st.one_of(_schema, _json))),
    "logprobs": st.one_of(st.booleans(), st.integers(-2, 25), _json_leaf),
    "top_logprobs": st.one_of(st.integers(-2, 25), _json_leaf),
    "stream_options": st.one_of(st.just({"include_usage": True}), _json),
    "grammar": st.one_of(st.text(max_size=40), st.just("root ::= " + "(" * 2000), _json_leaf),
})
_valid_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer"]),
                                        "content": st.text(max_size=200)})


def _chat_body(draw: st.DrawFn, valid: bool) -> dict[str, Any]:
    body = draw(_valid_sampling if valid else _any_sampling)
    message = _valid_message if valid else st.one_of(_valid_message, _json)
    body["messages"] = draw(st.lists(message, min_size=1, max_size=4) if valid else st.one_of(
        st.lists(message, min_size=1, max_size=4), _json))
    if draw(st.booleans()):
        tools = draw(st.lists(_tool, min_size=1, max_size=2))
        body["tools"] = tools
        first = tools[0].get("function", {}).get("name") if isinstance(tools[0], dict) else None
        body["tool_choice"] = draw(st.one_of(
            st.sampled_from(["auto", "none", "required"]),
            st.just({"type": "function", "function": {"name": first}}), _json))
    return body


def _completion_body(draw: st.DrawFn, valid: bool) -> dict[str, Any]:
    body = draw(_valid_sampling if valid else _any_sampling)
    body["prompt"] = draw(st.one_of(st.text(min_size=1, max_size=300), st.lists(st.integers(0, 49151), min_size=1,
                                                                               max_size=20))
                          if valid else st.one_of(st.text(max_size=300), st.lists(st.integers(-5, 60_000), max_size=20),
                                                  _json))
    body["echo"] = draw(st.one_of(st.none(), st.booleans()))
    return body


def _utility_body(draw: st.DrawFn, path: str) -> Any:
    if path == _TOKENIZE:
        return draw(st.one_of(
            st.fixed_dictionaries({"content": st.one_of(st.text(max_size=300), st.just("-" * 200 + " " * 200))},
                                  optional={"with_pieces": st.booleans(), "add_special": st.booleans()}),
            st.just({"content": "<|im_end|>" * 5000}), _json))
    return draw(st.one_of(
        st.fixed_dictionaries({"tokens": st.lists(st.integers(0, 49151), max_size=50)}),
        st.just({"tokens": [1] * 500_000}), st.just({"tokens": [True, 2]}),
        st.fixed_dictionaries({"tokens": st.lists(st.integers(-(1 << 70), 1 << 70), max_size=5)}), _json))


@st.composite
def _requests(draw: st.DrawFn) -> tuple[str, bytes, bool]:
    """(path, body bytes, whether the client leaves at once)."""
    path = draw(st.sampled_from([_CHAT, _COMPLETIONS, _CHAT, _COMPLETIONS, _TOKENIZE, _DETOKENIZE]))
    kind = draw(st.sampled_from(["valid", "valid", "hostile", "hostile", "bytes", "json"]))
    if path in (_TOKENIZE, _DETOKENIZE) and kind in ("valid", "hostile"):
        raw = json.dumps(_utility_body(draw, path)).encode()
    elif kind == "bytes":
        raw = draw(st.one_of(st.binary(max_size=200), st.just(b'{"prompt": ' + b"[" * 5000),
                             st.just(b'{"prompt": 1' + b"0" * 5000 + b"}")))
    elif kind == "json":
        raw = json.dumps(draw(_json)).encode()
    else:
        valid = kind == "valid"
        body = _chat_body(draw, valid) if path == _CHAT else _completion_body(draw, valid)
        # Keep most generations short; the rest bounded by the context.
        if draw(st.integers(0, 9)) and isinstance(body.get("max_tokens"), int):
            body["max_tokens"] = min(body["max_tokens"], 4)
        raw = json.dumps(body).encode()
    return path, raw, draw(st.integers(0, 9)) == 0


def test_no_request_crashes_stalls_or_changes_the_server(server: LiveServer) -> None:
    before = httpx.post(server.url + _COMPLETIONS, json=_FIXED, timeout=ANSWER_TIMEOUT).json()["choices"][0]["text"]
    statuses: dict[int, int] = {}

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(_requests())
    def one_request(request: tuple[str, bytes, bool]) -> None:
        path, raw, leave = request
        headers = {"content-type": "application/json"}
        if leave:  # the client leaves before its answer
            try:
                httpx.post(server.url + path, content=raw, headers=headers, timeout=0.05)
            except httpx.TimeoutException:
                pass
            return
        response = httpx.post(server.url + path, content=raw, headers=headers, timeout=ANSWER_TIMEOUT)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, (path, raw[:300], response.status_code, response.text[:300])
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
        elif path in (_TOKENIZE, _DETOKENIZE):
            assert set(response.json()) == ({"tokens"} if path == _TOKENIZE else {"content"})
        elif "text/event-stream" not in response.headers.get("content-type", ""):
            assert response.json()["choices"]

    one_request()
    assert httpx.get(server.url + "/health", timeout=30).json()["status"] == "ok"
    assert rss_bytes() < RSS_BOUND
    after = httpx.post(server.url + _COMPLETIONS, json=_FIXED, timeout=ANSWER_TIMEOUT).json()["choices"][0]["text"]
    assert after == before
    assert statuses.get(200, 0) > 0 and sum(v for k, v in statuses.items() if 400 <= k < 500) > 0, statuses
