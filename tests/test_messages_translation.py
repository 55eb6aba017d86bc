"""The Messages API's translation, without a model: Anthropic bodies to chat bodies, chat answers and
chunks to Anthropic messages and events, errors to Anthropic's shape; and a fuzz loop showing that any
JSON body is either a chat request or a 400, never another failure.
"""

from __future__ import annotations

import json
import string
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llama_cache.server.anthropic import MessageEvents, StopSequences, error_body, is_messages_path, message
from llama_cache.server.anthropic_requests import chat_body
from llama_cache.server.choices import Usage
from llama_cache.server.errors import ApiError
from llama_cache.server.limits import RequestLimits
from llama_cache.server.protocol import parse_chat_request

BASE = {"model": "m", "max_tokens": 8}


def _no_stops(text: bytes = b"") -> StopSequences:
    return StopSequences([], lambda: text)


def test_system_and_string_contents_are_the_chat_messages_an_openai_client_sends() -> None:
    chat = chat_body({**BASE, "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
                      "messages": [{"role": "user", "content": "Hi"}]})
    assert chat["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert chat["max_tokens"] == 8 and chat["model"] == "m"
    assert chat_body({**BASE, "system": "", "messages": [{"role": "user", "content": "Hi"}]})["messages"] == [
        {"role": "user", "content": "Hi"}]


def test_tool_use_and_tool_result_blocks_become_tool_calls_and_tool_messages() -> None:
    chat = chat_body({**BASE, "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Look it up.", "signature": "s"},
                                          {"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "text", "text": "Here:"},
                                     {"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                      "content": [{"type": "text", "text": "no"}, {"type": "text", "text": "pe"}]}]},
    ]})
    assert chat["messages"][1:] == [
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Look it up.",
         "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "w", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "nope", "is_error": True},
        {"role": "user", "content": "Here:"},
    ]


def test_an_empty_conversation_is_one_empty_user_turn() -> None:
    assert chat_body({**BASE, "messages": []})["messages"] == [{"role": "user", "content": ""}]
    assert chat_body({**BASE, "system": "S", "messages": []})["messages"] == [
        {"role": "system", "content": "S"}, {"role": "user", "content": ""}]


@pytest.mark.parametrize("choice, expected", [
    ({"type": "auto"}, "auto"), ({"type": "none"}, "none"), ({"type": "any"}, "required"),
    ({"type": "tool", "name": "w"}, {"type": "function", "function": {"name": "w"}}),
])
def test_tools_and_tool_choice_are_the_chat_routes(choice: dict[str, Any], expected: Any) -> None:
    tool = {"name": "w", "description": "d", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}
    chat = chat_body({**BASE, "messages": [], "tools": [tool], "tool_choice": choice})
    assert chat["tools"] == [{"type": "function", "function": {"name": "w", "description": "d",
                                                                "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == expected


def test_options_are_carried_over_and_count_tokens_needs_no_max_tokens() -> None:
    chat = chat_body({**BASE, "messages": [], "stop_sequences": ["x"], "temperature": 0.5, "top_p": 0.9,
                      "top_k": 3, "stream": True, "cache_salt": "s",
                      "output_config": {"effort": "low", "format": {"type": "json_schema", "schema": {"type": "object"}}}})
    assert chat["stop"] == ["x"] and chat["temperature"] == 0.5 and chat["top_p"] == 0.9 and chat["top_k"] == 3
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True} and chat["cache_salt"] == "s"
    assert chat["response_format"]["json_schema"]["schema"] == {"type": "object"}
    counted = chat_body({"model": "m", "messages": [], "stop_sequences": ["x"]}, counting=True)
    assert "max_tokens" not in counted and "stop" not in counted


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 8, "messages": []}, "model"),
    ({"model": "m", "messages": []}, "max_tokens"),
    ({**BASE, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}]},
     "messages[0].content[0].type"),
    ({**BASE, "messages": [{"role": "assistant", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0]"),
    ({**BASE, "messages": [], "system": [{"type": "document", "source": {}}]}, "system[0]"),
    ({**BASE, "messages": [], "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({**BASE, "messages": [], "tool_choice": {"type": "any"}}, "tool_choice"),
    ({**BASE, "messages": [], "tool_choice": "auto"}, "tool_choice"),
    ({**BASE, "messages": [], "stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ({**BASE, "messages": [], "temperature": 1.5}, "temperature"),
    ({**BASE, "messages": [], "thinking": {"type": "sometimes"}}, "thinking"),
    ({**BASE, "messages": [], "tools": [{"name": "w", "input_schema": {"type": "object"}}],
      "tool_choice": {"type": "any"}, "output_config": {"format": {"type": "json_schema", "schema": {}}}},
     "output_config.format"),
])
def test_bad_fields_are_400s_naming_them(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as raised:
        chat_body(body)
    assert raised.value.status == 400 and raised.value.param == param


def test_a_completion_becomes_a_message() -> None:
    usage = {"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 7}}
    text = {"model": "m", "usage": usage, "choices": [{"message": {"role": "assistant", "content": "Hi"},
                                                       "finish_reason": "stop"}]}
    answer = message(text, _no_stops())
    assert answer["content"] == [{"type": "text", "text": "Hi"}] and answer["stop_reason"] == "end_turn"
    assert answer["usage"] == {"input_tokens": 3, "cache_read_input_tokens": 7, "cache_creation_input_tokens": 0,
                               "output_tokens": 3}
    call = {"model": "m", "usage": usage, "choices": [{"finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "w", "arguments": '{"a": 1}'}}]}}]}
    answer = message(call, _no_stops())
    assert answer["stop_reason"] == "tool_use" and len(answer["content"]) == 1
    block = answer["content"][0]
    assert block["type"] == "tool_use" and block["id"].startswith("toolu_") and block["input"] == {"a": 1}
    cut = {"model": "m", "usage": usage, "choices": [{"finish_reason": "length", "message": {
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "w", "arguments": '{"a"'}}]}}]}
    answer = message(cut, _no_stops())
    assert answer["stop_reason"] == "max_tokens" and answer["content"][0]["input"] == {}


def test_the_stop_sequence_that_ended_a_text_is_found_in_its_tokens() -> None:
    stops = StopSequences(["never", "!", " wor"], lambda: b"Hello wor")
    assert stops.reason("stop", "Hello") == ("stop_sequence", " wor")
    assert StopSequences(["!"], lambda: b"Hello").reason("stop", "Hello") == ("end_turn", None)  # an end token
    assert stops.reason("length", "Hello") == ("max_tokens", None)


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


_USAGE_CHUNK = {"model": "m", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2,
                                                        "prompt_tokens_details": {"cached_tokens": 4}}}


def _run(chunks: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    events = MessageEvents(_no_stops(), lambda: Usage(prompt_tokens=5, cached_tokens=4, prompt_known=True))
    return [event for chunk in chunks for event in events.events(chunk)]


def test_a_text_stream_becomes_anthropics_events() -> None:
    out = _run([_chunk({"role": "assistant", "content": ""}), _chunk({"content": "Hi"}), _chunk({"content": "!"}),
                _chunk({}, "stop"), _USAGE_CHUNK])
    assert [name for name, _ in out] == ["message_start", "content_block_start", "ping", "content_block_delta",
                                         "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert out[0][1]["message"]["usage"]["input_tokens"] == 1 and out[0][1]["message"]["usage"]["cache_read_input_tokens"] == 4
    assert out[-2][1] == {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                          "usage": {"input_tokens": 1, "cache_read_input_tokens": 4, "cache_creation_input_tokens": 0,
                                    "output_tokens": 2}}


def test_a_streamed_call_is_a_tool_use_block_of_input_json_deltas() -> None:
    opening = {"role": "assistant", "content": None,
               "tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "w", "arguments": ""}}]}
    out = _run([_chunk(opening), _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}),
                _chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}), _chunk({}, "tool_calls"),
                _USAGE_CHUNK])
    start = out[1][1]
    assert start["index"] == 0 and start["content_block"]["type"] == "tool_use" and start["content_block"]["name"] == "w"
    fragments = [data["delta"]["partial_json"] for name, data in out if name == "content_block_delta"]
    assert json.loads("".join(fragments)) == {"a": 1}
    assert out[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_an_empty_stream_still_has_one_text_block() -> None:
    out = _run([_chunk({"role": "assistant", "content": ""}), _chunk({}, "stop"), _USAGE_CHUNK])
    assert [name for name, _ in out][1:4] == ["content_block_start", "ping", "content_block_stop"]


def test_errors_take_anthropics_types_by_status() -> None:
    for status, kind in ((400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
                         (413, "request_too_large"), (503, "overloaded_error"), (500, "api_error")):
        assert error_body(ApiError(status, "x")) == {"type": "error", "error": {"type": kind, "message": "x"}}
    assert "tools[0].input_schema" in error_body(ApiError(400, "'tools[0].function.parameters': bad"))["error"]["message"]
    assert is_messages_path("/v1/messages") and is_messages_path("/v1/messages/count_tokens")
    assert not is_messages_path("/v1/messagesx") and not is_messages_path("/v1/chat/completions")


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=False), st.text(max_size=6),
                  st.sampled_from(["user", "assistant", "text", "tool_use", "tool_result", "image", "thinking",
                                   "auto", "any", "tool", "none", "json_schema", "w", "object"]))
_value = st.recursive(_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.sampled_from(["type", "text", "role", "content", "name", "id", "input", "tool_use_id",
                                     "input_schema", "source", "thinking", "format", "schema", "is_error"]),
                    inner, max_size=4)), max_leaves=16)
_fields = st.sampled_from(["model", "max_tokens", "messages", "system", "tools", "tool_choice", "stop_sequences",
                           "temperature", "top_p", "top_k", "stream", "metadata", "thinking", "output_config",
                           "cache_salt"] + list(string.ascii_lowercase[:3]))


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.dictionaries(_fields, _value, max_size=8), st.booleans())
def test_any_body_is_a_chat_request_or_a_400(body: dict[str, Any], counting: bool) -> None:
    body = {"model": "m", "max_tokens": 4, "messages": [], **body}
    try:
        chat = chat_body(body, counting=counting)
        parse_chat_request(chat, 512, 1000, RequestLimits())
    except ApiError as error:
        assert 400 <= error.status < 500
