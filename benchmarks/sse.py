"""Reading a streamed chat completion (server-sent events), shared by the serving benchmarks.

:func:`read_stream` turns the response's lines into one :class:`Stream`: the arrival time of every
chunk and of every content delta, the text, the last ``usage`` and ``timings`` (llama-server's) seen,
and whether the stream ended with ``[DONE]``. The synchronous and the asyncio clients share it through
:meth:`Stream.feed`, which takes one line at a time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Stream:
    """What a streamed chat completion sent, with the ``time.perf_counter()`` of each arrival.

    ``chunk_times``: every ``data:`` chunk but ``[DONE]``; ``content_times``: the chunks whose first
    choice carried content, in the order of ``parts``.
    """

    started: float = field(default_factory=time.perf_counter)
    chunk_times: list[float] = field(default_factory=list)
    content_times: list[float] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    done: bool = False

    def feed(self, line: str) -> bool:
        """Take one line of the response; False once ``[DONE]`` has arrived (lines after it are ignored)."""
        if self.done:
            return False
        if not line.startswith("data:"):
            return True
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return False
        now = time.perf_counter()
        chunk = json.loads(data)
        self.chunk_times.append(now)
        self.usage = chunk.get("usage") or self.usage
        self.timings = chunk.get("timings") or self.timings
        choices = chunk.get("choices") or []
        content = choices[0].get("delta", {}).get("content") if choices else None
        if content:
            self.content_times.append(now)
            self.parts.append(content)
        return True

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def first_content(self) -> float | None:
        """Seconds from the start to the first content delta; None if none came."""
        return self.content_times[0] - self.started if self.content_times else None


def read_stream(lines: Iterable[str], started: float | None = None) -> Stream:
    """Read ``lines`` (``response.iter_lines()``) up to ``[DONE]`` into a :class:`Stream` whose clock
    starts at ``started`` (the request's start; now when None)."""
    stream = Stream() if started is None else Stream(started=started)
    for line in lines:
        if not stream.feed(line):
            break
    return stream
