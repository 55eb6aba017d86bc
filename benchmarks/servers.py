"""Starting and driving the servers the serving benchmarks compare: the shared helpers of ``serve.py``,
``serve_noisy.py``, ``serve_structured.py``, ``scale.py`` and ``responses_agent.py``.

What lives here is what more than one of those scripts needs: where llama.cpp's ``llama-server`` is
found, the command line each server is started with (:func:`server_command`, from the
:class:`Settings` every server is given alike), a server run as a subprocess for the length of a
``with`` block (:func:`running_server`), llama-cache's own counters (:func:`cache_metrics`), a free
loopback port, the order of the servers from round to round (:func:`rotation`) and the deterministic
filler prose the workloads are made of (:func:`filler_text`). Each script's own workload, summary and
table stay in the script.

Nothing here is thread-safe beyond what it says; every function is cheap but those starting a process.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from llama_cache.server.config import N_BATCH

__all__ = [
    "CACHE_METRICS",
    "DEFAULT_LLAMA_SERVER",
    "REPO",
    "WORDS",
    "Settings",
    "cache_metrics",
    "filler_text",
    "find_llama_server",
    "free_port",
    "llama_server_version",
    "percentile",
    "rotation",
    "running_process",
    "running_server",
    "serve_takes_api_key",
    "server_command",
]

REPO = Path(__file__).resolve().parents[1]
DEFAULT_LLAMA_SERVER = Path.home() / ".cache" / "llama-cache" / "llama-server" / "llama-server"
WORDS = (
    "river stone market winter garden lantern harbor copper meadow signal engine orchard valley letter "
    "thunder ribbon castle window bridge candle forest silver planet mirror island anchor feather "
    "compass velvet marble canyon blossom quarry glacier beacon timber saddle harvest falcon pepper "
    "ladder cotton violin desert shadow cradle summit walnut lagoon sparrow tunnel meadowlark"
).split()


def filler_text(rng: random.Random, words: int) -> str:
    """About ``words`` words of sentences drawn from :data:`WORDS` with ``rng``: the same text for the same seed."""
    sentences = []
    while words > 0:
        n = min(words, rng.randint(8, 16))
        sentence = " ".join(rng.choice(WORDS) for _ in range(n))
        sentences.append(sentence[0].upper() + sentence[1:] + ".")
        words -= n
    return " ".join(sentences)


def free_port() -> int:
    """A loopback TCP port free at the time of asking (another process may take it before it is bound)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile of sorted ``values``, interpolated linearly; None for no values."""
    if not values:
        return None
    k = (len(values) - 1) * q / 100
    low = int(k)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (k - low)


@contextmanager
def running_server(command: list[str], port: int, env: dict[str, str], log: Path,
                   headers: dict[str, str] | None = None) -> Iterator[str]:
    """The server's URL once ``/v1/models`` answers 200 (asked with ``headers``); SIGTERM at the end."""
    with running_process(command, port, env, log, headers) as (url, _):
        yield url


@contextmanager
def running_process(command: list[str], port: int, env: dict[str, str], log: Path,
                    headers: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """As :func:`running_server`, with the server's process (to read its memory, say)."""
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as sink:
        process = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{command[0]} exited with {process.returncode}; see {log}")
            try:
                if httpx.get(url + "/v1/models", headers=headers, timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{command[0]} did not start; see {log}")
            time.sleep(0.2)
        yield url, process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass(frozen=True)
class Settings:
    """What every server is given alike."""

    n_ctx: int
    parallel: int
    threads: int
    flash_attn: bool
    n_batch: int = N_BATCH


def server_command(name: str, model: Path, settings: Settings, port: int, llama_server: Path | None,
                   api_key: str | None = None) -> list[str] | None:
    """The command starting server ``name``; ``api_key``: given to the servers that take one (``*-key``)."""
    s = settings
    if name in ("llama-cache", "llama-cache-key"):
        key = ["--api-key", api_key] if name == "llama-cache-key" and api_key else []
        # --n-ctx is the engine's one KV pool, shared by its sequences: as llama-server's -c, n_ctx per request.
        return [sys.executable, "-m", "llama_cache.cli", "serve", "--model", str(model), "--port", str(port),
                "--n-ctx", str(s.n_ctx * s.parallel), "--parallel", str(s.parallel), "--threads", str(s.threads),
                "--flash-attn", "on" if s.flash_attn else "off", *key]  # batch: always N_BATCH
    if name == "llama-cpp-python":
        return [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--port", str(port),
                "--n_ctx", str(s.n_ctx), "--cache", "true", "--n_threads", str(s.threads),
                "--n_threads_batch", str(s.threads), "--n_batch", str(s.n_batch), "--n_ubatch", str(s.n_batch),
                "--flash_attn", str(s.flash_attn).lower(), "--logits_all", "false"]
    if name == "llama-cpp-python-defaults":  # what its users get: only the context size and the cache set
        return [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--port", str(port),
                "--n_ctx", str(s.n_ctx), "--cache", "true"]
    if name == "llama-server":
        if llama_server is None:
            return None
        # -c is the whole KV cache, split between the -np slots: each slot holds n_ctx tokens.
        return [str(llama_server), "-m", str(model), "--port", str(port), "-c", str(s.n_ctx * s.parallel),
                "-np", str(s.parallel), "-t", str(s.threads), "-tb", str(s.threads), "-b", str(s.n_batch),
                "-ub", str(s.n_batch), "-fa", "on" if s.flash_attn else "off", "--no-webui"]
    raise ValueError(name)


CACHE_METRICS = ("llama_cache_prompt_tokens_total", "llama_cache_prompt_tokens_cached_total",
                 "llama_cache_cache_hits_total", "llama_cache_cache_misses_total",
                 "llama_cache_generation_tokens_total")


def cache_metrics(url: str, headers: dict[str, str] | None = None,
                  names: tuple[str, ...] = CACHE_METRICS) -> dict[str, float] | None:
    """llama-cache's own counters after a run (by default prompt tokens requested and not evaluated,
    cache hits; ``names``: those samples); None from another server."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        response = httpx.get(url + "/metrics", headers=headers, timeout=30)
    except httpx.TransportError:
        return None
    if response.status_code != 200 or "llama_cache_prompt_tokens_total" not in response.text:
        return None
    wanted = set(names)
    return {sample.name: sample.value for family in text_string_to_metric_families(response.text)
            for sample in family.samples if sample.name in wanted}


def find_llama_server() -> Path | None:
    """llama.cpp's ``llama-server``: ``$LLAMA_SERVER`` or :data:`DEFAULT_LLAMA_SERVER` if executable, else None
    (``benchmarks/serve.py``'s docstring says how to build it)."""
    candidate = Path(os.environ.get("LLAMA_SERVER", DEFAULT_LLAMA_SERVER))
    return candidate if candidate.is_file() and os.access(candidate, os.X_OK) else None


def serve_takes_api_key(env: dict[str, str]) -> bool:
    """Whether this checkout's ``llama-cache serve`` has ``--api-key`` (its help says so; nothing is loaded)."""
    done = subprocess.run([sys.executable, "-m", "llama_cache.cli", "serve", "--help"], env=env,
                          capture_output=True, text=True, timeout=120)
    return "--api-key" in done.stdout


def llama_server_version(llama_server: Path | None) -> str | None:
    """``llama-server --version``'s line naming its build (its llama.cpp commit), or None."""
    if llama_server is None:
        return None
    done = subprocess.run([str(llama_server), "--version"], capture_output=True, text=True, timeout=60)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("version")]
    return lines[0] if lines else None


def rotation(names: list[str], round_number: int) -> list[str]:
    """The order of the servers in round ``round_number``: ``names`` rotated by one more each round, so
    that over ``len(names)`` rounds every server runs once in every position."""
    shift = round_number % len(names) if names else 0
    return names[shift:] + names[:shift]
