"""``llama-cache serve``: an OpenAI-compatible HTTP server over one engine (:mod:`llama_cache.engine`).

A request passes, in order: :mod:`.access` (API keys, CORS) -> :mod:`.limits` (what it may cost,
checked before any work) -> :mod:`.protocol` (its fields) -> :mod:`.gate` (a place among the
``--parallel``) -> a sequence of the engine's one context, batched with the others.

- :mod:`.config`: settings from options and environment variables.
- :mod:`.errors`: the error a request is refused with (OpenAI's error body).
- :mod:`.access`: API keys and CORS, before any route.
- :mod:`.limits`: the bounds on one request's cost, and the checks that enforce them.
- :mod:`.protocol`: request validation and OpenAI-shaped error bodies.
- :mod:`.constraints`: structured outputs (JSON schemas compiled on llguidance, enforced per sequence).
- :mod:`.refusals`, :mod:`.schema_nodes`, :mod:`.schema_refusals`, :mod:`.schema_ending`,
  :mod:`.grammar_refusals`, :mod:`.ending`: why a schema or grammar is refused, and where in it.
- :mod:`.responses`: structured answers in OpenAI's shapes (a named function's call as ``tool_calls``).
- :mod:`.fronts`: the seam through which another API rides the chat route, translated per request.
- :mod:`.openai_responses`: OpenAI's Responses API over it (``/v1/responses``), server-side conversations;
  :mod:`.responses_request`: its requests checked; :mod:`.responses_shapes`: its response objects and
  stream events; :mod:`.response_store`: the stored responses (RAM, disk or Redis), bounded, expiring
  and bound to their API key.
- :mod:`.prompts`: the served tokenizer, its memo of tokenizations, a chat prompt's tokens.
- :mod:`.gate`: how many requests run at once and how many may wait.
- :mod:`.jobs`: one request's run on its worker thread, and its cancellation.
- :mod:`.choices`: a request's ``n`` choices, usage, log probabilities, echo.
- :mod:`.metrics`: the Prometheus metrics, in a registry per app.
- :mod:`.transport`: the body read (bounded in size and time), disconnects, server-sent events.
- :mod:`.utilities`: the lane ``/tokenize`` and ``/detokenize`` run on, apart from completions, bounded.
- :mod:`.service`: what a server serves: the engine, its cache tiers, the gate, the request limits.
- :mod:`.app`: the routes (Starlette), the worker threads, shutdown.
- :mod:`.connections`: the connections: the header deadline, the bound on open ones, TLS, prompt closes.

:func:`serve` runs it under uvicorn until SIGTERM or SIGINT.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from types import FrameType

from llama_cache.server.access import is_loopback
from llama_cache.server.app import DrainingServer, create_app
from llama_cache.server.connections import guarded_protocol, listening_sockets, raise_open_file_limit, tls_context
from llama_cache.server.service import Service, load_service
from llama_cache.server.config import ServerConfig

__all__ = ["DrainingServer", "ServerConfig", "Service", "create_app", "load_service", "serve"]

logger = logging.getLogger(__name__)

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def serve(config: ServerConfig, *, log_level: str = "info") -> None:
    """Load the model and serve it until SIGTERM or SIGINT, then drain and return.

    On SIGTERM uvicorn stops accepting connections, idle ones are closed at once, and it waits up to
    ``config.shutdown_timeout`` seconds for running and queued requests, then cancels the rest; the app
    then flushes the prompt cache's background writes and frees the contexts, and this function returns
    (the command then exits with status 0). HTTPS when ``config`` names a key and certificate. The
    connections are bounded as :mod:`.connections` says (header deadline, keep-alive, their number);
    the soft limit on open files is raised, within the hard one, to fit ``config.max_connections``. A
    warning is logged when the server listens beyond loopback with no API key, or when the open-file
    limit is below ``max_connections``.

    Raises:
        FileNotFoundError, ValueError: the model could not be loaded.
        OSError: the address is in use, or a TLS file cannot be read (``ssl.SSLError``: it is no key
            or certificate, or they do not match).
    """
    import uvicorn

    if not config.api_keys and not is_loopback(config.host):
        logger.warning("listening on %s with no API key: whoever reaches this address may use the model "
                       "(set --api-key-file or $LLAMA_CACHE_API_KEY)", config.host)
    tls = tls_context(config.ssl_certfile, config.ssl_keyfile) if config.ssl_certfile and config.ssl_keyfile else None
    open_files = raise_open_file_limit(config.max_connections)
    if open_files is not None and open_files < config.max_connections:
        logger.warning("the open-file limit (%d) is below --max-connections (%d): connections past it are not "
                       "accepted until others close (raise the hard limit: ulimit -Hn)", open_files,
                       config.max_connections)
    service = load_service(config)
    options = config.context_options()
    logger.info("serving %s: %d requests at once on one context of %d KV cells (shared), %d threads, "
                "flash attention %s, %s prompt cache", service.model_name, config.parallel, service.n_ctx,
                options["n_threads"], "on" if options["flash_attn"] else "off",
                " + ".join(name for name, _ in service.tiers))
    uvicorn_config = uvicorn.Config(
        create_app(service, config),
        # TLS is the protocol's (see .connections): uvicorn's own would hold a silent handshake for 60 s.
        http=guarded_protocol(config.header_timeout, config.max_connections, tls),
        ws="none",  # no WebSocket route; an upgrade would take its connection out of the protocol's hands
        timeout_keep_alive=config.keep_alive_timeout,  # type: ignore[arg-type]  # a float works (call_later)
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=config.shutdown_timeout,
    )
    # uvicorn handles SIGTERM and SIGINT while it serves, then restores the handlers it found and raises
    # each signal it caught again, for the program around it. The default handlers would then kill the
    # process with SIGTERM (or raise KeyboardInterrupt) after a clean drain; this one ends it normally.
    in_main_thread = threading.current_thread() is threading.main_thread()  # else uvicorn takes no signals
    saved = {sig: signal.signal(sig, _stop) for sig in _STOP_SIGNALS} if in_main_thread else {}
    sockets: list[socket.socket] = []
    try:
        # Bound here rather than by uvicorn, which would log its address as http:// (the TLS is the protocol's).
        sockets = listening_sockets(config.host, config.port)
        for sock in sockets:
            host, port = sock.getsockname()[:2]
            logger.info("listening on %s://%s:%d", "https" if tls else "http",
                        f"[{host}]" if ":" in host else host, port)
        DrainingServer(uvicorn_config).run(sockets=sockets)
    except _Stopped as stopped:
        logger.info("stopped by %s", stopped)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        for sock in sockets:
            sock.close()
        service.close()  # already done by the app's shutdown, unless uvicorn stopped before starting it


class _Stopped(Exception):
    """A stop signal, raised by its handler: after uvicorn's drain, or before uvicorn took the signals."""


def _stop(signum: int, frame: FrameType | None) -> None:
    raise _Stopped(signal.Signals(signum).name)
