"""What real OpenAI clients send, answered as the OpenAI API defines it: structured outputs, usage with
cached tokens, ``n`` choices from one prompt evaluation, log probabilities, shapes and routes.

Every test talks to a live ``llama-cache serve`` (the embedded default model) through the official
``openai`` client, or httpx where the client has no method.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import numpy as np
import openai
import pytest
from pydantic import BaseModel, Field

from llama_cache import Llama, default_model_path
from llama_cache.server import ServerConfig
from tests.live_server import LiveServer

pytestmark = pytest.mark.model

N_CTX = 1024


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    live = LiveServer(ServerConfig(n_ctx=N_CTX, parallel=2, max_queue=16))
    yield live
    live.stop()


def _nonce() -> str:
    return f"{time.monotonic_ns() % 10**9}"


def _ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# ---------------------------------------------------------------------------------- structured outputs

_SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {
        "first": {"type": "string", "maxLength": 15}, "last": {"type": "string", "maxLength": 15}},
        "required": ["first", "last"]}}, "required": ["person"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                      "count": {"type": "integer", "minimum": 1, "maximum": 5}},
     "required": ["colour", "count"]},
    {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[a-z]{2,4}$"}}, "required": ["code"]},
    {"type": "object", "properties": {"a": {"type": "string", "maxLength": 10},
                                      "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"]},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100}, {"type": "string", "maxLength": 10}]},
    {"type": "boolean"},
    {"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "integer", "minimum": -10, "maximum": 10}},
     "required": ["kind", "x"]},
    {"type": "array", "items": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99}, "tag": {"type": "string", "maxLength": 8}},
        "required": ["id", "tag"]}, "minItems": 1, "maxItems": 2},
    {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
     "minItems": 1, "maxItems": 2},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                       "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                      "required": ["x", "y"]}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}}, "required": ["a", "b"]},
    {"type": ["string", "null"], "maxLength": 10},
    {"type": "string", "minLength": 3, "maxLength": 6},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 1000},
                                      "s": {"type": "string", "maxLength": 12}},
     "required": ["ok", "n", "s"], "additionalProperties": False},
    {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]},
    {"enum": [1, 2, 3, "x", None]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"l1": {"type": "object", "properties": {"l2": {"type": "object", "properties": {
        "l3": {"type": "integer", "minimum": 0, "maximum": 5}}, "required": ["l3"]}}, "required": ["l2"]}},
     "required": ["l1"]},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30},
                                      "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                                      "genres": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                 "maxItems": 3}},
     "required": ["title", "year", "genres"]},
]


@pytest.mark.parametrize("index", range(len(_SCHEMAS)))
def test_every_strict_json_schema_answer_validates(server: LiveServer, index: int) -> None:
    schema = _SCHEMAS[index]
    client = server.client()
    response_format = {"type": "json_schema", "json_schema": {"name": f"s{index}", "schema": schema, "strict": True}}
    reply = client.chat.completions.create(
        model="m", messages=_ask("Describe a film as JSON."), max_tokens=150, temperature=0.7, seed=index,
        response_format=response_format)  # type: ignore[arg-type]
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content or ""), schema)
    # Streamed, the deltas join into an instance too.
    stream = client.chat.completions.create(
        model="m", messages=_ask("Describe a city as JSON."), max_tokens=150, temperature=0.7, seed=index,
        response_format=response_format, stream=True)  # type: ignore[arg-type]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), schema)


class Film(BaseModel):
    title: str = Field(max_length=30)
    year: int = Field(ge=1900, le=2030)
    rating: Literal["good", "bad"]


def test_parse_with_a_pydantic_model(server: LiveServer) -> None:
    completion = server.client().chat.completions.parse(
        model="m", messages=_ask("Name a film, its year and whether it is good."), response_format=Film,
        max_tokens=100, temperature=0)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Film)
    assert 1900 <= parsed.year <= 2030


class Weather(BaseModel):
    city: str = Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


class Sum(BaseModel):
    a: int = Field(ge=0, le=1000)
    b: int = Field(ge=0, le=1000)


def test_parse_with_strict_tools_and_required_tool_choice(server: LiveServer) -> None:
    tools = [openai.pydantic_function_tool(Weather), openai.pydantic_function_tool(Sum)]
    for seed in range(3):
        completion = server.client().chat.completions.parse(
            model="m", messages=_ask("What is the weather in Paris?"), tools=tools, tool_choice="required",
            max_tokens=60, temperature=0.8, seed=seed)
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls or []
        assert call.function.name in ("Weather", "Sum")
        assert isinstance(call.function.parsed_arguments, Weather if call.function.name == "Weather" else Sum)


def test_required_tool_choice_streams_one_whole_call(server: LiveServer) -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 20}}, "required": ["query"]}}}]
    stream = server.client().chat.completions.create(
        model="m", messages=_ask("Find the population of Rome."), tools=tools, tool_choice="required",  # type: ignore[arg-type]
        max_tokens=60, temperature=0, stream=True)
    chunks = [chunk for chunk in stream if chunk.choices]
    calls = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []]
    assert len(calls) == 1 and calls[0].function and calls[0].function.name == "lookup"
    jsonschema.validate(json.loads(calls[0].function.arguments or ""), tools[0]["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(("body", "code", "param"), [
    ({"response_format": {"type": "json_schema"}}, "invalid_type", "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "invalid_value",
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}, "invalid_type",
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}}, "invalid_type",
     "response_format.json_schema.strict"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "maxLength": 10**7}}}}, "limit_exceeded",
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "invalid_value", "response_format"),
    ({"tool_choice": "required"}, "invalid_value", "tool_choice"),
])
def test_bad_structured_output_requests_are_400s(server: LiveServer, body: dict[str, Any], code: str, param: str) -> None:
    response = httpx.post(server.url + "/v1/chat/completions", json={"messages": _ask("x"), **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param)


# ---------------------------------------------------------------------------------- usage

def _cached_metric(server: LiveServer) -> float:
    return server.metrics()["llama_cache_prompt_tokens_cached_total"]


def test_cached_tokens_are_zero_cold_and_the_shared_prefix_warm_and_agree_with_metrics(server: LiveServer) -> None:
    client = server.client()
    prompt = f"Note {_nonce()}: " + "the quick brown fox jumps over the lazy dog. " * 20
    before = _cached_metric(server)
    cold = client.completions.create(model="m", prompt=prompt, max_tokens=2, temperature=0)
    assert cold.usage and cold.usage.prompt_tokens_details
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert _cached_metric(server) - before == 0
    before = _cached_metric(server)
    repeat = client.completions.create(model="m", prompt=prompt, max_tokens=2, temperature=0)
    assert repeat.usage and repeat.usage.prompt_tokens_details
    assert repeat.usage.prompt_tokens_details.cached_tokens == repeat.usage.prompt_tokens
    assert _cached_metric(server) - before == repeat.usage.prompt_tokens
    # Extended: at least the shared prefix, streamed with include_usage on the chat endpoint too.
    shared = len(httpx.post(server.url + "/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"])
    before = _cached_metric(server)
    stream = client.completions.create(model="m", prompt=prompt + " And then?", max_tokens=2, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage and chunks[-1].usage.prompt_tokens_details
    assert all(chunk.usage is None for chunk in chunks[:-1])
    cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert shared - 1 <= cached < chunks[-1].usage.prompt_tokens
    assert _cached_metric(server) - before == cached


def test_chat_usage_is_streamed_last_only_when_asked(server: LiveServer) -> None:
    client = server.client()
    messages = _ask(f"Say hello {_nonce()}.")
    whole = client.chat.completions.create(model="m", messages=messages, max_tokens=5, temperature=0)
    chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=5, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None and whole.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    plain = list(client.chat.completions.create(model="m", messages=messages, max_tokens=5, temperature=0, stream=True))
    assert all(chunk.usage is None and chunk.choices for chunk in plain)


# ---------------------------------------------------------------------------------- n

def test_n_choices_share_one_prompt_evaluation_and_equal_single_requests_with_their_seeds(fresh: LiveServer) -> None:
    client = fresh.client()
    prompt = f"Story {_nonce()}: once upon a time, in a small village by the sea, there lived"
    stats = fresh.service.engine.scheduler.stats
    evaluated_before = stats.tokens
    reply = client.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=1.0, seed=1234, n=4)
    assert [choice.index for choice in reply.choices] == [0, 1, 2, 3]
    assert reply.usage and reply.usage.prompt_tokens_details
    prompt_tokens = reply.usage.prompt_tokens
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    # Evaluated: the prompt once, then each choice's sampled tokens but the last of one cut at max_tokens.
    after = stats.tokens - evaluated_before
    per_choice = reply.usage.completion_tokens - sum(1 for c in reply.choices if c.finish_reason == "length")
    assert after == prompt_tokens + per_choice
    texts = [choice.text for choice in reply.choices]
    assert len(set(texts)) > 1  # seeds 1234..1237 at temperature 1
    for index, text in enumerate(texts):
        single = client.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=1.0, seed=1234 + index)
        assert single.choices[0].text == text


@pytest.fixture
def fresh() -> Iterator[LiveServer]:
    """A server of its own, with flash attention: requests compared with each other find their cells in
    position order (in a server whose earlier sequences were freed, a sequence's cells may land out of
    order, and llama.cpp's flash attention sums them in cell order: the logits then differ in their last
    bits, as under load), and the sums over them do not depend on other sequences' cells (without flash
    attention, the CPU's matrix products group them by where they lie in the pool)."""
    live = LiveServer(ServerConfig(n_ctx=N_CTX, parallel=2, max_queue=16, flash_attn=True))
    yield live
    live.stop()


def test_n_choices_stream_with_their_indexes(fresh: LiveServer) -> None:
    client = fresh.client()
    messages = _ask(f"Name a fruit {_nonce()}.")
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=1.0, seed=7, n=3,
                                            stream=True, stream_options={"include_usage": True})
    texts: dict[int, str] = {}
    finished: list[int] = []
    usage = None
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        choice = chunk.choices[0]
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        if choice.finish_reason is not None:
            finished.append(choice.index)
    assert finished == [0, 1, 2] and sorted(texts) == [0, 1, 2]
    whole = client.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=1.0, seed=7, n=3)
    assert [c.message.content for c in whole.choices] == [texts[0], texts[1], texts[2]]
    assert usage is not None and whole.usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_n_with_structured_output_gives_every_choice_its_own_grammar(server: LiveServer) -> None:
    schema = _SCHEMAS[4]
    reply = server.client().chat.completions.create(
        model="m", messages=_ask("Pick a colour and a count."), max_tokens=60, temperature=1.0, seed=3, n=3,
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}})  # type: ignore[arg-type]
    assert len(reply.choices) == 3
    for choice in reply.choices:
        jsonschema.validate(json.loads(choice.message.content or ""), schema)


# ---------------------------------------------------------------------------------- log probabilities

def test_greedy_chat_log_probabilities_are_sorted_and_the_sampled_token_is_the_likeliest(server: LiveServer) -> None:
    reply = server.client().chat.completions.create(
        model="m", messages=_ask("Name three colours."), max_tokens=12, temperature=0, logprobs=True, top_logprobs=5)
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    content = choice.logprobs.content
    assert "".join(entry.token for entry in content) == choice.message.content
    for entry in content:
        values = [top.logprob for top in entry.top_logprobs]
        assert len(values) == 5 and values == sorted(values, reverse=True)
        assert sum(np.exp(values)) <= 1 + 1e-6
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert bytes(entry.bytes or []).decode("utf-8") == entry.token


def test_completion_log_probabilities_equal_a_direct_computation_from_the_logits(fresh: LiveServer) -> None:
    prompt = "The three primary colours are"
    reply = fresh.client().completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs and logprobs.top_logprobs
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    llama = Llama(model_path=str(default_model_path()), n_ctx=N_CTX, verbose=False,
                  **{k: v for k, v in fresh.config.context_options().items() if k != "n_ctx"})
    try:
        tokens = llama.tokenize(prompt.encode(), special=True)
        llama.eval(tokens)
        for index, (piece, value, top) in enumerate(zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs)):
            row = np.array(llama._last_logits, dtype=np.float64)  # noqa: SLF001 - the last evaluated row
            expected = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
            token = int(np.argmax(expected))
            assert llama.detokenize([token]).decode() == piece
            assert value == pytest.approx(expected[token], abs=1e-4)
            assert len(top) == 3 and piece in top  # the sampled token is always among them (legacy shape)
            for text, top_value in top.items():
                assert any(abs(expected[t] - top_value) < 1e-4 for t in np.argsort(expected)[-3:]
                           if llama.detokenize([int(t)]).decode() == text)
            if index + 1 < len(logprobs.tokens):
                llama.eval([token])
    finally:
        llama.close()


def test_log_probabilities_follow_the_penalties_and_biases_the_sampler_applied(server: LiveServer) -> None:
    client = server.client()
    prompt = "Count: one, two, three, one, two, three, one, two,"
    banned = httpx.post(server.url + "/tokenize", json={"content": " three"}).json()["tokens"][0]
    for options in ({"frequency_penalty": 1.5, "presence_penalty": 1.0},
                    {"extra_body": {"repeat_penalty": 1.8}},
                    {"logit_bias": {str(banned): -100}}):
        reply = client.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0, logprobs=5,
                                          **options)  # type: ignore[arg-type]
        logprobs = reply.choices[0].logprobs
        assert logprobs is not None and logprobs.top_logprobs and logprobs.token_logprobs
        for value, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
            assert value == max(top.values())  # greedy on the penalised row: the likeliest of it
        if "logit_bias" in options:
            assert " three" not in logprobs.tokens


def test_streamed_log_probabilities_cover_exactly_the_streamed_text(server: LiveServer) -> None:
    stream = server.client().chat.completions.create(
        model="m", messages=_ask("Write one short sentence about rain."), max_tokens=20, temperature=0,
        logprobs=True, top_logprobs=2, stop=["."], stream=True)
    text, tokens = "", ""
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            if chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
                tokens += "".join(entry.token for entry in chunk.choices[0].logprobs.content)
    assert text and tokens.startswith(text) and len(tokens) - len(text) < 8


# ---------------------------------------------------------------------------------- shapes and routes

def test_system_fingerprint_is_stable_and_in_every_chunk(server: LiveServer) -> None:
    client = server.client()
    first = client.chat.completions.create(model="m", messages=_ask("Hi"), max_tokens=2)
    second = client.completions.create(model="m", prompt="Hi", max_tokens=2)
    assert first.system_fingerprint and first.system_fingerprint.startswith("fp_")
    assert second.system_fingerprint == first.system_fingerprint
    chunks = list(client.chat.completions.create(model="m", messages=_ask("Hi"), max_tokens=2, stream=True))
    assert {chunk.system_fingerprint for chunk in chunks} == {first.system_fingerprint}
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""


def test_system_fingerprint_changes_with_the_model(server: LiveServer, tiny_model_paths: dict[str, Path]) -> None:
    other = LiveServer(ServerConfig(model_path=tiny_model_paths["mamba"], n_ctx=256, parallel=1))
    try:
        fingerprint = other.client().completions.create(model="m", prompt="Hi", max_tokens=2).system_fingerprint
    finally:
        other.stop()
    mine = server.client().completions.create(model="m", prompt="Hi", max_tokens=2).system_fingerprint
    assert fingerprint and mine and fingerprint != mine


def test_n_choices_on_a_recurrent_model_equal_single_requests(tiny_model_paths: dict[str, Path]) -> None:
    live = LiveServer(ServerConfig(model_path=tiny_model_paths["mamba"], n_ctx=256, parallel=1))
    try:
        client = live.client()
        reply = client.completions.create(model="m", prompt="Hello there, how", max_tokens=5, temperature=1.0,
                                          seed=11, n=2)
        for index, choice in enumerate(reply.choices):
            single = client.completions.create(model="m", prompt="Hello there, how", max_tokens=5, temperature=1.0,
                                               seed=11 + index)
            assert single.choices[0].text == choice.text
        # A repeat goes back to the checkpoint its sequence took before the prompt's last token.
        again = client.completions.create(model="m", prompt="Hello there, how", max_tokens=5, temperature=0)
        assert again.usage.prompt_tokens_details is not None
        assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    finally:
        live.stop()


def test_routes_without_v1_answer_as_with_it(server: LiveServer) -> None:
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0}
    with_v1 = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    without = httpx.post(server.url + "/completions", json=body, timeout=60).json()
    assert without["choices"][0]["text"] == with_v1["choices"][0]["text"]
    chat = httpx.post(server.url + "/chat/completions", json={"messages": _ask("Hi"), "max_tokens": 2}, timeout=60)
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    assert httpx.get(server.url + "/models").json() == httpx.get(server.url + "/v1/models").json()


def test_tokenize_and_detokenize_round_trip_and_refuse_bad_input(server: LiveServer) -> None:
    text = "Hello world<|im_end|> again"
    tokens = httpx.post(server.url + "/tokenize", json={"content": text}).json()["tokens"]
    pieces = httpx.post(server.url + "/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [piece["id"] for piece in pieces] == tokens
    assert "".join(piece["piece"] for piece in pieces) == text
    assert httpx.post(server.url + "/detokenize", json={"tokens": tokens}).json() == {"content": text}
    with_bos = httpx.post(server.url + "/tokenize", json={"content": text, "add_special": True}).json()["tokens"]
    assert len(with_bos) >= len(tokens)
    for path, body in (("/tokenize", {"content": 5}), ("/tokenize", {"content": "x", "add_special": "yes"}),
                       ("/detokenize", {"tokens": [-1]}), ("/detokenize", {"tokens": [10**9]}),
                       ("/detokenize", {"tokens": "abc"}), ("/tokenize", {"content": "x" * (N_CTX * 200)})):
        response = httpx.post(server.url + path, json=body)
        assert response.status_code == 400, (path, body)


def test_chat_template_file_renders_the_prompt(tmp_path: Path) -> None:
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}### assistant:")
    live = LiveServer(ServerConfig(n_ctx=N_CTX, parallel=1, chat_template_file=template))
    try:
        client = live.client()
        chat = client.chat.completions.create(model="m", messages=_ask("Name a colour."), max_tokens=6, temperature=0)
        rendered = "### user: Name a colour.\n### assistant:"
        plain = client.completions.create(model="m", prompt=rendered, max_tokens=6, temperature=0)
        assert chat.usage and plain.usage and chat.usage.prompt_tokens == plain.usage.prompt_tokens
        assert chat.choices[0].message.content == plain.choices[0].text
    finally:
        live.stop()
    with pytest.raises(ValueError):
        ServerConfig(chat_template_file=tmp_path / "missing.jinja")


# ---------------------------------------------------------------------------------- GBNF grammars

_YES_NO = 'root ::= answer "."\nanswer ::= "yes" | "no"'


def test_a_gbnf_grammar_constrains_completions_and_chat(server: LiveServer) -> None:
    for path, body in (("/v1/completions", {"prompt": "Is water wet? Answer:"}),
                       ("/v1/chat/completions", {"messages": _ask("Is water wet?")})):
        response = httpx.post(server.url + path, json={**body, "grammar": _YES_NO, "max_tokens": 10, "n": 2,
                                                         "temperature": 1.0, "seed": 5}, timeout=60)
        assert response.status_code == 200, response.text
        for choice in response.json()["choices"]:
            text = choice["text"] if "text" in choice else choice["message"]["content"]
            assert text in ("yes.", "no.") and choice["finish_reason"] == "stop"


@pytest.mark.parametrize(("grammar", "code"), [
    ("root ::= (", "invalid_schema"),
    ("root ::= missing", "invalid_schema"),
    (7, "invalid_type"),
    ("root ::= " + " | ".join(f'"w{i}"' for i in range(2000)), "limit_exceeded"),
    ("\n".join(f'r{i} ::= "a" r{i + 1}' for i in range(200)) + '\nr200 ::= "b"\nroot ::= r0', "limit_exceeded"),
])
def test_bad_grammars_are_400s(server: LiveServer, grammar: Any, code: str) -> None:
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "grammar": grammar}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == code
    both = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": _ask("x"), "grammar": _YES_NO, "response_format": {"type": "json_object"}}, timeout=60)
    assert both.status_code == 400
