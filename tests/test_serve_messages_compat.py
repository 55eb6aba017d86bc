"""The cases of llama.cpp's own Messages API compatibility tests (``tools/server/tests/unit/test_compat_anthropic.py``,
vendored in llama-cpp-python 0.3.36's sdist), written anew for ``llama-cache serve`` on the embedded default
model, over plain HTTP as they are.

Left out: ``test_anthropic_vision_format_accepted`` (it expects a 500 for an image sent to a text model;
this server answers 400, tested here for an image inside a tool result and in
``test_serve_messages.py``), ``test_anthropic_thinking_history_in_template`` (llama-server's
``/apply-template``), and the two that need other models (a vision model, a 7B reasoning model).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llama_cache.server import ServerConfig
from tests.live_server import LiveServer

pytestmark = pytest.mark.model

RED_PIXEL = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg=="
TOOL = {"name": "get_weather", "description": "Get the current weather in a location",
        "input_schema": {"type": "object", "properties": {"location": {"type": "string", "description": "City name"}},
                         "required": ["location"]}}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    live = LiveServer(ServerConfig(n_ctx=2048, parallel=1))
    yield live
    live.stop()


def _post(server: LiveServer, body: dict[str, Any], path: str = "/v1/messages") -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def _events(server: LiveServer, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", server.url + "/v1/messages", json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    return [json.loads(line[len("data: "):]) for line in lines]


def _message(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["type"] == "message"
    return body


def _ask(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def _tool_turns(result: dict[str, Any]) -> list[dict[str, Any]]:
    """A question, the assistant's call, and the user's message holding the call's result."""
    return [{"role": "user", "content": "What's the weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "tool_1", "name": "get_weather",
                                               "input": {"location": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tool_1", **result}]}]


def test_basic_message(server: LiveServer) -> None:
    body = _message(_post(server, {"model": "test", "max_tokens": 20, "messages": _ask("Say hello")}))
    assert body["role"] == "assistant"
    assert isinstance(body["content"], list) and body["content"]
    assert body["content"][0]["type"] == "text" and "text" in body["content"][0]
    assert body["stop_reason"] in ("end_turn", "max_tokens")
    usage = body["usage"]
    assert all(isinstance(usage[key], int) for key in ("cache_read_input_tokens", "input_tokens", "output_tokens"))
    assert usage["output_tokens"] > 0
    assert "timings" not in body


@pytest.mark.parametrize("extra", [
    {"system": "You are a helpful assistant.", "messages": _ask("Hello")},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is"},
                                               {"type": "text", "text": " the answer?"}]}]},
    {"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there!"},
                  {"role": "user", "content": "How are you?"}]},
    {"messages": _tool_turns({"content": "The weather is sunny, 25°C"})},
    {"messages": _tool_turns({"content": [{"type": "text", "text": "Sunny, "}, {"type": "text", "text": "25°C"}]})},
    {"messages": _tool_turns({"is_error": True, "content": "City not found"})},
    {"stop_sequences": ["\n", "END"], "messages": _ask("Count to 10")},
    {"temperature": 0.5, "messages": _ask("Hello")},
    {"top_p": 0.9, "messages": _ask("Hello")},
    {"top_k": 40, "messages": _ask("Hello")},
    {"thinking": {"type": "enabled", "budget_tokens": 50}, "messages": _ask("What is 2+2?")},
    {"metadata": {"user_id": "test_user_123"}, "messages": _ask("Hello")},
    {"messages": []},  # llama-server accepts an empty conversation; so does this server
], ids=["system", "multipart", "conversation", "tool_result", "tool_result_blocks", "tool_result_error",
        "stop_sequences", "temperature", "top_p", "top_k", "thinking", "metadata", "empty_messages"])
def test_accepted_requests(server: LiveServer, extra: dict[str, Any]) -> None:
    body = _message(_post(server, {"model": "test", "max_tokens": 12, **extra}))
    assert body["content"]
    if "tool_result" in json.dumps(extra):
        assert body["content"][0]["type"] == "text"


def test_tool_result_mixed_with_text(server: LiveServer) -> None:
    turns = _tool_turns({"content": "Sunny, 25°C"})
    turns[-1]["content"].insert(0, {"type": "text", "text": "Here are the results:"})
    assert _message(_post(server, {"model": "test", "max_tokens": 12, "messages": turns}))["content"]


def test_an_image_in_a_tool_result_is_a_400(server: LiveServer) -> None:
    turns = _tool_turns({"content": [{"type": "text", "text": "File: test.png"}, {"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": RED_PIXEL}}]})
    response = _post(server, {"model": "test", "max_tokens": 12, "messages": turns})
    assert response.status_code == 400  # llama-server answers 500
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "image input is not supported" in error["error"]["message"].lower()


def test_missing_messages_is_an_error(server: LiveServer) -> None:
    response = _post(server, {"model": "test", "max_tokens": 50})
    assert response.status_code == 400 and "'messages' is required" in response.json()["error"]["message"]


def test_streaming(server: LiveServer) -> None:
    # llama.cpp's harness starts a server per test; here the prompt is one no other test sends, so that
    # it is evaluated (input_tokens counts the prompt tokens not read from the cache).
    events = _events(server, {"model": "test", "max_tokens": 20, "messages": _ask("Say hello, streaming")})
    assert all("type" in event for event in events)
    kinds = [event["type"] for event in events]
    for kind in ("message_start", "content_block_start", "content_block_delta", "content_block_stop",
                 "message_delta", "message_stop"):
        assert kind in kinds
    start = next(event for event in events if event["type"] == "message_start")["message"]
    assert start["type"] == "message" and start["role"] == "assistant" and start["content"] == []
    assert start["usage"]["input_tokens"] > 0
    block = next(event for event in events if event["type"] == "content_block_start")
    assert block["index"] == 0 and block["content_block"]["type"] == "text"
    for delta in (event for event in events if event["type"] == "content_block_delta"):
        assert "index" in delta and delta["delta"]["type"] == "text_delta" and "text" in delta["delta"]
    assert next(event for event in events if event["type"] == "content_block_stop")["index"] == 0
    message_delta = next(event for event in events if event["type"] == "message_delta")
    assert message_delta["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert message_delta["usage"]["output_tokens"] > 0
    assert "timings" not in next(event for event in events if event["type"] == "message_stop")


@pytest.mark.parametrize("extra", [{}, {"system": "You are a helpful assistant."}])
def test_count_tokens(server: LiveServer, extra: dict[str, Any]) -> None:
    response = _post(server, {"model": "test", "messages": _ask("Hello world"), **extra}, "/v1/messages/count_tokens")
    assert response.status_code == 200  # no max_tokens needed
    body = response.json()
    assert isinstance(body["input_tokens"], int) and body["input_tokens"] > 0
    assert "output_tokens" not in body


def test_tool_use_with_auto_choice(server: LiveServer) -> None:
    body = _message(_post(server, {"model": "test", "max_tokens": 30, "tools": [TOOL],
                                   "messages": _ask("What's the weather in Paris?")}))
    assert body["content"]
    for block in body["content"]:
        if block["type"] == "tool_use":  # a model may call it or not
            assert body["stop_reason"] == "tool_use"
            assert block["id"] and block["name"] == "get_weather" and isinstance(block["input"], dict)


@pytest.mark.parametrize("choice", [None, {"type": "any"}])
def test_tool_streaming_and_its_block_indices(server: LiveServer, choice: dict[str, Any] | None) -> None:
    body: dict[str, Any] = {"model": "test", "max_tokens": 40, "tools": [TOOL],
                            "messages": _ask("Calculate the weather in Paris")}
    if choice is not None:
        body["tool_choice"] = choice
    events = _events(server, body)
    kinds = [event["type"] for event in events]
    assert "message_start" in kinds and "message_stop" in kinds
    starts = [event for event in events if event["type"] == "content_block_start"]
    assert [event["index"] for event in starts] == list(range(len(starts)))
    stops = [event for event in events if event["type"] == "content_block_stop"]
    assert {event["index"] for event in starts} == {event["index"] for event in stops}
    tools = [event for event in starts if event["content_block"]["type"] == "tool_use"]
    if choice is not None:
        assert tools
    for event in tools:
        assert "index" in event and event["content_block"]["name"] == "get_weather"


def test_the_anthropic_shape_differs_from_openais(server: LiveServer) -> None:
    request = {"model": "test", "max_tokens": 12, "messages": _ask("Hello")}
    openai = httpx.post(server.url + "/v1/chat/completions", json=request, timeout=120)
    anthropic = _post(server, request)
    assert openai.status_code == anthropic.status_code == 200
    chat, message = openai.json(), anthropic.json()
    assert chat["object"] == "chat.completion" and message["type"] == "message"
    assert "choices" in chat and "content" in message
    assert {"prompt_tokens", "completion_tokens"} <= set(chat["usage"])
    assert {"input_tokens", "output_tokens"} <= set(message["usage"])


def test_thinking_blocks_in_the_history_reach_the_template(tmp_path: Path) -> None:
    # A template that renders an assistant's reasoning, as reasoning models' templates do.
    template = tmp_path / "reasoning.jinja"
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m.get('reasoning_content') %}<think>{{ m['reasoning_content'] }}</think>{% endif %}"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    tool = {"name": "list_files", "description": "List files",
            "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
    call = {"type": "tool_use", "id": "call_1", "name": "list_files", "input": {"path": "."}}
    thought = {"type": "thinking", "thinking": "I should check the project structure first.", "signature": ""}

    def turns(assistant: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "Fix the bug"}, {"role": "assistant", "content": assistant},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "main.py"}]}]

    live = LiveServer(ServerConfig(n_ctx=512, parallel=1, chat_template_file=template))
    try:
        counts = []
        for assistant in ([call], [thought, call]):
            response = _post(live, {"model": "test", "messages": turns(assistant), "tools": [tool]},
                             "/v1/messages/count_tokens")
            assert response.status_code == 200, response.text
            counts.append(response.json()["input_tokens"])
        assert counts[1] > counts[0]
    finally:
        live.stop()
