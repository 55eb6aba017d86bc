"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) through the official
``anthropic`` client, against a live ``llama-cache serve`` on the embedded default model: text, system
prompts, conversations, stop sequences, forced tools and their results, streams and their events, token
counts, errors in Anthropic's shape, and the prompt cache shared with the chat completions route.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
from anthropic.types import TextBlock, ToolUseBlock

from llama_cache.server import ServerConfig
from tests.live_server import LiveServer

pytestmark = pytest.mark.model

N_CTX = 1024
# The current anthropic client no longer has temperature (nor top_p, top_k); the server still honours it.
GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    # Deterministic: tests compare a streamed answer with the same request answered whole, greedy, bit for
    # bit; in the default mode a single query row's attention sums its cells in pieces that depend on how
    # far the pool's cells in use reach, so two runs of one prompt may part at a near tie.
    live = LiveServer(ServerConfig(n_ctx=N_CTX, parallel=2, max_queue=16, deterministic=True))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as made:
        yield made


def _nonce() -> str:
    return f"{time.monotonic_ns() % 10**9}"


def _ask(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def _text(message: anthropic.types.Message) -> str:
    assert len(message.content) == 1 and isinstance(message.content[0], TextBlock)
    return message.content[0].text


# ---------------------------------------------------------------------------------- whole answers

def test_a_text_answer_has_anthropics_shape(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model="m", max_tokens=16, messages=_ask("Say hello."), extra_body=GREEDY)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == "m"
    assert _text(message)
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    usage = message.usage
    assert usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.cache_read_input_tokens is not None and usage.cache_creation_input_tokens == 0


def test_a_system_prompt_as_a_string_or_text_blocks_is_the_same_prompt(client: anthropic.Anthropic) -> None:
    messages = _ask("Name a colour.")
    plain = client.messages.count_tokens(model="m", messages=messages)  # type: ignore[arg-type]
    system = "You answer in one word."
    as_string = client.messages.count_tokens(model="m", system=system, messages=messages)  # type: ignore[arg-type]
    as_blocks = client.messages.count_tokens(
        model="m", messages=messages,  # type: ignore[arg-type]
        system=[{"type": "text", "text": "You answer"}, {"type": "text", "text": " in one word."}])
    assert as_string.input_tokens == as_blocks.input_tokens != plain.input_tokens
    first = client.messages.create(model="m", max_tokens=8, system=system, messages=messages,  # type: ignore[arg-type]
                                   extra_body=GREEDY)
    second = client.messages.create(model="m", max_tokens=8, messages=messages, extra_body=GREEDY,  # type: ignore[arg-type]
                                    system=[{"type": "text", "text": system}])
    assert _text(first) == _text(second)
    assert first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0) == as_string.input_tokens


def test_a_multi_turn_conversation_and_its_second_turn_read_from_the_cache(client: anthropic.Anthropic) -> None:
    turns: list[dict[str, Any]] = _ask(f"My name is Ada {_nonce()}. " + "I like long walks on the beach. " * 8)
    first = client.messages.create(model="m", max_tokens=12, messages=turns, extra_body=GREEDY)  # type: ignore[arg-type]
    first_prompt = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    assert (first.usage.cache_read_input_tokens or 0) < first_prompt // 2  # the template's head at most
    turns += [{"role": "assistant", "content": _text(first)}, {"role": "user", "content": "What is my name?"}]
    second = client.messages.create(model="m", max_tokens=12, messages=turns, extra_body=GREEDY)  # type: ignore[arg-type]
    assert _text(second)
    cached = second.usage.cache_read_input_tokens or 0
    assert cached >= first_prompt  # the whole first prompt at least
    assert second.usage.input_tokens > 0


def test_a_stop_sequence_ends_the_text_and_is_named(client: anthropic.Anthropic) -> None:
    messages = _ask("Write a sentence about the sea.")
    free = _text(client.messages.create(model="m", max_tokens=24, messages=messages, extra_body=GREEDY))  # type: ignore[arg-type]
    words = free.split(" ")
    assert len(words) >= 3, free
    stop = " " + words[2]  # the third word, as it first appears
    cut = free[: free.index(stop)]
    stopped = client.messages.create(model="m", max_tokens=24, messages=messages, extra_body=GREEDY,  # type: ignore[arg-type]
                                     stop_sequences=["never in this text", stop])
    assert _text(stopped) == cut
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop


def test_max_tokens_cuts_the_answer(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model="m", max_tokens=3, extra_body=GREEDY,
                                     messages=_ask("Tell me a long story about dragons."))
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 3


def test_a_forced_tool_gives_a_tool_use_block_with_its_parsed_input(client: anthropic.Anthropic) -> None:
    for choice in ({"type": "tool", "name": "get_weather"}, {"type": "any"}):
        message = client.messages.create(model="m", max_tokens=40, tools=[WEATHER], tool_choice=choice,  # type: ignore[list-item, arg-type]
                                         messages=_ask("What is the weather in Paris?"), extra_body=GREEDY)
        assert message.stop_reason == "tool_use", choice
        assert len(message.content) == 1 and isinstance(message.content[0], ToolUseBlock)
        block = message.content[0]
        assert block.id.startswith("toolu_") and block.name == "get_weather"
        assert isinstance(block.input, dict) and isinstance(block.input.get("city"), str)


def test_a_tool_result_follow_up_is_answered_in_text(client: anthropic.Anthropic) -> None:
    question = _ask("What is the weather in Paris?")
    call = client.messages.create(model="m", max_tokens=40, tools=[WEATHER],  # type: ignore[list-item]
                                  tool_choice={"type": "tool", "name": "get_weather"}, messages=question)  # type: ignore[arg-type]
    block = call.content[0]
    assert isinstance(block, ToolUseBlock)
    follow_up = question + [
        {"role": "assistant", "content": [block.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,
                                      "content": "Sunny, 25 degrees."}]},
    ]
    answer = client.messages.create(model="m", max_tokens=20, tools=[WEATHER], messages=follow_up,  # type: ignore[list-item, arg-type]
                                    extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert _text(answer)


def test_a_cut_short_forced_tool_is_a_max_tokens_tool_use(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model="m", max_tokens=2, tools=[WEATHER], messages=_ask("Weather in Rome?"),  # type: ignore[list-item]
                                     tool_choice={"type": "tool", "name": "get_weather"})
    assert message.stop_reason == "max_tokens"
    assert isinstance(message.content[0], ToolUseBlock) and message.content[0].input == {}


def test_an_output_format_makes_the_text_an_instance_of_its_schema(client: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer", "minimum": 1, "maximum": 5}},
              "required": ["colour", "count"]}
    message = client.messages.create(model="m", max_tokens=80, messages=_ask("Pick a colour and a count."),
                                     output_config={"format": {"type": "json_schema", "schema": schema}})
    value = json.loads(_text(message))
    assert value["colour"] in ("red", "green", "blue") and 1 <= value["count"] <= 5
    assert message.stop_reason == "end_turn"


# ---------------------------------------------------------------------------------- streams

def _raw_events(server: LiveServer, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The stream's server-sent events as (event name, data), read without a client."""
    with httpx.stream("POST", server.url + "/v1/messages", json={**body, "stream": True}, timeout=120,
                      headers={"anthropic-version": "2023-06-01"}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def test_a_text_stream_follows_anthropics_event_order(server: LiveServer, client: anthropic.Anthropic) -> None:
    body = {"model": "m", "max_tokens": 12, "messages": _ask("Say hello.")}
    events = _raw_events(server, {**body, **GREEDY})
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[3:-3] == ["content_block_delta"] * (len(names) - 6)
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["stop_reason"] is None
    prompt = start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"]
    assert prompt > 0
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert all(data["index"] == 0 and data["delta"]["type"] == "text_delta" for _, data in events[3:-3])
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens") and delta["usage"]["output_tokens"] > 0
    whole = client.messages.create(**body, extra_body=GREEDY)
    assert "".join(data["delta"]["text"] for _, data in events[3:-3]) == _text(whole)
    assert whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0) == prompt


def test_the_clients_stream_gives_the_text_and_the_final_message(client: anthropic.Anthropic) -> None:
    messages = _ask("Name three fruits.")
    with client.messages.stream(model="m", max_tokens=16, messages=messages, extra_body=GREEDY) as stream:  # type: ignore[arg-type]
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "text" in kinds and "content_block_stop" in kinds and "message_delta" in kinds
    whole = client.messages.create(model="m", max_tokens=16, messages=messages, extra_body=GREEDY)  # type: ignore[arg-type]
    assert _text(final) == _text(whole)
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.id.startswith("msg_")


def test_a_streamed_forced_tool_gives_input_json_deltas_and_the_parsed_input(server: LiveServer,
                                                                             client: anthropic.Anthropic) -> None:
    for choice in ({"type": "tool", "name": "get_weather"}, {"type": "any"}):
        body = {"model": "m", "max_tokens": 40, "tools": [WEATHER], "tool_choice": choice,
                "messages": _ask("What is the weather in Oslo?")}
        events = _raw_events(server, {**body, **GREEDY})
        starts = [data for name, data in events if name == "content_block_start"]
        assert len(starts) == 1 and starts[0]["index"] == 0
        block = starts[0]["content_block"]
        assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["id"].startswith("toolu_")
        fragments = [data["delta"]["partial_json"] for name, data in events if name == "content_block_delta"]
        assert all(data["delta"]["type"] == "input_json_delta" for name, data in events if name == "content_block_delta")
        assert isinstance(json.loads("".join(fragments))["city"], str)
        assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
        with client.messages.stream(**body, extra_body=GREEDY) as stream:
            final = stream.get_final_message()
        assert isinstance(final.content[0], ToolUseBlock) and isinstance(final.content[0].input.get("city"), str)
        assert final.stop_reason == "tool_use"


# ---------------------------------------------------------------------------------- token counts

def test_count_tokens_is_the_prompt_a_message_evaluates(client: anthropic.Anthropic) -> None:
    messages = _ask(f"Count me {_nonce()}.")
    counted = client.messages.count_tokens(model="m", messages=messages, tools=[WEATHER])  # type: ignore[arg-type, list-item]
    message = client.messages.create(model="m", max_tokens=2, messages=messages, tools=[WEATHER])  # type: ignore[arg-type, list-item]
    assert counted.input_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)


# ---------------------------------------------------------------------------------- errors

def _post(client: anthropic.Anthropic, body: dict[str, Any], path: str = "/v1/messages") -> Any:
    return client.post(path, body=body, cast_to=httpx.Response)


@pytest.mark.parametrize("body, says", [
    ({"model": "m", "messages": _ask("Hi")}, "'max_tokens' is required"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "Hi"}]}, "'messages[0].role'"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
        {"type": "text", "text": "What is this?"}]}]}, "image input is not supported"),
    ({"model": "m", "max_tokens": 5, "messages": _ask("Hi"), "temperature": 1.5}, "'temperature'"),
    ({"model": "m", "max_tokens": 5, "messages": _ask("Hi"), "tools": [WEATHER],
      "tool_choice": {"type": "tool", "name": "nope"}}, "'tool_choice.name'"),
    ({"model": "m", "max_tokens": 5, "messages": _ask("Hi"), "tools": [{**WEATHER, "input_schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}}],
      "tool_choice": {"type": "any"}}, "tools[0].input_schema"),
])
def test_bad_requests_are_anthropic_400s(client: anthropic.Anthropic, body: dict[str, Any], says: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as raised:
        _post(client, body)
    assert raised.value.status_code == 400
    error = raised.value.body
    assert isinstance(error, dict) and error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error" and says in error["error"]["message"]


def test_the_client_raises_its_own_errors_for_bad_roles_and_images(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError, match="role"):
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "robot", "content": "Hi"}])  # type: ignore[misc, list-item]
    with pytest.raises(anthropic.BadRequestError, match="image input is not supported"):
        client.messages.count_tokens(model="m", messages=[{"role": "user", "content": [  # type: ignore[list-item]
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}])


def test_a_wrong_key_is_an_anthropic_401_and_a_right_one_is_served() -> None:
    live = LiveServer(ServerConfig(n_ctx=512, parallel=1, api_keys=("sk-right",)))
    try:
        with anthropic.Anthropic(base_url=live.url, api_key="sk-wrong", max_retries=0) as wrong:
            with pytest.raises(anthropic.AuthenticationError) as raised:
                wrong.messages.create(model="m", max_tokens=2, messages=_ask("Hi"))  # type: ignore[arg-type]
            body = raised.value.body
            assert isinstance(body, dict) and body["type"] == "error"
            assert body["error"]["type"] == "authentication_error"
            with pytest.raises(anthropic.AuthenticationError):
                wrong.messages.count_tokens(model="m", messages=_ask("Hi"))  # type: ignore[arg-type]
        with anthropic.Anthropic(base_url=live.url, api_key="sk-right", max_retries=0) as right:
            assert right.messages.count_tokens(model="m", messages=_ask("Hi")).input_tokens > 0  # type: ignore[arg-type]
        # The chat route keeps OpenAI's shape.
        chat = httpx.post(live.url + "/v1/chat/completions", headers={"x-api-key": "sk-wrong"}, json={})
        assert chat.status_code == 401 and chat.json()["error"]["code"] == "invalid_api_key"
    finally:
        live.stop()


# ---------------------------------------------------------------------------------- one cache, two APIs

def test_a_prompt_cached_by_chat_completions_is_read_by_messages(server: LiveServer,
                                                                 client: anthropic.Anthropic) -> None:
    system = f"You are a terse assistant {_nonce()}. " + "Answer with as few words as you can. " * 6
    question = "What colour is the sky?"
    chat = server.client().chat.completions.create(
        model="m", max_tokens=4, extra_body=GREEDY,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
    assert chat.usage and chat.usage.prompt_tokens_details
    assert chat.usage.prompt_tokens_details.cached_tokens < chat.usage.prompt_tokens // 2  # the template's head at most
    counted = client.messages.count_tokens(model="m", system=system, messages=_ask(question))  # type: ignore[arg-type]
    assert counted.input_tokens == chat.usage.prompt_tokens  # the same rendered prompt
    before = server.metrics().get('llama_cache_requests_total{endpoint="/v1/messages",status="200"}', 0.0)
    message = client.messages.create(model="m", max_tokens=4, extra_body=GREEDY, system=system, messages=_ask(question))  # type: ignore[arg-type]
    assert (message.usage.cache_read_input_tokens or 0) >= chat.usage.prompt_tokens - 1
    assert _text(message) == chat.choices[0].message.content
    metrics = server.metrics()
    assert metrics['llama_cache_requests_total{endpoint="/v1/messages",status="200"}'] == before + 1
    assert metrics['llama_cache_requests_total{endpoint="/v1/messages/count_tokens",status="200"}'] >= 1


def test_the_other_messages_apis_are_anthropic_404s(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as raised:
        client.messages.batches.list()
    body = raised.value.body
    assert isinstance(body, dict) and body["error"]["type"] == "not_found_error"


# ---------------------------------------------------------------------------------- a full queue, a drain

def _wait_for(condition: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_full_queue_and_a_drain_are_anthropic_overloaded_errors() -> None:
    live = LiveServer(ServerConfig(n_ctx=N_CTX, parallel=1, max_queue=1), shutdown_timeout=2.0)
    long = {"model": "m", "max_tokens": 600, "temperature": 0, "stream": True,
            "messages": _ask("Count from 1 to 1000: 1, 2, 3, 4,")}
    stopping = threading.Thread(target=live.stop)
    try:
        with httpx.stream("POST", live.url + "/v1/messages", json=long, timeout=60) as running:
            lines = running.iter_lines()
            assert next(lines) == "event: message_start"
            waiting = threading.Thread(target=lambda: httpx.post(
                live.url + "/v1/messages", json={"model": "m", "max_tokens": 1, "messages": _ask("a")}, timeout=60))
            waiting.start()
            _wait_for(lambda: live.metrics()["llama_cache_queue_depth"] == 1)
            refused = httpx.post(live.url + "/v1/messages", json={"model": "m", "max_tokens": 1, "messages": _ask("b")})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["type"] == "overloaded_error"
            with anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0) as client:
                with pytest.raises(anthropic.ServiceUnavailableError):
                    client.messages.create(model="m", max_tokens=1, messages=_ask("c"))  # type: ignore[arg-type]
            stopping.start()  # the drain: the running stream ends with an error event
            rest = list(lines)
        errors = [json.loads(line[len("data: "):]) for previous, line in zip(rest, rest[1:])
                  if previous == "event: error"]
        assert errors and errors[0]["error"]["type"] == "overloaded_error", rest[-6:]
        assert "event: message_stop" not in rest
        waiting.join(timeout=60)
    finally:
        if stopping.ident is None:  # failed before the drain began
            live.stop()
        else:
            stopping.join(timeout=60)
