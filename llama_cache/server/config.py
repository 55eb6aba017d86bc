"""``llama-cache serve``'s settings: command-line options, each with an environment variable.

An option given on the command line wins over its environment variable, which wins over the default.
This module imports neither the model nor the web stack, so the CLI stays quick to start.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ServerConfig", "add_serve_command", "config_from_args", "on_off", "physical_cores"]

DEFAULT_N_CTX = 4096
DEFAULT_CACHE_RAM = 2 << 30
DEFAULT_MAX_BODY_BYTES = 8 << 20
# llama-server's default slot count.
DEFAULT_PARALLEL = 4
# llama-cpp-python's default batch, and llama-server's physical batch (its logical batch of 2048 buys
# nothing on the CPU backend, and would size llama-cpp-python's logits buffer for 2048 rows).
N_BATCH = 512


def physical_cores() -> int:
    """The thread count llama.cpp's tools (``llama-server``) default to: one per physical core.

    Counts distinct sets of hyperthread siblings (llama.cpp's ``cpu_get_num_physical_cores``), at
    most the CPUs this process may run on (llama.cpp does not look at the affinity mask: in a container
    limited to 2 CPUs of a 64-core host it would start 32 threads).
    """
    siblings: set[str] = set()
    topology = Path("/sys/devices/system/cpu")
    for path in topology.glob("cpu[0-9]*/topology/thread_siblings"):
        try:
            siblings.add(path.read_text().strip())
        except OSError:
            continue
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(len(siblings) or available, available))


def on_off(text: str) -> bool:
    """``on``/``off`` (also ``true``/``false``, ``1``/``0``) as a bool.

    Raises:
        ValueError: anything else.
    """
    value = text.strip().lower()
    if value in ("on", "true", "1", "yes"):
        return True
    if value in ("off", "false", "0", "no"):
        return False
    raise ValueError(f"expected on or off, got {text!r}")


@dataclass(frozen=True)
class ServerConfig:
    """What ``llama-cache serve`` runs.

    Attributes:
        model_path: the GGUF file (None: the embedded default model).
        host, port: where to listen.
        n_ctx: each context's size in tokens.
        parallel: contexts, hence requests served at once.
        cache_ram: byte budget of the RAM prompt cache, the fastest tier.
        cache_dir: the disk tier's directory, behind RAM; None: no disk tier.
        cache_disk: byte budget of the disk tier.
        redis_url: the shared Redis tier, behind RAM and disk (``redis://host:port/db``; several
            comma-separated ``host:port`` for a cluster); None: no Redis tier.
        cache_redis: byte budget of this model's namespace in Redis.
        max_queue: requests that may wait for a context; one more is answered 503.
        model_alias: the model's name in ``/v1/models`` and responses (default: the file's stem).
        shutdown_timeout: seconds SIGTERM waits for running requests before cancelling them.
        n_threads: llama.cpp threads per context, for prompts and generation alike (None: one per
            physical core, :func:`physical_cores`, as ``llama-server``).
        flash_attn: llama.cpp's flash attention (``llama-server``'s ``auto`` enables it wherever the
            backend supports it, the CPU included).
        max_body_bytes: the largest request body accepted; a larger one is answered 413.
    """

    model_path: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    n_ctx: int = DEFAULT_N_CTX
    parallel: int = DEFAULT_PARALLEL
    cache_ram: int = DEFAULT_CACHE_RAM
    cache_dir: Path | None = None
    cache_disk: int = DEFAULT_CACHE_RAM
    redis_url: str | None = None
    cache_redis: int = DEFAULT_CACHE_RAM
    max_queue: int = 64
    model_alias: str | None = None
    shutdown_timeout: float = 30.0
    n_threads: int | None = None
    flash_attn: bool = True
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def __post_init__(self) -> None:
        if not 1 <= self.port <= 65535 and self.port != 0:
            raise ValueError(f"port must be 0..65535, got {self.port}")
        if self.n_ctx < 64:
            raise ValueError(f"n_ctx must be at least 64, got {self.n_ctx}")
        if self.parallel < 1:
            raise ValueError(f"parallel must be at least 1, got {self.parallel}")
        if self.cache_ram <= 0 or self.cache_disk <= 0 or self.cache_redis <= 0:
            raise ValueError("cache sizes must be positive")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must not be negative, got {self.max_queue}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must not be negative, got {self.shutdown_timeout}")
        if self.n_threads is not None and self.n_threads < 1:
            raise ValueError(f"n_threads must be positive, got {self.n_threads}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")

    def context_options(self) -> dict[str, Any]:
        """The keyword arguments of each context's ``Llama`` besides the model: size, threads, batch."""
        threads = self.n_threads or physical_cores()
        return {"n_ctx": self.n_ctx, "n_threads": threads, "n_threads_batch": threads, "n_batch": N_BATCH,
                "n_ubatch": N_BATCH, "flash_attn": self.flash_attn}


# option name -> (environment variable, type, help)
_OPTIONS: dict[str, tuple[str, Any, str]] = {
    "host": ("LLAMA_CACHE_HOST", str, "address to listen on (default 127.0.0.1)"),
    "port": ("LLAMA_CACHE_PORT", int, "port to listen on (default 8000)"),
    "n_ctx": ("LLAMA_CACHE_N_CTX", int, f"tokens per context (default {DEFAULT_N_CTX})"),
    "parallel": ("LLAMA_CACHE_PARALLEL", int,
                 f"contexts, i.e. requests served at once (default {DEFAULT_PARALLEL}, as llama-server)"),
    "cache_ram": ("LLAMA_CACHE_CACHE_RAM", int, "RAM prompt cache budget in bytes (default 2 GiB)"),
    "cache_dir": ("LLAMA_CACHE_CACHE_DIR", Path, "keep the prompt cache on disk in this directory"),
    "cache_disk": ("LLAMA_CACHE_CACHE_DISK", int, "disk prompt cache budget in bytes (default 2 GiB)"),
    "redis_url": ("LLAMA_CACHE_REDIS", str, "share the prompt cache through this Redis (redis://host:port/db)"),
    "cache_redis": ("LLAMA_CACHE_CACHE_REDIS", int, "Redis prompt cache budget in bytes (default 2 GiB)"),
    "max_queue": ("LLAMA_CACHE_MAX_QUEUE", int, "requests that may wait for a context before 503 (default 64)"),
    "model_alias": ("LLAMA_CACHE_MODEL_ALIAS", str, "the model's name in the API (default: the file's stem)"),
    "shutdown_timeout": ("LLAMA_CACHE_SHUTDOWN_TIMEOUT", float,
                         "seconds SIGTERM waits for running requests before cancelling them (default 30)"),
    "n_threads": ("LLAMA_CACHE_THREADS", int,
                  "llama.cpp threads per context, for prompts and generation (default: one per physical core, "
                  "as llama-server)"),
    "flash_attn": ("LLAMA_CACHE_FLASH_ATTN", on_off, "llama.cpp's flash attention, on or off (default on)"),
    "max_body_bytes": ("LLAMA_CACHE_MAX_BODY_BYTES", int,
                       f"largest request body accepted, in bytes; larger ones get 413 "
                       f"(default {DEFAULT_MAX_BODY_BYTES >> 20} MiB)"),
}
# Other spellings of an option: llama-server's name for the thread count.
_ALIASES = {"n_threads": ["--threads"], "redis_url": ["--redis"]}


def add_serve_command(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]
                      ) -> argparse.ArgumentParser:
    """Add the ``serve`` sub-command (its options default to None: see :func:`config_from_args`)."""
    serve = commands.add_parser(
        "serve",
        parents=parents,
        help="an OpenAI-compatible HTTP server with the prompt cache on",
        description="Serve one model over an OpenAI-compatible API (/v1/chat/completions, /v1/completions, "
        "/v1/models, /health, /metrics), its contexts sharing one prompt cache. Every option also "
        "reads an environment variable, named in its help.",
    )
    for name, (env, kind, text) in _OPTIONS.items():
        serve.add_argument(*_ALIASES.get(name, []), "--" + name.replace("_", "-"), dest=name, type=kind,
                           default=None, help=f"{text}; ${env}")
    return serve


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ServerConfig:
    """The settings from parsed options, then environment variables, then defaults.

    Raises:
        ValueError: a setting is out of range or an environment variable does not parse.
    """
    environ = os.environ if environ is None else environ
    values: dict[str, object] = {}
    for name, (env, kind, _) in _OPTIONS.items():
        value = getattr(args, name, None)
        if value is None and environ.get(env):
            try:
                value = kind(environ[env])
            except ValueError:
                expected = "on or off" if kind is on_off else f"a {kind.__name__}"
                raise ValueError(f"${env} must be {expected}, got {environ[env]!r}") from None
        if value is not None:
            values[name] = value
    model = getattr(args, "model", None)
    if model is None and environ.get("LLAMA_CACHE_MODEL"):
        model = Path(environ["LLAMA_CACHE_MODEL"])
    return ServerConfig(model_path=model, **values)  # type: ignore[arg-type]
