"""Measuring completions: time to first token and prompt tokens evaluated, for any ``llama_cpp.Llama``;
the time of each state restore; and the machine a measurement ran on.

Used by the CLI's demo and benchmarks, and by tests that check how many tokens a cache saved.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import os
import platform
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp


@dataclass(frozen=True, slots=True)
class CompletionTiming:
    """What one streamed completion cost.

    Attributes:
        ttft_s: seconds from the call to the first streamed chunk.
        total_s: seconds until the stream ended.
        prompt_tokens_evaluated: tokens the model evaluated before it sampled the first token.
        text: the generated text.
    """

    ttft_s: float
    total_s: float
    prompt_tokens_evaluated: int
    text: str


class EvalRecorder:
    """Records the sizes of a model's ``eval`` calls, in order.

    llama-cpp-python evaluates the remaining prompt in one ``eval`` call and each generated token in
    its own, so the first call of a completion is its prompt evaluation. llama-cache's ``Llama`` skips
    ``eval`` entirely on an exact hit; it reports that through ``last_prompt_tokens_evaluated``.
    """

    def __init__(self) -> None:
        self.calls: list[int] = []

    def prompt_tokens(self, llm: llama_cpp.Llama) -> int:
        """Prompt tokens evaluated by the completion recorded since the last :meth:`clear`."""
        reported = getattr(llm, "last_prompt_tokens_evaluated", None)
        if isinstance(reported, int):
            return reported
        return self.calls[0] if self.calls else 0

    def clear(self) -> None:
        self.calls.clear()


@contextmanager
def recording_evals(llm: llama_cpp.Llama) -> Iterator[EvalRecorder]:
    """Wrap ``llm.eval`` for the duration of the block; the recorder lists each call's token count."""
    recorder = EvalRecorder()
    original = llm.eval

    def eval_and_record(tokens: Sequence[int]) -> None:
        recorder.calls.append(len(tokens))
        original(tokens)

    llm.eval = eval_and_record  # type: ignore[method-assign]
    try:
        yield recorder
    finally:
        del llm.eval  # back to the class's method


@dataclass(frozen=True, slots=True)
class RestoreTiming:
    """One ``load_state`` call: the state restored, the seconds it took and the CPU seconds its thread used.

    ``cpu_seconds`` (``time.thread_time``) counts the calling thread's own work, page faults included,
    and not the time other processes held the CPU: on a shared machine it is the steadier measure.
    """

    state: Any
    seconds: float
    cpu_seconds: float


@contextmanager
def recording_restores(llm: llama_cpp.Llama) -> Iterator[list[RestoreTiming]]:
    """Wrap ``llm.load_state`` for the duration of the block; the list gets one entry per call, in order.

    A call that raises is recorded too (a refused state costs its time as well).
    """
    restores: list[RestoreTiming] = []
    original = llm.load_state

    def load_and_record(state: Any) -> None:
        started, cpu_started = time.perf_counter(), time.thread_time()
        try:
            original(state)
        finally:
            restores.append(RestoreTiming(state, time.perf_counter() - started, time.thread_time() - cpu_started))

    llm.load_state = load_and_record  # type: ignore[method-assign]
    try:
        yield restores
    finally:
        del llm.load_state  # back to the class's method


def _consume(stream: Iterator[Any], started: float, recorder: EvalRecorder, llm: llama_cpp.Llama,
             chat: bool) -> CompletionTiming:
    first: float | None = None
    pieces: list[str] = []
    for chunk in stream:
        if first is None:
            first = time.perf_counter()
        choice = chunk["choices"][0]
        piece = choice.get("delta", {}).get("content") if chat else choice.get("text")
        if piece:
            pieces.append(piece)
    ended = time.perf_counter()
    return CompletionTiming(
        ttft_s=(first or ended) - started,
        total_s=ended - started,
        prompt_tokens_evaluated=recorder.prompt_tokens(llm),
        text="".join(pieces),
    )


def timed_completion(llm: llama_cpp.Llama, prompt: str | list[int], **kwargs: Any) -> CompletionTiming:
    """Run a streamed ``create_completion`` and measure it."""
    with recording_evals(llm) as recorder:
        started = time.perf_counter()
        stream = llm.create_completion(prompt, stream=True, **kwargs)
        return _consume(iter(stream), started, recorder, llm, chat=False)


def timed_chat_completion(llm: llama_cpp.Llama, messages: list[dict[str, str]], **kwargs: Any) -> CompletionTiming:
    """Run a streamed ``create_chat_completion`` and measure it.

    The first chunk of a chat stream (the assistant role) is produced together with the first
    generated token, so it marks the time to first token.
    """
    with recording_evals(llm) as recorder:
        started = time.perf_counter()
        stream = llm.create_chat_completion(messages=messages, stream=True, **kwargs)
        return _consume(iter(stream), started, recorder, llm, chat=True)  # type: ignore[arg-type]


def _installed_version() -> str | None:
    """llama-cache's version from the installed distribution's metadata; None when run from a checkout."""
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version("llama-cache")
    return None


def machine_conditions() -> dict[str, Any]:
    """The CPU model, logical and physical cores, memory, load average and software versions of this run.

    Every benchmark's JSON carries it under ``"machine"``, so a number is read with the conditions it was
    measured under; :func:`finish_conditions` adds the load average at the end.
    """
    import numpy

    from llama_cache.server.config import physical_cores

    cpu = "unknown"
    memory = None
    with contextlib.suppress(OSError):
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), cpu)
        memory = next((int(line.split()[1]) << 10 for line in Path("/proc/meminfo").read_text().splitlines()
                       if line.startswith("MemTotal:")), None)
    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "physical_cores": physical_cores(), "memory_bytes": memory,
            "platform": platform.platform(), "python": platform.python_version(), "numpy": numpy.__version__,
            "llama_cpp_python": llama_cpp.__version__, "llama_cache": _installed_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "load_average_start": [round(x, 2) for x in os.getloadavg()]}


def finish_conditions(machine: dict[str, Any]) -> None:
    """Record the load average at the end of the run in ``machine`` (a :func:`machine_conditions` block)."""
    machine["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
