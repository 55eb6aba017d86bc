"""Structured outputs: the llguidance constraint on a real model, and ``llama-cache serve``'s JSON mode and tool calls.

The unit tests drive :class:`~llama_cache.server.constraints.SequenceConstraint` through
llama-cpp-python's ``logits_processor`` hook on ``llama_cache.Llama`` with the default model and check
every mask against the real logits it was applied to. The server tests call a live server with the
official ``openai`` client, among them the schemas that crash llama-cpp-python's own grammar path.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import llama_cpp
import llguidance
import numpy as np
import numpy.typing as npt
import openai
import pytest

from llama_cache import Llama, LlamaRAMCache, default_model_path
from llama_cache.server import ServerConfig
from llama_cache.server.constraints import (JSON_WHITESPACE_PATTERN, ConstraintCompiler, ConstraintError,
                                             ConstraintLimits, SchemaPart, SequenceConstraint)
from llama_cache.server.responses import structured_chunks, structured_completion
from tests.live_server import LiveServer

pytestmark = [pytest.mark.model, pytest.mark.slow]

N_CTX = 1024
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["city", "days"],
}
LONG_STRING = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 100000}}, "required": ["text"]}
LONG_PATTERN = {"type": "object", "properties": {"c": {"type": "string", "pattern": "^c{1,2000}$"}}, "required": ["c"]}
ENUM_VALUES = [f"item-{i}" for i in range(50_000)]
BIG_ENUM = {"type": "object", "properties": {"choice": {"enum": ENUM_VALUES}}, "required": ["choice"]}
PERSON_PROMPT = "Reply in JSON: an object with the name and age of a person called Ada, aged 36."


@pytest.fixture(scope="module")
def llama() -> Iterator[Llama]:
    model = Llama(model_path=str(default_model_path()), n_ctx=N_CTX, verbose=False, cache=LlamaRAMCache())
    yield model
    model.close()


@pytest.fixture(scope="module")
def compiler(llama: Llama) -> ConstraintCompiler:
    return ConstraintCompiler.for_llama(llama)


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    live = LiveServer(ServerConfig(n_ctx=N_CTX, parallel=1, max_queue=8))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    """One official client for the module, closed with it (no socket left for the garbage collector)."""
    with server.client(max_retries=0, timeout=120) as opened:
        yield opened


class Recorder:
    """A logits processor around a constraint that keeps, per call, the tokens so far and the row before and after."""

    def __init__(self, constraint: SequenceConstraint) -> None:
        self.constraint = constraint
        self.calls: list[tuple[npt.NDArray[np.intc], npt.NDArray[np.float32], npt.NDArray[np.float32]]] = []

    def __call__(self, input_ids: npt.NDArray[np.intc], scores: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        before = np.array(scores, dtype=np.float32, copy=True)
        after = self.constraint(input_ids, scores)
        self.calls.append((np.array(input_ids, copy=True), before, np.array(after, dtype=np.float32, copy=True)))
        return after


def _complete(llama: Llama, processor: Any, content: str, **options: Any) -> dict[str, Any]:
    return llama.create_chat_completion([{"role": "user", "content": content}], max_tokens=64,
                                        logits_processor=llama_cpp.LogitsProcessorList([processor]), **options)


def _matches_weather(arguments: Any) -> bool:
    return (isinstance(arguments, dict) and set(arguments) == {"city", "days"} and isinstance(arguments["city"], str)
            and len(arguments["city"]) <= 40 and type(arguments["days"]) is int and 1 <= arguments["days"] <= 14)


# ----------------------------------------------------------------------------------- the constraint

def test_the_mask_keeps_allowed_logits_blocks_the_rest_and_allows_only_the_end_once_complete(
    llama: Llama, compiler: ConstraintCompiler
) -> None:
    recorder = Recorder(compiler.compile(WEATHER))
    reply = _complete(llama, recorder, "What is the weather in Rome for the next 3 days?", temperature=0)
    text = reply["choices"][0]["message"]["content"]
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert _matches_weather(json.loads(text))
    oracle = llguidance.LLMatcher(compiler.tokenizer, llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps({**WEATHER, "additionalProperties": False}),
        overrides={"whitespace_pattern": JSON_WHITESPACE_PATTERN}), log_level=0)
    prompt_length = len(recorder.calls[0][0])
    rng = np.random.default_rng(0)
    for index, (input_ids, before, after) in enumerate(recorder.calls):
        assert len(input_ids) == prompt_length + index  # one call per sampled token, all tokens so far
        if index:
            assert oracle.consume_token(int(input_ids[-1]))
        allowed = np.flatnonzero(np.isfinite(after))
        blocked = np.flatnonzero(~np.isfinite(after))
        assert len(allowed) > 0
        np.testing.assert_array_equal(after[allowed], before[allowed])  # values kept, not just finiteness
        assert np.all(after[blocked] == -np.inf)
        # llguidance's token-by-token check (which takes no end token) agrees with the mask on a sample of
        # both sides.
        for side, expected in ((allowed, 1), (blocked, 0)):
            for token in rng.choice(side, size=min(8, len(side)), replace=False).tolist():
                if token not in compiler.end_tokens:
                    assert oracle.validate_tokens([token]) == expected, llama.detokenize([token])
    first_allowed = np.flatnonzero(np.isfinite(recorder.calls[0][2]))
    assert all(llama.detokenize([int(t)]).strip().startswith(b"{") or not llama.detokenize([int(t)]).strip()
               for t in first_allowed)
    last_allowed = np.flatnonzero(np.isfinite(recorder.calls[-1][2]))
    assert set(last_allowed.tolist()) == set(compiler.end_tokens)
    assert recorder.constraint.complete and recorder.constraint.error is None


def test_the_mask_after_an_accepted_prefix(llama: Llama, compiler: ConstraintCompiler) -> None:
    constraint = compiler.compile(WEATHER)
    prefix = llama.tokenize(b'{"city": "Par', add_bos=False)
    prompt = llama.tokenize(b"Weather?")
    row = np.zeros(llama.n_vocab(), dtype=np.float32)
    constraint(np.array(prompt, dtype=np.intc), row.copy())
    masked = constraint(np.array(prompt + prefix, dtype=np.intc), row.copy())
    allowed = {int(t) for t in np.flatnonzero(np.isfinite(masked))}
    inside_string = llama.tokenize(b"is", add_bos=False)
    assert inside_string[0] in allowed
    assert llama.tokenize(b'"', add_bos=False)[0] in allowed  # the string may close
    assert llama.tokenize(b"\n", add_bos=False)[0] not in allowed  # no raw newline inside a JSON string
    assert not allowed & set(compiler.end_tokens)
    rest = llama.tokenize(b'is", "days": 3}', add_bos=False)
    masked = constraint(np.array(prompt + prefix + rest, dtype=np.intc), row.copy())
    assert set(np.flatnonzero(np.isfinite(masked)).tolist()) == set(compiler.end_tokens)
    assert constraint.complete


def test_first_compiles_from_many_threads_at_once_read_the_vocabulary_once(llama: Llama) -> None:
    """A fresh compiler reads the vocabulary at its first compile; threads compiling together share it."""
    fresh = ConstraintCompiler(llama_cpp.llama_model_get_vocab(llama.model), llama.n_vocab())
    barrier = threading.Barrier(4)

    def first_mask(_: int) -> tuple[Any, Any]:
        barrier.wait()
        constraint = fresh.compile(WEATHER)
        return fresh.tokenizer, np.isfinite(constraint.mask(np.zeros(llama.n_vocab(), dtype=np.float32)))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(first_mask, range(4)))
    assert all(tokenizer is results[0][0] for tokenizer, _ in results)
    for _, allowed in results:
        np.testing.assert_array_equal(allowed, results[0][1])
    assert 0 < allowed.sum() < llama.n_vocab()


def test_rows_longer_or_shorter_than_the_tokenizer_vocabulary(llama: Llama, compiler: ConstraintCompiler) -> None:
    vocab = llama_cpp.llama_model_get_vocab(llama.model)
    n_vocab = llama.n_vocab()
    prompt = np.array(llama.tokenize(b"Hi"), dtype=np.intc)
    reference = compiler.compile(WEATHER)(prompt, np.zeros(n_vocab, dtype=np.float32))
    wider = ConstraintCompiler(vocab, n_vocab + 40)
    row = wider.compile(WEATHER)(prompt, np.zeros(n_vocab + 40, dtype=np.float32))
    np.testing.assert_array_equal(row[:n_vocab], reference)
    assert np.all(row[n_vocab:] == -np.inf)
    narrower = ConstraintCompiler(vocab, n_vocab - 40)
    row = narrower.compile(WEATHER)(prompt, np.zeros(n_vocab - 40, dtype=np.float32))
    np.testing.assert_array_equal(row, reference[: n_vocab - 40])


def test_a_token_the_grammar_refuses_ends_the_generation_without_raising(
    llama: Llama, compiler: ConstraintCompiler, caplog: pytest.LogCaptureFixture
) -> None:
    constraint = compiler.compile(WEATHER)
    prompt = llama.tokenize(b"Weather?")
    row = np.ones(llama.n_vocab(), dtype=np.float32)
    constraint(np.array(prompt, dtype=np.intc), row.copy())
    with caplog.at_level(logging.WARNING, logger="llama_cache.server.constraints"):
        masked = constraint(np.array(prompt + llama.tokenize(b"Hello", add_bos=False), dtype=np.intc), row.copy())
    assert constraint.error
    assert set(np.flatnonzero(np.isfinite(masked)).tolist()) == set(compiler.end_tokens)
    np.testing.assert_array_equal(masked[list(compiler.end_tokens)], 1.0)
    assert "ending the generation" in caplog.text
    later = constraint(np.array(prompt + llama.tokenize(b"Hello there", add_bos=False), dtype=np.intc), row.copy())
    assert set(np.flatnonzero(np.isfinite(later)).tolist()) == set(compiler.end_tokens)
    # A sequence that goes back (not one generation) is a failure too, never an exception.
    constraint = compiler.compile(WEATHER)
    constraint(np.array(prompt + llama.tokenize(b"{", add_bos=False), dtype=np.intc), row.copy())
    masked = constraint(np.array(prompt, dtype=np.intc), row.copy())
    assert constraint.error and "went back" in constraint.error
    assert set(np.flatnonzero(np.isfinite(masked)).tolist()) == set(compiler.end_tokens)


def test_the_first_token_of_an_exact_cached_repeat_is_constrained_too(
    llama: Llama, compiler: ConstraintCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    messages = [{"role": "user", "content": "Say hello to the world in French."}]
    for _ in range(2):  # asked again, the prompt's own state (with its logits row) is cached
        llama.create_chat_completion(messages, max_tokens=4, temperature=0)
    llama.create_chat_completion([{"role": "user", "content": "Something else entirely."}], max_tokens=2)
    rows: list[int] = []
    sample_row = llama._sample_row  # noqa: SLF001 - the stored-logits path under test

    def spy(row: Any, *args: Any, **kwargs: Any) -> int:
        rows.append(len(row))
        return sample_row(row, *args, **kwargs)

    monkeypatch.setattr(llama, "_sample_row", spy)
    constraint = compiler.compile(WEATHER)
    reply = llama.create_chat_completion(messages, max_tokens=64, temperature=0,
                                         logits_processor=llama_cpp.LogitsProcessorList([constraint]))
    assert rows, "the first token was not sampled from the stored logits"
    assert llama.last_prompt_tokens_evaluated == 0
    assert _matches_weather(json.loads(reply["choices"][0]["message"]["content"]))


def test_json_object_output_parses_greedy_and_sampled(llama: Llama, compiler: ConstraintCompiler) -> None:
    for options in ({"temperature": 0}, {"temperature": 0.8, "seed": 1234}):
        reply = _complete(llama, compiler.compile({"type": "object"}), PERSON_PROMPT, **options)
        assert isinstance(json.loads(reply["choices"][0]["message"]["content"]), dict), options


@pytest.mark.parametrize(("schema", "code", "words"), [
    ({"type": "wat"}, "invalid_schema", "wat"),
    ({"not": {"type": "string"}}, "invalid_schema", "not"),
    ({"$ref": "#/$defs/missing"}, "invalid_schema", "missing"),
    ({"type": "string", "pattern": "^(a)\\1$"}, "invalid_schema", "backreferences"),
], ids=["bad-type", "unsupported-keyword", "dangling-ref", "backreference"])
def test_invalid_or_unsupported_schemas_are_refused_naming_the_problem(
    compiler: ConstraintCompiler, schema: dict[str, Any], code: str, words: str
) -> None:
    with pytest.raises(ConstraintError) as raised:
        compiler.compile(schema)
    assert raised.value.code == code and words in str(raised.value)
    assert isinstance(raised.value, ValueError)


def test_the_compiler_takes_boolean_schemas_and_refuses_what_is_no_schema(compiler: ConstraintCompiler) -> None:
    assert compiler.compile(True).prepare()  # true: any JSON value
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(200):
        deep = {"type": "array", "items": deep}
    for schema, message in ((False, "the schema is false: no value follows it"),
                            ([1], "the schema must be an object or a boolean, not an array"),
                            ({"type": "number", "maximum": float("inf")}, "the schema holds a number that is not finite"),
                            (deep, "the schema nests too deeply to be read")):
        with pytest.raises(ConstraintError) as raised:
            compiler.compile(schema)  # type: ignore[arg-type]
        assert str(raised.value).startswith(message) and raised.value.code == "invalid_schema"


def test_a_refusal_inside_a_part_is_told_relative_to_it(compiler: ConstraintCompiler) -> None:
    schema = {"type": "object", "properties": {"inner": {"type": "object", "properties": {"a": {"not": {}}}}},
              "required": ["inner"]}
    with pytest.raises(ConstraintError) as raised:
        compiler.compile(schema, [SchemaPart(("properties", "inner"), "the.inner.field")])
    assert raised.value.field == "the.inner.field"
    assert str(raised.value) == "the schema at '#/properties/a' uses \"not\", which structured outputs do not support"
    with pytest.raises(ConstraintError) as raised:
        compiler.compile(schema)
    assert raised.value.field is None and str(raised.value).startswith("the schema at '#/properties/inner/properties/a'")


def test_schemas_past_the_limits_are_refused_as_too_complex(llama: Llama) -> None:
    vocab = llama_cpp.llama_model_get_vocab(llama.model)
    tight = ConstraintCompiler(vocab, llama.n_vocab(), ConstraintLimits(initial_lexer_fuel=10_000))
    with pytest.raises(ConstraintError) as raised:
        tight.compile({"enum": ENUM_VALUES[:2000]})
    assert raised.value.code == "schema_too_complex" and "limit" in str(raised.value)
    tight = ConstraintCompiler(vocab, llama.n_vocab(), ConstraintLimits(max_grammar_size=50))
    with pytest.raises(ConstraintError) as raised:
        tight.compile({"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(40)}})
    assert raised.value.code == "schema_too_complex"


def test_the_crashing_schemas_and_a_50000_value_enum_compile_in_bounded_time(
    llama: Llama, compiler: ConstraintCompiler
) -> None:
    prompt = np.array(llama.tokenize(b"Go"), dtype=np.intc)
    for schema in (LONG_STRING, LONG_PATTERN, BIG_ENUM):
        started = time.monotonic()
        constraint = compiler.compile(schema)
        assert time.monotonic() - started < 20
        row = constraint(prompt, np.zeros(llama.n_vocab(), dtype=np.float32))
        assert np.isfinite(row).any()
    # A string of 2,001 c's is past the pattern: the mask closes the string after 2,000.
    constraint = compiler.compile(LONG_PATTERN)
    tokens = prompt.tolist()
    constraint(prompt, np.zeros(llama.n_vocab(), dtype=np.float32))
    tokens += llama.tokenize(b'{"c": "' + b"c" * 2000, add_bos=False)
    row = constraint(np.array(tokens, dtype=np.intc), np.zeros(llama.n_vocab(), dtype=np.float32))
    assert constraint.error is None
    assert llama.tokenize(b"c", add_bos=False)[0] not in set(np.flatnonzero(np.isfinite(row)).tolist())


# ------------------------------------------------------------------------------------ answer shapes

def _chat(content: str, reason: str) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m", "usage": {"total_tokens": 3},
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None,
                         "finish_reason": reason}]}


def _chunk(delta: dict[str, Any], reason: str | None) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}


def test_answer_shapes_of_a_named_function_legacy_or_not_and_of_json_object() -> None:
    completion = _chat('{"a": 1}', "stop")
    shaped = structured_completion(completion, function="f")
    (choice,) = shaped["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "f", "arguments": '{"a": 1}'} and call["type"] == "function"
    assert {k: v for k, v in shaped.items() if k != "choices"} == {k: v for k, v in completion.items() if k != "choices"}
    assert completion["choices"][0]["message"]["content"] == '{"a": 1}'  # left as it was
    legacy = structured_completion(completion, function="f", legacy=True)["choices"][0]
    assert legacy["finish_reason"] == "function_call"
    assert legacy["message"] == {"role": "assistant", "content": None,
                                 "function_call": {"name": "f", "arguments": '{"a": 1}'}}
    assert structured_completion(completion, function=None)["choices"][0] == completion["choices"][0]
    for function in ("f", None):  # cut short by max_tokens or by the constraint: "length"
        assert structured_completion(_chat('{"a', "length"), function=function)["choices"][0]["finish_reason"] == "length"
        assert structured_completion(completion, function=function, cut_short=True)["choices"][0][
            "finish_reason"] == "length"


def test_streamed_answer_shapes() -> None:
    stream = [_chunk({"role": "assistant"}, None), _chunk({"content": '{"a"'}, None), _chunk({"content": ": 1}"}, None),
              _chunk({}, "stop")]
    shaped = list(structured_chunks(iter(stream), function="f"))
    assert len(shaped) == len(stream)
    opening = shaped[0]["choices"][0]["delta"]
    (call,) = opening["tool_calls"]
    assert opening["role"] == "assistant" and opening["content"] is None
    assert (call["index"], call["type"], call["function"]) == (0, "function", {"name": "f", "arguments": ""})
    assert [c["choices"][0]["delta"] for c in shaped[1:3]] == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}]
    assert shaped[3]["choices"][0]["delta"] == {} and shaped[3]["choices"][0]["finish_reason"] == "tool_calls"
    legacy = list(structured_chunks(iter(stream), function="f", legacy=True))
    assert legacy[0]["choices"][0]["delta"]["function_call"] == {"name": "f", "arguments": ""}
    assert legacy[1]["choices"][0]["delta"] == {"function_call": {"arguments": '{"a"'}}
    assert legacy[3]["choices"][0]["finish_reason"] == "function_call"
    assert [c["choices"][0] for c in structured_chunks(iter(stream), function=None)] == [c["choices"][0] for c in stream]
    asked: list[bool] = []
    cut = list(structured_chunks(iter(stream), function=None, cut_short=lambda: asked.append(True) or True))
    assert [c["choices"][0]["finish_reason"] for c in cut] == [None, None, None, "length"] and asked == [True]


# ---------------------------------------------------------------------------------------- the server

def _tool(name: str, schema: dict[str, Any] | None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, "description": f"the {name} function"}
    if schema is not None:
        function["parameters"] = schema
    return {"type": "function", "function": function}


def _named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def _call_arguments(reply: Any, name: str) -> Any:
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == name and call.id.startswith("call_")
    return json.loads(call.function.arguments)


def test_the_schemas_that_crash_llama_cpp_python_are_answered_and_the_server_stays_up(
    server: LiveServer, client: openai.OpenAI
) -> None:
    messages = [{"role": "user", "content": "Write the letter c a few times."}]
    for schema in (LONG_STRING, LONG_PATTERN):
        reply = client.chat.completions.create(model="m", messages=messages, tools=[_tool("write", schema)],
                                               tool_choice=_named("write"), max_tokens=48, temperature=0)
        arguments = _call_arguments(reply, "write")
        if schema is LONG_PATTERN:
            assert re.fullmatch("c{1,2000}", arguments["c"]) and set(arguments) == {"c"}
        else:
            assert isinstance(arguments["text"], str) and set(arguments) == {"text"}
    reply = client.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0)
    assert reply.choices[0].message.content
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_a_named_tool_call_streams_as_openai_does(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the weather in Rome for the next 3 days?"}]
    whole = client.chat.completions.create(model="m", messages=messages, tools=[_tool("weather", WEATHER)],
                                           tool_choice=_named("weather"), max_tokens=48, temperature=0)
    expected = whole.choices[0].message.tool_calls[0].function.arguments
    assert _matches_weather(_call_arguments(whole, "weather"))
    chunks = list(client.chat.completions.create(model="m", messages=messages, tools=[_tool("weather", WEATHER)],
                                                 tool_choice=_named("weather"), max_tokens=48, temperature=0,
                                                 stream=True))
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content is None
    (opening,) = first.tool_calls
    assert (opening.index, opening.type, opening.function.name) == (0, "function", "weather")
    assert opening.id.startswith("call_") and not opening.function.arguments
    fragments = []
    for chunk in chunks[1:-1]:
        (call,) = chunk.choices[0].delta.tool_calls
        assert call.index == 0 and call.id is None and call.function.name is None
        fragments.append(call.function.arguments)
        assert chunk.choices[0].finish_reason is None
    assert "".join(fragments) == expected
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and not chunks[-1].choices[0].delta.tool_calls


def test_a_50000_value_enum_is_refused_at_once_and_one_at_the_limit_is_answered(server: LiveServer) -> None:
    request = {"messages": [{"role": "user", "content": "Pick an item."}], "max_tokens": 24, "temperature": 0,
               "tool_choice": _named("pick")}
    refused = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                         json={**request, "tools": [_tool("pick", BIG_ENUM)]})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "limit_exceeded"
    at_limit = {"type": "object", "properties": {"choice": {"enum": ENUM_VALUES[:4096]}}, "required": ["choice"]}
    response = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                          json={**request, "tools": [_tool("pick", at_limit)]})
    assert response.status_code == 200, response.text
    arguments = json.loads(response.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])
    assert arguments["choice"] in set(ENUM_VALUES[:4096])


def test_json_object_answers_parse_greedy_and_sampled(client: openai.OpenAI) -> None:
    for options in ({"temperature": 0}, {"temperature": 0.8, "seed": 1234}):
        for stream in (False, True):
            # Tokens enough for a whole object: the claim is that the answer parses, not that it is short.
            request = {"model": "m", "messages": [{"role": "user", "content": PERSON_PROMPT}], "max_tokens": 200,
                       "response_format": {"type": "json_object"}, **options}
            if stream:
                chunks = client.chat.completions.create(**request, stream=True)
                text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
            else:
                text = client.chat.completions.create(**request).choices[0].message.content or ""
            assert isinstance(json.loads(text), dict), (options, stream, text)


def test_legacy_functions_answer_with_a_function_call(server: LiveServer) -> None:
    response = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "What is the weather in Rome for the next 3 days?"}],
        "functions": [{"name": "weather", "parameters": WEATHER}, {"name": "nothing"}],
        "function_call": {"name": "weather"}, "max_tokens": 48, "temperature": 0,
    })
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "function_call" and choice["message"]["content"] is None
    assert choice["message"]["function_call"]["name"] == "weather"
    assert _matches_weather(json.loads(choice["message"]["function_call"]["arguments"]))


def test_a_function_without_parameters_is_called_with_an_empty_object(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Ring the bell."}],
                                           tools=[_tool("ring", None)], tool_choice=_named("ring"), max_tokens=16,
                                           temperature=0)
    assert _call_arguments(reply, "ring") == {}


def test_a_constraint_that_gives_up_mid_generation_answers_length_and_the_server_stays_up(
    server: LiveServer, client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = server.service.engine.model
    tight = ConstraintCompiler(model.vocab, model.n_vocab, ConstraintLimits(max_lexer_states=200))  # ~6 tokens into the string
    monkeypatch.setattr(server.service, "constraints", tight)
    request: dict[str, Any] = {
        "model": "m", "messages": [{"role": "user", "content": "Describe the ocean in detail."}],
        "tools": [_tool("write", LONG_STRING)], "tool_choice": _named("write"), "max_tokens": 48, "temperature": 0}
    reply = client.chat.completions.create(**request)
    assert reply.choices[0].finish_reason == "length"
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.arguments.startswith('{') and not _is_json(call.function.arguments)
    chunks = list(client.chat.completions.create(**request, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.tool_calls[0].function.arguments for c in chunks[:-1]) == call.function.arguments
    monkeypatch.undo()
    # With the engine's own limits the same request writes on until max_tokens.
    arguments = client.chat.completions.create(**request).choices[0].message.tool_calls[0].function.arguments
    assert arguments.startswith(call.function.arguments) and len(arguments) > len(call.function.arguments)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_no_llama_cpp_python_grammar_is_built_for_structured_requests(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[str] = []

    def refuse(*args: Any, **kwargs: Any) -> None:
        built.append("LlamaGrammar")
        raise AssertionError("llama-cpp-python's grammar must not be built")

    monkeypatch.setattr(llama_cpp.llama_grammar.LlamaGrammar, "__init__", refuse)
    messages = [{"role": "user", "content": PERSON_PROMPT}]
    for extra in ({"response_format": {"type": "json_object"}},
                  {"tools": [_tool("weather", WEATHER)], "tool_choice": _named("weather")},
                  {"tools": [_tool("weather", WEATHER)], "tool_choice": "auto"}):
        response = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                              json={"messages": messages, "max_tokens": 8, **extra})
        assert response.status_code == 200, (extra, response.text)
    assert not built


_MESSAGES = [{"role": "user", "content": "Hi"}]
_WEATHER_TOOL = _tool("weather", WEATHER)
_BAD_TOOL_REQUESTS = [
    ({"tools": [1, 2]}, "tools", "invalid_value"),
    ({"tools": {"type": "function"}}, "tools", "invalid_type"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "invalid_value"),
    ({"tools": [_tool("has space", None)]}, "tools", "invalid_value"),
    ({"tools": [_WEATHER_TOOL, _WEATHER_TOOL]}, "tools", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]}, "tools", "invalid_value"),
    ({"tools": [_WEATHER_TOOL], "tool_choice": _named("other")}, "tool_choice", "invalid_value"),
    ({"tools": [_WEATHER_TOOL], "tool_choice": {"name": "weather"}}, "tool_choice", "invalid_value"),
    ({"tools": [_WEATHER_TOOL], "tool_choice": "any"}, "tool_choice", "invalid_value"),
    ({"tool_choice": _named("weather")}, "tool_choice", "invalid_value"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value"),  # no tool to call
    ({"functions": [{"name": "f"}], "function_call": "required"}, "function_call", "invalid_value"),  # not legacy
    ({"functions": [{"name": "f"}], "function_call": {"name": "g"}}, "function_call", "invalid_value"),
    ({"functions": [{"name": "f"}], "tools": [_WEATHER_TOOL]}, "functions", "invalid_value"),
    ({"tools": [_WEATHER_TOOL], "tool_choice": _named("weather"), "response_format": {"type": "json_object"}},
     "response_format", "invalid_value"),
    ({"tools": [_tool("f", {"not": {}})], "tool_choice": _named("f")}, "tools", "invalid_schema"),
    ({"tools": [_tool("f", {"type": "string", "pattern": "(a)\\1"})], "tool_choice": _named("f")},
     "tools", "invalid_schema"),
]


@pytest.mark.parametrize(("extra", "param", "code"), _BAD_TOOL_REQUESTS,
                         ids=[f"{i}-{param}-{code}" for i, (_, param, code) in enumerate(_BAD_TOOL_REQUESTS)])
def test_bad_tools_are_a_400_naming_the_field(server: LiveServer, extra: dict[str, Any], param: str, code: str) -> None:
    response = httpx.post(server.url + "/v1/chat/completions", json={"messages": _MESSAGES, **extra}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    assert error["message"]


def test_unconstrained_greedy_answers_are_unchanged() -> None:
    # A server of its own: a sequence's cells are then in position order, as the reference's are, so its
    # greedy answers equal the reference's bit for bit (see tests/test_serve.py's multi-turn test), with
    # flash attention on in both (off, llama.cpp's sums depend on where the cells lie: docs/engine.md).
    live = LiveServer(ServerConfig(n_ctx=N_CTX, parallel=1, max_queue=8, flash_attn=True))
    client = live.client(max_retries=0, timeout=120)
    try:
        _unconstrained_greedy_answers_are_unchanged(client)
    finally:
        live.stop()


def _unconstrained_greedy_answers_are_unchanged(client: openai.OpenAI) -> None:
    reference = Llama(model_path=str(default_model_path()), verbose=False,
                      **ServerConfig(n_ctx=N_CTX, flash_attn=True).context_options())
    try:
        messages = [{"role": "user", "content": "Name a fruit that is yellow."}]
        expected = reference.create_chat_completion(messages, max_tokens=12, temperature=0)
        with_tools = reference.create_chat_completion(messages, max_tokens=12, temperature=0, tools=[_WEATHER_TOOL],
                                                      tool_choice="auto")
    finally:
        reference.close()
    for _ in range(2):  # before and after a constrained request on the same context
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
        assert reply.choices[0].message.content == expected["choices"][0]["message"]["content"]
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0,
                                               tools=[_WEATHER_TOOL], tool_choice="auto")
        assert reply.choices[0].message.content == with_tools["choices"][0]["message"]["content"]
        client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0,
                                       response_format={"type": "json_object"})


# ------------------------------------------------------------------------- refusals: where and why

# Each refusal's message names the subschema (a JSON pointer) or the rule and line, and the reason.
_NOT_SHOWN = ("NoExtensionBias", "<non-verbose/>", "</", "/>", "Exception(", "Error(", "Traceback", "json-schema:///",
              "SearchRegex", "start:")
_SCHEMA_FIELD = "response_format.json_schema.schema"
_BAD_SCHEMAS: list[tuple[str, dict[str, Any], list[str]]] = [
    ("self-reference-required", {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
     ["the schema at '#'", "refers to itself with no way to end", 'the required property "a" at the root',
      "\"$ref\": \"#\" at '#/properties/a'"]),
    ("definitions-loop", {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
     ["the schema at '#/$defs/a'", "refers to itself with no way to end", "\"$ref\": \"#/$defs/a\" at '#/$defs/b'"]),
    ("any-of-self", {"anyOf": [{"$ref": "#"}]}, ["the schema at '#'", "refers to itself", '"anyOf"']),
    ("dangling-ref", {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
     ["the schema at '#/properties/a'", '"#/$defs/missing"', "not in the schema"]),
    ("remote-ref", {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}},
     ["the schema at '#/properties/a'", "another document"]),
    ("unknown-type", {"type": "object", "properties": {"a": {"type": "wat"}}},
     ["the schema at '#/properties/a'", '"type": "wat"', "not a JSON Schema type"]),
    ("unsupported-keyword", {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
     ["the schema at '#/properties/a'", 'uses "not"', "do not support"]),
    ("unknown-format", {"type": "object", "properties": {"day": {"type": "string", "format": "zzz"}}},
     ["the schema at '#/properties/day'", '"format": "zzz"']),
    ("invalid-pattern", {"type": "object", "properties": {"code": {"type": "string", "pattern": "(a"}}},
     ["the schema at '#/properties/code'", '"pattern" "(a"', "unclosed group"]),
    ("look-around", {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(?=x)x$"}}},
     ["the schema at '#/properties/a'", "look-around", "at character 2"]),
    ("minimum-above-maximum", {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}},
                               "required": ["n"]},
     ["the schema at '#'", 'requires the property "n"', "'#/properties/n'", "minimum (5) is greater than maximum (1)"]),
    ("lengths", {"type": "string", "minLength": 5, "maxLength": 1},
     ["the schema at '#'", "minLength (5) is greater than maxLength (1)"]),
    ("types-in-conflict", {"allOf": [{"type": "string"}, {"type": "integer"}]},
     ["the schema at '#'", '"allOf" item 0 ("type": "string")', "no type in common"]),
    ("required-unlisted", {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]},
     ["the schema at '#'", 'requires the property "b"', '"properties" do not list', '"additionalProperties"']),
    ("empty-enum", {"enum": []}, ["the schema at '#'", '"enum" is empty']),
    ("items-not-a-schema", {"type": "object", "properties": {"a": {"type": "array", "items": 5}}},
     ["the schema at '#/properties/a/items'", "is not a schema"]),
    ("minimum-not-a-number", {"type": "integer", "minimum": "a"}, ["the schema at '#'", '"minimum": "a"', "a number"]),
]


def _refusal(server: LiveServer, body: dict[str, Any], path: str = "/v1/chat/completions") -> dict[str, Any]:
    response = httpx.post(server.url + path, json={"max_tokens": 4, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert not [shown for shown in _NOT_SHOWN if shown in error["message"]], error["message"]
    return error


def _json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"messages": _MESSAGES, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


def test_a_schema_referring_to_itself_is_refused_naming_where_and_why(server: LiveServer) -> None:
    error = _refusal(server, _json_schema({"$ref": "#"}))
    assert (error["param"], error["code"]) == (_SCHEMA_FIELD, "invalid_schema")
    assert error["message"] == (f"'{_SCHEMA_FIELD}': the schema at '#' refers to itself with no way to end "
                                '("$ref": "#" at the root)')


@pytest.mark.parametrize(("schema", "words"), [case[1:] for case in _BAD_SCHEMAS], ids=[case[0] for case in _BAD_SCHEMAS])
def test_bad_schemas_are_refused_naming_where_and_why(server: LiveServer, schema: dict[str, Any], words: list[str]) -> None:
    error = _refusal(server, _json_schema(schema))
    assert (error["param"], error["code"]) == (_SCHEMA_FIELD, "invalid_schema")
    assert error["message"].startswith(f"'{_SCHEMA_FIELD}': the schema")
    assert [word for word in words if word not in error["message"]] == [], error["message"]


_BAD_GRAMMARS: list[tuple[str, str, list[str]]] = [
    ("unclosed-group", "root ::= (", ["line 1, column 11", "rule 'root'", "expected ')'"]),
    ("unclosed-string", 'root ::= "yes" | "no', ["line 1, column 21", "rule 'root'", "closing '\"'"]),
    ("bad-escape", 'root ::= "\\q"', ["line 1, column 12", "invalid escape sequence \\q"]),
    ("undefined-rule", 'root ::= answer\nanswer ::= "yes" | maybe', ["rule 'answer' (line 2)", '"maybe"', "no rule defines"]),
    ("empty", "", ["the grammar is empty", "'root'"]),
    ("no-root", 'answer ::= "yes"', ["no rule 'root'", "'answer'"]),
    ("endless", 'root ::= "a" root', ["rule 'root' (line 1)", "refers to itself with no way to end"]),
    ("endless-below-root", 'root ::= "(" x ")"\nx ::= "x" x', ["rule 'x' (line 2)", "refers to itself", "'root' needs it"]),
    ("self-only", "root ::= root", ["rule 'root' (line 1)", "refers to itself with no way to end"]),
    ("inverted-repetition", 'root ::= "a"{3,1}', ["rule 'root' (line 1)", "{3,1}", "maximum below its minimum"]),
    ("inverted-class", 'root ::= digit\ndigit ::= [9-0]', ["rule 'digit' (line 2)", "[9-0]", "not valid"]),
    ("names-clash", 'root ::= a-b a_b\na-b ::= "x"\na_b ::= "y"', ["rule 'a-b' (line 2)", "rule 'a_b' (line 3)", "rename"]),
]


@pytest.mark.parametrize(("grammar", "words"), [case[1:] for case in _BAD_GRAMMARS], ids=[case[0] for case in _BAD_GRAMMARS])
def test_bad_grammars_are_refused_naming_the_rule_line_and_why(server: LiveServer, grammar: str, words: list[str]) -> None:
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": _MESSAGES})):
        error = _refusal(server, {**body, "grammar": grammar}, path)
        assert (error["param"], error["code"]) == ("grammar", "invalid_schema")
        assert error["message"].startswith("'grammar': ")
        assert [word for word in words if word not in error["message"]] == [], error["message"]


def test_a_refused_tool_schema_names_the_function_s_parameters(server: LiveServer) -> None:
    good, bad = _tool("weather", WEATHER), _tool("broken", {"type": "object", "properties": {"x": {"not": {}}}})
    for choice, expected in ((_named("broken"), "tools[1].function.parameters"),
                             ("required", "tools[1].function.parameters")):
        error = _refusal(server, {"messages": _MESSAGES, "tools": [good, bad], "tool_choice": choice})
        assert (error["param"], error["code"]) == ("tools", "invalid_schema")
        assert error["message"] == f"'{expected}': the schema at '#/properties/x' uses \"not\", which structured " \
                                   "outputs do not support"
    looping = _tool("looping", {"$ref": "#"})
    error = _refusal(server, {"messages": _MESSAGES, "tools": [looping], "tool_choice": "required"})
    assert error["message"] == ("'tools[0].function.parameters': the schema at '#' refers to itself with no way to "
                                'end ("$ref": "#" at the root)')


def test_tool_choice_required_resolves_each_function_s_references_in_its_own_parameters(client: openai.OpenAI) -> None:
    # As Pydantic writes a model with a nested one: "#/$defs/..." is the parameters' own, not the
    # schema choosing between the functions.
    nested = {"$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                                  "required": ["city"]}},
              "type": "object", "properties": {"place": {"$ref": "#/$defs/Place"}}, "required": ["place"]}
    reply = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather in Rome?"}], max_tokens=48, temperature=0,
        tools=[_tool("weather", nested)], tool_choice="required")
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "weather"
    assert isinstance(json.loads(call.function.arguments)["place"]["city"], str)


@pytest.mark.parametrize("bad", [0, -5, 1 << 63, 2.5, True, "100"])
def test_limits_refuse_what_is_not_a_positive_int(bad: object) -> None:
    with pytest.raises(ValueError, match="step_lexer_fuel must be a positive int"):
        ConstraintLimits(step_lexer_fuel=bad)  # type: ignore[arg-type]
