"""The serving benchmarks' reader of streamed chat completions."""

from __future__ import annotations

from benchmarks.sse import Stream, read_stream

CHUNKS = [
    ": keep-alive comment",
    'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}',
    "",
    'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}]}',
    'data: {"choices":[{"index":0,"delta":{"content":"lo"}}],"timings":{"cache_n":4,"prompt_n":2}}',
    'data: {"choices":[],"usage":{"prompt_tokens":6,"completion_tokens":2}}',
    "data: [DONE]",
    'data: {"choices":[{"index":0,"delta":{"content":"after the end"}}]}',
]


def test_a_stream_is_read_up_to_done_with_its_usage_timings_and_arrivals() -> None:
    stream = read_stream(iter(CHUNKS), started=0.0)
    assert stream.done
    assert stream.text == "Hello"
    assert len(stream.chunk_times) == 4 and len(stream.content_times) == 2  # the empty first delta is no content
    assert stream.usage == {"prompt_tokens": 6, "completion_tokens": 2}
    assert stream.timings == {"cache_n": 4, "prompt_n": 2}
    assert stream.first_content == stream.content_times[0] > 0
    assert stream.chunk_times == sorted(stream.chunk_times)


def test_a_stream_cut_before_done_says_so() -> None:
    stream = read_stream(iter(CHUNKS[:4]))
    assert not stream.done and stream.text == "Hel"


def test_feed_stops_at_done() -> None:
    stream = Stream()
    assert [stream.feed(line) for line in CHUNKS[-2:]] == [False, False]
    assert stream.first_content is None and stream.done
