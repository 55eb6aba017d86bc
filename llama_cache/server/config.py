"""``llama-cache serve``'s settings: command-line options, each with an environment variable.

An option given on the command line wins over its environment variable, which wins over the default.
This module imports neither the model nor the web stack, so the CLI stays quick to start.

Secrets (API keys, a Redis URL's password) may come from a file or the environment rather than the
command line, which every user of the machine can read (``ps``); they never appear in
:class:`ServerConfig`'s ``repr`` nor in an error message of this module.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from llama_cache.caches.redis_urls import redact_url
from llama_cache.engine.context import flash_attention_for

__all__ = ["ServerConfig", "add_serve_command", "auto_on_off", "comma_list", "config_from_args", "on_off",
           "physical_cores"]

DEFAULT_N_CTX = 4096
DEFAULT_CACHE_RAM = 2 << 30
DEFAULT_MAX_BODY_BYTES = 8 << 20
DEFAULT_MAX_MESSAGES = 1024
# llama-server's default slot count.
DEFAULT_PARALLEL = 4
DEFAULT_BODY_TIMEOUT = 30.0
DEFAULT_HEADER_TIMEOUT = 10.0
# uvicorn's keep-alive default.
DEFAULT_KEEP_ALIVE_TIMEOUT = 5.0
DEFAULT_MAX_CONNECTIONS = 1024
# Stored responses (the Responses API's store: true): a day each, 256 MiB in all, 8 MiB one.
DEFAULT_RESPONSES_TTL = 24 * 3600.0
DEFAULT_RESPONSES_STORE_BYTES = 256 << 20
DEFAULT_RESPONSES_MAX_BYTES = 8 << 20
# What a browser sends as Origin: scheme://host[:port], no path (a trailing slash never matches).
_ORIGIN = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/\s]+")
# llama-cpp-python's default batch, and llama-server's physical batch (its logical batch of 2048 buys
# nothing on the CPU backend, and would size llama-cpp-python's logits buffer for 2048 rows).
N_BATCH = 512


def physical_cores(cpus: Collection[int] | None = None, topology: Path = Path("/sys/devices/system/cpu")) -> int:
    """The thread count llama.cpp's tools (``llama-server``) default to: one per physical core.

    Counts the distinct sets of hyperthread siblings (as llama.cpp's ``cpu_get_num_physical_cores``)
    among the CPUs this process may run on only: llama.cpp looks at every CPU of the host, so in a
    container limited to 2 CPUs of a 64-core host it would start 32 threads; and two siblings of one
    core are one core. Without a readable topology, every CPU counts.

    Args:
        cpus: the CPU numbers to count (default: this process's affinity mask, else every CPU).
        topology: sysfs's CPU folder (holding ``cpu<N>/topology/thread_siblings``).
    """
    if cpus is None:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    siblings: set[str] = set()
    for cpu in cpus:
        try:
            siblings.add(topology.joinpath(f"cpu{cpu}", "topology", "thread_siblings").read_text().strip())
        except OSError:
            return max(1, len(cpus))
    return max(1, len(siblings))


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


def auto_on_off(text: str) -> str | bool:
    """``auto``, or :func:`on_off`'s ``on``/``off`` as a bool (``auto`` stays the string, so that an
    option given as ``auto`` is told apart from one not given).

    Raises:
        ValueError: anything else.
    """
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return on_off(text)
    except ValueError:
        raise ValueError(f"expected auto, on or off, got {text!r}") from None


def comma_list(text: str) -> tuple[str, ...]:
    """``a, b,c`` as ``("a", "b", "c")``: items stripped, empty ones dropped."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


@dataclass(frozen=True)
class ServerConfig:
    """What ``llama-cache serve`` runs.

    Attributes:
        model_path: the GGUF file (None: the embedded default model).
        host, port: where to listen.
        n_ctx: the KV cells of the one context, shared by every request (one may use them all).
        parallel: requests served at once, each a sequence batched with the others.
        deterministic: a greedy answer is the same alone or under any load, bit for bit (see
            :class:`llama_cache.Engine`): each request's KV is a stream of ``n_ctx / parallel`` cells
            of its own and its rows are decoded apart, at a throughput cost.
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
        redis_write_through: with a Redis tier, a completion's state is stored in every tier before the
            stream's last chunk goes out, so the next turn finds it on any instance (off: written behind,
            the last chunk at once).
        flash_attn: llama.cpp's flash attention; None (auto): on (a sequence's rows skip the other
            conversations' cells in the shared pool; off is refused with ``deterministic``:
            docs/engine.md, "Flash attention").
        max_body_bytes: the largest request body accepted; a larger one is answered 413.
        max_messages: the most messages one chat request may hold; more are answered 400
            (``limit_exceeded``). The other limits on a request are in :mod:`.limits`.
        body_timeout: seconds a request's whole body may take to arrive; a slower one is answered 408.
        header_timeout: seconds a request's headers may take, from the connection's opening (TLS
            handshake included) or, on a keep-alive connection, from the previous response's end; past
            them the connection is closed (after a 408 if part of a request came). See :mod:`.connections`.
        keep_alive_timeout: seconds an idle keep-alive connection is kept between requests; at most
            ``header_timeout``, which bounds that wait too.
        max_connections: connections served at once; one more is answered 503 at once and closed.
        api_keys: the keys a request may present (``Authorization: Bearer KEY`` or ``X-Api-Key: KEY``),
            each of visible ASCII characters; empty: no key is asked for. ``/health`` never asks.
        metrics_public: ``/metrics`` answers without a key when keys are set.
        cache_shared_across_keys: with API keys, every key's requests share one prompt cache, as
            without keys (a key's client can then tell, from ``cached_tokens`` and the time to the first
            token, which prompts another key sent); off (the default): a cache namespace per key.
        cors_origins: the origins (``scheme://host[:port]``, or ``*`` for any) whose pages a browser
            lets call the API; empty: no CORS headers, browsers allow only same-origin pages.
        ssl_keyfile, ssl_certfile: a PEM private key and certificate chain to serve HTTPS with; both
            or neither.
        chat_template_file: a Jinja2 chat template to render chat prompts with, instead of the one
            the GGUF carries (for a model whose template is missing or wrong).
        responses_ttl: seconds a stored response (the Responses API's ``store``) is kept.
        responses_store_bytes: bytes the stored responses may take in all (in Redis with ``redis_url``,
            on disk under ``cache_dir`` otherwise, else in RAM); the oldest are dropped first.
        responses_max_bytes: the largest stored response; a larger one is not stored.

    ``repr`` shows how many API keys there are, never a key, and the Redis URL without its password.

    Raises:
        ValueError: a setting is out of range, an API key or origin malformed, only one of the TLS
            files given or one of them missing.
        TypeError: ``api_keys`` or ``cors_origins`` given as one string rather than a sequence.
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
    flash_attn: bool | None = None
    deterministic: bool = False
    redis_write_through: bool = True
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_messages: int = DEFAULT_MAX_MESSAGES
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    keep_alive_timeout: float = DEFAULT_KEEP_ALIVE_TIMEOUT
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    api_keys: tuple[str, ...] = ()
    metrics_public: bool = False
    cache_shared_across_keys: bool = False
    cors_origins: tuple[str, ...] = ()
    ssl_keyfile: Path | None = None
    ssl_certfile: Path | None = None
    chat_template_file: Path | None = None
    responses_ttl: float = DEFAULT_RESPONSES_TTL
    responses_store_bytes: int = DEFAULT_RESPONSES_STORE_BYTES
    responses_max_bytes: int = DEFAULT_RESPONSES_MAX_BYTES

    def __post_init__(self) -> None:
        if not 1 <= self.port <= 65535 and self.port != 0:
            raise ValueError(f"port must be 0..65535, got {self.port}")
        if self.n_ctx < 64:
            raise ValueError(f"n_ctx must be at least 64, got {self.n_ctx}")
        if self.parallel < 1:
            raise ValueError(f"parallel must be at least 1, got {self.parallel}")
        if self.cache_ram <= 0 or self.cache_disk <= 0 or self.cache_redis <= 0:
            raise ValueError("cache sizes must be positive")
        if self.responses_store_bytes <= 0 or self.responses_max_bytes <= 0:
            raise ValueError("the stored responses' sizes must be positive")
        if isinstance(self.responses_ttl, bool) or not isinstance(self.responses_ttl, (int, float)) or not (
                math.isfinite(self.responses_ttl) and self.responses_ttl > 0):
            raise ValueError(f"responses_ttl must be a positive number of seconds, got {self.responses_ttl!r}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must not be negative, got {self.max_queue}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must not be negative, got {self.shutdown_timeout}")
        if self.n_threads is not None and self.n_threads < 1:
            raise ValueError(f"n_threads must be positive, got {self.n_threads}")
        flash_attention_for(self.flash_attn, self.deterministic)
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")
        if self.max_messages < 1:
            raise ValueError(f"max_messages must be positive, got {self.max_messages}")
        for name in ("body_timeout", "header_timeout", "keep_alive_timeout"):
            seconds = getattr(self, name)
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
                    math.isfinite(seconds) and seconds > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {seconds!r}")
        if self.keep_alive_timeout > self.header_timeout:
            raise ValueError(f"keep_alive_timeout ({self.keep_alive_timeout:g} s) must not exceed header_timeout "
                             f"({self.header_timeout:g} s), which bounds the wait for a keep-alive connection's "
                             f"next request too: raise header_timeout as well")
        if isinstance(self.max_connections, bool) or not isinstance(self.max_connections, int) or (
                self.max_connections < 1):
            raise ValueError(f"max_connections must be a positive integer, got {self.max_connections!r}")
        for name in ("api_keys", "cors_origins"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise TypeError(f"{name} is a sequence of strings, not one string")
            object.__setattr__(self, name, tuple(value))
        for key in self.api_keys:  # the messages never quote a key
            if not isinstance(key, str) or not key or not all("!" <= char <= "~" for char in key):
                raise ValueError("an API key must be a non-empty string of visible ASCII characters "
                                 "(no spaces or control characters)")
        for origin in self.cors_origins:
            if origin != "*" and not _ORIGIN.fullmatch(origin):
                raise ValueError(f"a CORS origin is scheme://host[:port] (no path, no trailing slash) or *, "
                                 f"got {origin!r}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile and ssl_certfile go together: give both or neither")
        for name in ("ssl_keyfile", "ssl_certfile", "chat_template_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name} {path} is not a file")

    def __repr__(self) -> str:
        shown = []
        for spec in fields(self):
            value = getattr(self, spec.name)
            if spec.name == "api_keys":
                text = f"<{len(value)} hidden>"
            elif spec.name == "redis_url" and value is not None:
                text = repr(redact_url(value))
            else:
                text = repr(value)
            shown.append(f"{spec.name}={text}")
        return f"{type(self).__name__}({', '.join(shown)})"

    def context_options(self) -> dict[str, Any]:
        """The keyword arguments of each context's ``Llama`` besides the model: size, threads, batch."""
        threads = self.n_threads or physical_cores()
        return {"n_ctx": self.n_ctx, "n_threads": threads, "n_threads_batch": threads, "n_batch": N_BATCH,
                "n_ubatch": N_BATCH, "flash_attn": flash_attention_for(self.flash_attn, self.deterministic)}


# option name -> (environment variable, type, help)
_OPTIONS: dict[str, tuple[str, Any, str]] = {
    "host": ("LLAMA_CACHE_HOST", str, "address to listen on (default 127.0.0.1)"),
    "port": ("LLAMA_CACHE_PORT", int, "port to listen on (default 8000)"),
    "n_ctx": ("LLAMA_CACHE_N_CTX", int, f"KV cells of the one context, shared by every request; one request may "
                                        f"use all of them, as llama-server's -c with --kv-unified (default "
                                        f"{DEFAULT_N_CTX}; earlier versions: per context)"),
    "parallel": ("LLAMA_CACHE_PARALLEL", int,
                 f"requests served at once, each a sequence batched with the others (default {DEFAULT_PARALLEL}, "
                 f"as llama-server)"),
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
                  "llama.cpp threads, for prompts and generation (default: one per physical core, "
                  "as llama-server)"),
    "flash_attn": ("LLAMA_CACHE_FLASH_ATTN", auto_on_off,
                   "llama.cpp's flash attention: auto, on or off (default auto: on, as llama-server's: each "
                   "request's rows skip the other conversations' cells in the shared pool; "
                   "--deterministic needs it on)"),
    "redis_write_through": ("LLAMA_CACHE_REDIS_WRITE_THROUGH", on_off,
                            "with --redis: store a completion's state in Redis before its last chunk, on or off "
                            "(default on: the next turn finds it on any instance)"),
    "max_body_bytes": ("LLAMA_CACHE_MAX_BODY_BYTES", int,
                       f"largest request body accepted, in bytes; larger ones get 413 "
                       f"(default {DEFAULT_MAX_BODY_BYTES >> 20} MiB)"),
    "max_messages": ("LLAMA_CACHE_MAX_MESSAGES", int,
                     f"most messages in one chat request; more get 400 (default {DEFAULT_MAX_MESSAGES})"),
    "body_timeout": ("LLAMA_CACHE_BODY_TIMEOUT", float,
                     f"seconds a request body may take to arrive; slower ones get 408 "
                     f"(default {DEFAULT_BODY_TIMEOUT:g})"),
    "header_timeout": ("LLAMA_CACHE_HEADER_TIMEOUT", float,
                       f"seconds a connection may take to send a request's headers, from its opening or the "
                       f"previous response's end; slower ones are closed (default {DEFAULT_HEADER_TIMEOUT:g})"),
    "keep_alive_timeout": ("LLAMA_CACHE_KEEP_ALIVE_TIMEOUT", float,
                           f"seconds an idle keep-alive connection is kept between requests, at most "
                           f"--header-timeout (default {DEFAULT_KEEP_ALIVE_TIMEOUT:g})"),
    "max_connections": ("LLAMA_CACHE_MAX_CONNECTIONS", int,
                        f"connections served at once; one more is answered 503 and closed "
                        f"(default {DEFAULT_MAX_CONNECTIONS})"),
    # A flag on the command line (bool), on or off in the environment.
    "deterministic": ("LLAMA_CACHE_DETERMINISTIC", bool,
                      "a greedy answer is the same alone or under any load, bit for bit: each request's KV is "
                      "n_ctx/parallel cells of its own and its rows are decoded apart from the others' "
                      "(slower; default off: answers may differ slightly with the load, as llama-server's)"),
    "metrics_public": ("LLAMA_CACHE_METRICS_PUBLIC", bool, "serve /metrics without a key when keys are set"),
    "cache_shared_across_keys": ("LLAMA_CACHE_CACHE_SHARED_ACROSS_KEYS", bool,
                                 "let every API key's requests share one prompt cache (default: one per key; "
                                 "shared, a key's client can tell from cached_tokens and timing which prompts "
                                 "other keys sent)"),
    "cors_origins": ("LLAMA_CACHE_CORS_ORIGINS", comma_list,
                     "origins whose pages browsers may let call the API, comma-separated, or * for any "
                     "(default: none)"),
    "ssl_keyfile": ("LLAMA_CACHE_SSL_KEYFILE", Path, "serve HTTPS with this PEM private key (and --ssl-certfile)"),
    "ssl_certfile": ("LLAMA_CACHE_SSL_CERTFILE", Path,
                     "serve HTTPS with this PEM certificate chain (and --ssl-keyfile)"),
    "chat_template_file": ("LLAMA_CACHE_CHAT_TEMPLATE_FILE", Path,
                           "render chat prompts with this Jinja2 template instead of the model's own"),
    "responses_ttl": ("LLAMA_CACHE_RESPONSES_TTL", float,
                      f"seconds a stored response (/v1/responses, store: true) is kept "
                      f"(default {DEFAULT_RESPONSES_TTL:g})"),
    "responses_store_bytes": ("LLAMA_CACHE_RESPONSES_STORE_BYTES", int,
                              "bytes the stored responses may take in all, in Redis with --redis, else on disk "
                              "with --cache-dir, else in RAM (default 256 MiB)"),
    "responses_max_bytes": ("LLAMA_CACHE_RESPONSES_MAX_BYTES", int,
                            "the largest stored response in bytes; a larger one is not stored (default 8 MiB)"),
}
# Other spellings of an option: llama-server's name for the thread count.
_ALIASES = {"n_threads": ["--threads"], "redis_url": ["--redis"]}
# Read by config_from_args itself: secrets, which the command line is a poor place for.
_API_KEY_ENV = "LLAMA_CACHE_API_KEY"
_API_KEY_FILE_ENV = "LLAMA_CACHE_API_KEY_FILE"
_REDIS_URL_FILE_ENV = "LLAMA_CACHE_REDIS_URL_FILE"


def add_serve_command(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]
                      ) -> argparse.ArgumentParser:
    """Add the ``serve`` sub-command (its options default to None: see :func:`config_from_args`)."""
    serve = commands.add_parser(
        "serve",
        parents=parents,
        help="an OpenAI-compatible HTTP server with the prompt cache on",
        description="Serve one model over an OpenAI-compatible API (/v1/chat/completions, /v1/completions, "
        "/v1/responses, "
        "/v1/models, /health, /metrics), its contexts sharing one prompt cache. Every option also "
        "reads an environment variable, named in its help.",
    )
    for name, (env, kind, text) in _OPTIONS.items():
        flags = [*_ALIASES.get(name, []), "--" + name.replace("_", "-")]
        if kind is bool:
            serve.add_argument(*flags, dest=name, action="store_const", const=True, default=None,
                               help=f"{text}; ${env} (on or off)")
        else:
            serve.add_argument(*flags, dest=name, type=kind, default=None, help=f"{text}; ${env}")
    serve.add_argument("--api-key", dest="api_key", action="append", default=None, metavar="KEY",
                       help="ask every request but /health for this key, as 'Authorization: Bearer KEY' or "
                       "'X-Api-Key: KEY'; repeatable. The command line is visible to every user (ps): prefer "
                       f"--api-key-file or ${_API_KEY_ENV} (comma-separated keys)")
    serve.add_argument("--api-key-file", dest="api_key_file", type=Path, default=None, metavar="PATH",
                       help="also accept the keys in this file, one a line (blank lines and lines starting "
                       f"with # are skipped); ${_API_KEY_FILE_ENV}")
    serve.add_argument("--redis-url-file", dest="redis_url_file", type=Path, default=None, metavar="PATH",
                       help=f"read the Redis URL (--redis), password included, from this file; ${_REDIS_URL_FILE_ENV}")
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
            parse = on_off if kind is bool else kind
            try:
                value = parse(environ[env])
            except ValueError:
                expected = {on_off: "on or off", auto_on_off: "auto, on or off"}.get(parse, f"a {kind.__name__}")
                raise ValueError(f"${env} must be {expected}, got {environ[env]!r}") from None
        if value == "auto" and kind is auto_on_off:
            continue  # the default
        if value is not None:
            values[name] = value
    values["api_keys"] = _api_keys(args, environ)
    url_file = getattr(args, "redis_url_file", None)
    if url_file is not None:
        if getattr(args, "redis_url", None) is not None:
            raise ValueError("give --redis or --redis-url-file, not both")
        values["redis_url"] = _read_redis_url(url_file)
    elif getattr(args, "redis_url", None) is None and environ.get(_REDIS_URL_FILE_ENV):
        if environ.get(_OPTIONS["redis_url"][0]):
            raise ValueError(f"give ${_OPTIONS['redis_url'][0]} or ${_REDIS_URL_FILE_ENV}, not both")
        values["redis_url"] = _read_redis_url(Path(environ[_REDIS_URL_FILE_ENV]))
    model = getattr(args, "model", None)
    if model is None and environ.get("LLAMA_CACHE_MODEL"):
        model = Path(environ["LLAMA_CACHE_MODEL"])
    return ServerConfig(model_path=model, **values)  # type: ignore[arg-type]


def _api_keys(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[str, ...]:
    """The keys given directly (``--api-key``, else ``$LLAMA_CACHE_API_KEY``) plus those of the key file
    (``--api-key-file``, else ``$LLAMA_CACHE_API_KEY_FILE``), each once.

    Raises:
        ValueError: the variable holds only commas, or the file cannot be read or holds no key.
    """
    keys = list(getattr(args, "api_key", None) or [])
    if not keys and environ.get(_API_KEY_ENV):
        keys = list(comma_list(environ[_API_KEY_ENV]))
        if not keys:
            raise ValueError(f"${_API_KEY_ENV} holds no key")
    path = getattr(args, "api_key_file", None)
    if path is None and environ.get(_API_KEY_FILE_ENV):
        path = Path(environ[_API_KEY_FILE_ENV])
    if path is not None:
        lines = _secret_lines(path, "API key file")
        if not lines:
            raise ValueError(f"the API key file {path} holds no key")
        for number, line in lines:  # the message names the line, never its text
            if any(char.isspace() for char in line):
                raise ValueError(f"line {number} of the API key file {path} is not one key: it holds a space")
        keys += [line for _, line in lines]
    return tuple(dict.fromkeys(keys))


def _read_redis_url(path: Path) -> str:
    """The one URL in ``path``.

    Raises:
        ValueError: the file cannot be read, or does not hold exactly one non-comment line.
    """
    lines = _secret_lines(path, "Redis URL file")
    if len(lines) != 1:
        raise ValueError(f"the Redis URL file {path} must hold one URL on one line, not {len(lines)} lines")
    return lines[0][1]


def _secret_lines(path: Path, what: str) -> list[tuple[int, str]]:
    """``path``'s lines (number, text) stripped, but for blank ones and those starting with ``#``.

    Raises:
        ValueError: the file cannot be read or is not UTF-8 text.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"cannot read the {what} {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise ValueError(f"the {what} {path} is not UTF-8 text") from None
    stripped = ((number, line.strip()) for number, line in enumerate(text.splitlines(), start=1))
    return [(number, line) for number, line in stripped if line and not line.startswith("#")]
