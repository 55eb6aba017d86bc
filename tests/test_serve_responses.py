"""OpenAI's Responses API on a live ``llama-cache serve`` (the embedded default model), through the
official ``openai`` client: whole and streamed answers, function tools, ``text.format``,
``instructions``, server-side conversations (``previous_response_id``, served from the prompt cache),
stored responses (retrieve, delete, 404s for unknown, expired and other keys' ids, tampered values) and
bad input.

The shapes follow llama.cpp's own compatibility tests (``tools/server/tests/unit/test_compat_oai_responses.py``):
their cases are ported here without the exact words their model answers with.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from llama_cache.server import ServerConfig
from tests.live_server import LiveServer

pytestmark = pytest.mark.model

N_CTX = 2048
BOOK = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}, "strict": True}
TIME = {"type": "function", "name": "get_time", "description": "The time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                       "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    # Deterministic: tests compare answers to the same conversation sent two ways, greedy, bit for bit;
    # in the default mode a single query row's attention sums its cells in pieces that depend on how far
    # the pool's cells in use reach, so two runs of one prompt may part at a near tie.
    live = LiveServer(ServerConfig(n_ctx=N_CTX, parallel=2, max_queue=16, deterministic=True))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return server.client(max_retries=0)


def _nonce() -> str:
    return f"{time.monotonic_ns() % 10**9}"


def _post(server: LiveServer, body: dict[str, Any], key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + "/v1/responses", json=body, headers=headers, timeout=120)


# ------------------------------------------------------------------------------- llama.cpp's cases

def test_responses_with_openai_library(client: openai.OpenAI) -> None:
    res = client.responses.create(model="gpt-4.1", input=BOOK, max_output_tokens=8, temperature=0.8)
    assert res.id.startswith("resp_")
    assert res.object == "response"
    assert res.output[0].id is not None and res.output[0].id.startswith("msg_")
    assert res.output[0].type == "message" and res.output[0].role == "assistant"
    assert res.output_text
    assert res.model == "gpt-4.1"
    usage = res.usage
    assert usage is not None and usage.output_tokens <= 8
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    if usage.output_tokens == 8:  # cut by max_output_tokens
        assert res.status == "incomplete"
        assert res.incomplete_details is not None and res.incomplete_details.reason == "max_output_tokens"
    else:
        assert res.status == "completed" and res.incomplete_details is None


def test_responses_stream_with_openai_library(client: openai.OpenAI) -> None:
    stream = client.responses.create(model="gpt-4.1", input=BOOK, max_output_tokens=8, temperature=0.8, stream=True)
    events = list(stream)
    kinds = [event.type for event in events]
    deltas = kinds.count("response.output_text.delta")
    final = "response.incomplete" if kinds[-1] == "response.incomplete" else "response.completed"
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done", final]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    resp_id = events[0].response.id
    assert resp_id.startswith("resp_") and events[1].response.id == resp_id
    assert events[0].response.status == "in_progress"
    msg_id = events[2].item.id
    assert msg_id.startswith("msg_")
    gathered = ""
    for event in events[3:-1]:
        assert event.item_id == msg_id if hasattr(event, "item_id") else event.item.id == msg_id
        if event.type == "response.output_text.delta":
            gathered += event.delta
    done = events[-1].response
    assert done.id == resp_id and done.output[0].id == msg_id
    assert gathered == done.output_text and gathered
    assert events[-4].text == gathered
    assert done.usage is not None and done.usage.input_tokens > 0


# --------------------------------------------------------------------------------------- the shapes

def test_a_string_input_and_instructions_render_as_chat_messages(server: LiveServer, client: openai.OpenAI) -> None:
    """``instructions`` is the system message; the prompt is the chat route's, token for token: a prompt
    cached by one API is a hit for the other."""
    question = f"Name a colour ({_nonce()})."
    res = client.responses.create(instructions="You answer in one word.", input=question, max_output_tokens=6,
                                  temperature=0)
    chat = client.chat.completions.create(model="x", messages=[
        {"role": "system", "content": "You answer in one word."}, {"role": "user", "content": question}],
        max_tokens=6, temperature=0)
    assert chat.usage is not None and res.usage is not None
    assert chat.usage.prompt_tokens == res.usage.input_tokens
    assert chat.choices[0].message.content == res.output_text
    assert chat.usage.prompt_tokens_details is not None
    assert chat.usage.prompt_tokens_details.cached_tokens >= res.usage.input_tokens - 1
    # And back: the chat prompt is a hit for the Responses API.
    again = client.responses.create(instructions="You answer in one word.", input=question, max_output_tokens=6,
                                    temperature=0, store=False)
    assert again.usage is not None and again.usage.input_tokens_details.cached_tokens >= res.usage.input_tokens - 1


def test_message_items_with_content_parts(client: openai.OpenAI) -> None:
    res = client.responses.create(input=[
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Say hi"}, {"type": "input_text", "text": "!"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi!"}]},
        {"role": "user", "content": "Again."},
    ], max_output_tokens=4)
    assert res.status in ("completed", "incomplete") and res.output[0].type == "message"


def test_a_forced_function_call(client: openai.OpenAI) -> None:
    res = client.responses.create(input="What is the weather in Paris?", tools=[WEATHER, TIME],
                                  tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60)
    assert res.status == "completed"
    (call,) = res.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id is not None and call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert res.tool_choice.type == "function" and [t.name for t in res.tools] == ["get_weather", "get_time"]


def test_a_required_function_call_then_its_output(server: LiveServer, client: openai.OpenAI) -> None:
    first = client.responses.create(input=f"What is the weather in Rome? ({_nonce()})", tools=[WEATHER, TIME],
                                    tool_choice="required", max_output_tokens=80, temperature=0)
    (call,) = first.output
    assert call.type == "function_call" and call.name in ("get_weather", "get_time")
    assert "city" in json.loads(call.arguments)
    counters = ("llama_cache_responses_continued_total", "llama_cache_responses_rerendered_total")
    before = [server.metrics().get(name, 0) for name in counters]
    second = client.responses.create(previous_response_id=first.id, tools=[WEATHER, TIME], max_output_tokens=12,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "Sunny, 21 degrees."}])
    assert second.previous_response_id == first.id
    assert second.usage is not None and first.usage is not None
    # The previous prompt and the call as the model wrote it came from the cache: the conversation goes
    # on from its tokens, even where the call's text (its JSON spacing) would tokenize otherwise.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens + first.usage.output_tokens - 1
    after = [server.metrics()[name] for name in counters]
    assert after == [before[0] + 1, before[1]]


def test_a_history_sent_back_whole_continues_from_the_stored_tokens(client: openai.OpenAI) -> None:
    """An agent that re-sends its whole history (no previous_response_id) sends back the items this
    server made: their ids name the stored response, whose tokens the prompt goes on from."""
    question = {"role": "user", "content": f"What is the time in Lima? ({_nonce()})"}
    first = client.responses.create(input=[question], tools=[WEATHER, TIME], tool_choice="required",
                                    max_output_tokens=80, temperature=0)
    (call,) = first.output
    assert call.id is not None and call.id.startswith("fc_") and first.id[5:] in call.id
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Noon."}
    history = [question, call.model_dump(exclude_none=True), output]
    second = client.responses.create(input=history, tools=[WEATHER, TIME], max_output_tokens=8, store=False)
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens + first.usage.output_tokens - 1
    # An item changed on the way back is rendered as sent: still served, from the prompt's cache.
    changed = {**call.model_dump(exclude_none=True), "arguments": json.dumps({"city": "Quito"})}
    third = client.responses.create(input=[question, changed, output], tools=[WEATHER, TIME], max_output_tokens=8,
                                    store=False)
    assert third.usage is not None and third.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def test_a_streamed_function_call(client: openai.OpenAI) -> None:
    for choice in ({"type": "function", "name": "get_weather"}, "required"):
        events = list(client.responses.create(input="Weather in Oslo?", tools=[WEATHER], tool_choice=choice,
                                              max_output_tokens=80, stream=True))
        kinds = [event.type for event in events]
        deltas = kinds.count("response.function_call_arguments.delta")
        assert deltas >= 1
        assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                         *["response.function_call_arguments.delta"] * deltas,
                         "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
        assert [event.sequence_number for event in events] == list(range(len(events)))
        item = events[2].item
        assert item.type == "function_call" and item.id.startswith("fc_") and item.name == "get_weather"
        arguments = "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta")
        assert events[-3].arguments == arguments and json.loads(arguments)["city"]
        assert events[-1].response.output[0].arguments == arguments


class City(BaseModel):
    name: str = Field(max_length=20)
    population: int = Field(ge=0, le=100_000_000)


def test_text_format_json_schema_is_enforced_and_parsed() -> None:
    # A server of its own: the greedy json_object answer below is the one of a sequence whose cells are in
    # position order (in a long-used server it may differ in its last bits, and a greedy loop may not end).
    live = LiveServer(ServerConfig(n_ctx=N_CTX, parallel=2, max_queue=16))
    try:
        _json_formats_are_enforced_and_parsed(live.client(max_retries=0))
    finally:
        live.stop()


def _json_formats_are_enforced_and_parsed(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(input="Describe a city as JSON.", text_format=City, max_output_tokens=60)
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, City)
    # A prompt that names the object: a greedy answer to a vaguer one may loop inside a string value
    # until the token limit, depending on the last bits of the floats.
    res = client.responses.create(input='Reply with this JSON object: {"name": "Ada"}', max_output_tokens=200,
                                  text={"format": {"type": "json_object"}}, temperature=0)
    assert res.status == "completed", res.output_text
    assert isinstance(json.loads(res.output_text), dict)
    assert res.text is not None and res.text.format is not None and res.text.format.type == "json_object"


def test_text_format_json_schema_streamed(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    events = list(client.responses.create(input="Is the sky blue?", max_output_tokens=30, stream=True, text={
        "format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    jsonschema.validate(json.loads(text), schema)


# ------------------------------------------------------------------------------ conversations

def test_a_follow_up_is_served_from_the_cache(client: openai.OpenAI) -> None:
    question = f"Name a river. ({_nonce()})"
    first = client.responses.create(instructions="You are terse.", input=question, max_output_tokens=10,
                                    temperature=0)
    second = client.responses.create(instructions="You are terse.", previous_response_id=first.id,
                                     input="And a mountain?", max_output_tokens=10, temperature=0)
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens + first.usage.output_tokens - 1
    # The same conversation sent whole renders the same tokens, and answers the same.
    whole = client.responses.create(instructions="You are terse.", store=False, max_output_tokens=10, temperature=0,
                                    input=[{"role": "user", "content": question},
                                           {"role": "assistant", "content": first.output_text},
                                           {"role": "user", "content": "And a mountain?"}])
    assert whole.usage is not None and whole.usage.input_tokens == second.usage.input_tokens
    assert whole.output_text == second.output_text
    third = client.responses.create(previous_response_id=second.id, input="Thanks.", max_output_tokens=4,
                                    instructions="You are terse.")
    assert third.usage is not None
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens + second.usage.output_tokens - 1


def test_a_follow_up_with_other_instructions_is_counted_as_rerendered(server: LiveServer,
                                                                     client: openai.OpenAI) -> None:
    first = client.responses.create(instructions="Answer in English.", input="Hello there", max_output_tokens=4)
    before = server.metrics().get("llama_cache_responses_rerendered_total", 0)
    second = client.responses.create(instructions="Answer in French.", previous_response_id=first.id,
                                     input="Again", max_output_tokens=4)
    assert second.status in ("completed", "incomplete")
    assert server.metrics()["llama_cache_responses_rerendered_total"] == before + 1


def test_retrieve_and_delete(client: openai.OpenAI) -> None:
    res = client.responses.create(input="Hi", max_output_tokens=4)
    got = client.responses.retrieve(res.id)
    assert got.id == res.id and got.output_text == res.output_text and got.usage == res.usage
    client.responses.delete(res.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.retrieve(res.id)
    assert caught.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(res.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(input="Hi", previous_response_id=res.id)
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert caught.value.body["code"] == "previous_response_not_found"  # type: ignore[index]


def test_unknown_ids_are_404s(server: LiveServer, client: openai.OpenAI) -> None:
    for response_id in ("resp_" + "0" * 48, "resp_nope", "x" * 300, "resp_%2E%2E", "msg_" + "0" * 48):
        response = httpx.get(f"{server.url}/v1/responses/{response_id}")
        assert response.status_code == 404, response_id
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert httpx.delete(f"{server.url}/v1/responses/{response_id}").status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="Hi", previous_response_id="resp_" + "f" * 48)


def test_store_false_keeps_nothing(client: openai.OpenAI) -> None:
    res = client.responses.create(input="Hi", max_output_tokens=4, store=False)
    assert res.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(res.id)


def test_a_streamed_response_is_stored_before_it_completes(client: openai.OpenAI) -> None:
    events = list(client.responses.create(input="Count to three.", max_output_tokens=8, stream=True))
    done = events[-1].response
    got = client.responses.retrieve(done.id)
    assert got.output_text == done.output_text
    follow = client.responses.create(previous_response_id=done.id, input="Go on.", max_output_tokens=4)
    assert follow.usage is not None and done.usage is not None
    assert follow.usage.input_tokens_details.cached_tokens >= done.usage.input_tokens + done.usage.output_tokens - 1


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": 3}, "input"),
    ({"input": [3]}, "input[0]"),
    ({"input": [{"type": "banana"}]}, "input[0].type"),
    ({"input": [{"role": "root", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": ["user"], "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": ["input_text"], "text": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": "x", "instructions": 5}, "instructions"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": "8"}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": "x", "temperature": 5}, "temperature"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema"),
    ({"input": "x", "store": "yes"}, "store"),
    ({"input": "x", "stream": 1}, "stream"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "metadata": {"a": 1}}, "metadata"),
    ({"input": "x", "previous_response_id": 7}, "previous_response_id"),
])
def test_bad_input_is_a_400_naming_its_field(server: LiveServer, body: dict[str, Any], param: str) -> None:
    response = _post(server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error


def test_a_body_that_is_not_json_is_a_400(server: LiveServer) -> None:
    response = httpx.post(server.url + "/v1/responses", content=b"{nope", timeout=30)
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


def test_the_metrics_count_the_route(server: LiveServer, client: openai.OpenAI) -> None:
    before = server.metrics().get('llama_cache_requests_total{endpoint="/v1/responses",status="200"}', 0)
    client.responses.create(input="Hi", max_output_tokens=2, store=False)
    after = server.metrics()
    assert after['llama_cache_requests_total{endpoint="/v1/responses",status="200"}'] == before + 1
    assert after['llama_cache_time_to_first_token_seconds_count{endpoint="/v1/responses"}'] >= 1


# ------------------------------------------------------------------------------------- tenants, TTL

@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("responses-cache")


@pytest.fixture(scope="module")
def keyed(cache_dir: Path) -> Iterator[LiveServer]:
    """Two API keys, stored responses on disk (under the cache folder) expiring after 4 seconds."""
    config = ServerConfig(n_ctx=1024, parallel=1, api_keys=("key-alpha", "key-beta"), responses_ttl=4.0,
                          cache_dir=cache_dir)
    live = LiveServer(config)
    yield live
    live.stop()


def test_another_keys_response_is_a_404(keyed: LiveServer) -> None:
    alpha, beta = keyed.client(max_retries=0), keyed.client(api_key="key-beta", max_retries=0)
    res = alpha.responses.create(input="Hi", max_output_tokens=2)
    assert alpha.responses.retrieve(res.id).id == res.id
    with pytest.raises(openai.NotFoundError):
        beta.responses.retrieve(res.id)
    with pytest.raises(openai.NotFoundError):
        beta.responses.create(input="Hi", previous_response_id=res.id)
    with pytest.raises(openai.NotFoundError):
        beta.responses.delete(res.id)
    assert alpha.responses.retrieve(res.id).id == res.id  # beta deleted nothing
    assert httpx.get(f"{keyed.url}/v1/responses/{res.id}").status_code == 401


def test_an_expired_response_is_a_404(keyed: LiveServer) -> None:
    alpha = keyed.client(max_retries=0)
    res = alpha.responses.create(input="Hi", max_output_tokens=2)
    assert alpha.responses.retrieve(res.id).id == res.id
    time.sleep(4.5)
    with pytest.raises(openai.NotFoundError):
        alpha.responses.retrieve(res.id)
    with pytest.raises(openai.NotFoundError):
        alpha.responses.create(input="Hi", previous_response_id=res.id)


def test_a_tampered_stored_response_is_a_logged_404(keyed: LiveServer, cache_dir: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    alpha = keyed.client(max_retries=0)
    database = cache_dir / "responses" / "responses.sqlite3"
    for value in (b"garbage", json.dumps({"v": 1, "id": "resp_other"}).encode(), "not bytes"):
        res = alpha.responses.create(input="Hi", max_output_tokens=2)
        with sqlite3.connect(database) as conn:
            assert conn.execute("UPDATE responses SET data = ? WHERE id = ?", (value, res.id)).rowcount == 1
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="llama_cache.server.response_store"):
            with pytest.raises(openai.NotFoundError):
                alpha.responses.retrieve(res.id)
        assert "damaged" in caplog.text
        with pytest.raises(openai.NotFoundError):
            alpha.responses.create(input="Hi", previous_response_id=res.id)



# ---------------------------------------------------------------------------------------------- fuzz

_VOCABULARY = ["input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice", "text",
               "stream", "store", "previous_response_id", "model", "metadata", "type", "role", "content", "name",
               "arguments", "call_id", "output", "format", "schema", "parameters", "strict", "truncation"]
_ATOMS = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 40), max_value=1 << 40), st.text(max_size=12),
                   st.sampled_from(["auto", "none", "required", "function", "message", "user", "assistant",
                                    "developer", "input_text", "output_text", "function_call", "function_call_output",
                                    "json_schema", "json_object", "resp_" + "0" * 48]))
_VALUES = st.recursive(_ATOMS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(_VOCABULARY), inner, max_size=4)), max_leaves=12)


@settings(max_examples=60, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.dictionaries(st.sampled_from(_VOCABULARY), _VALUES, max_size=6))
def test_no_body_is_a_5xx(server: LiveServer, body: dict[str, Any]) -> None:
    body["max_output_tokens"] = 2  # answers are cut short: the fields are what is tried
    response = _post(server, body)
    assert response.status_code < 500, (body, response.text)
    if response.status_code != 200:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
