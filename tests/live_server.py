"""A live ``llama-cache serve`` app for tests: uvicorn in a background thread on a free loopback port.

The app gets the whole :class:`ServerConfig` (keys, CORS, limits), its connections ``serve``'s protocol
(header deadline, keep-alive, their number); the server listens on loopback, on a free port, whatever
the config's ``host`` and ``port``, over plain HTTP whatever its TLS files, or HTTPS with the TLS context
given.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from typing import Any

import httpx
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from llama_cache.server import DrainingServer, ServerConfig, create_app, load_service
from llama_cache.server.connections import TLS_SHUTDOWN_TIMEOUT, guarded_protocol

__all__ = ["LiveServer", "free_port", "rss_bytes"]


def rss_bytes() -> int:
    """This process's resident set size (the in-process servers' memory included)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LiveServer:
    """uvicorn serving an app in a background thread on a free loopback port.

    :meth:`client` and :meth:`metrics` present the config's first API key, if it has any. The clients
    :meth:`client` makes are closed by :meth:`stop`: one left to the garbage collector would close its
    pooled sockets with a ResourceWarning during whichever test happens to run then.
    """

    def __init__(self, config: ServerConfig, shutdown_timeout: float = 5.0, tls: ssl.SSLContext | None = None,
                 tls_shutdown_timeout: float = TLS_SHUTDOWN_TIMEOUT) -> None:
        self.port = free_port()
        self.config = config
        self._clients: list[openai.OpenAI] = []
        self.service = load_service(config)
        self.app = create_app(self.service, config)
        self.key = config.api_keys[0] if config.api_keys else None
        self.server = DrainingServer(uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on", ws="none",
            timeout_graceful_shutdown=shutdown_timeout,
            http=guarded_protocol(config.header_timeout, config.max_connections, tls,
                                  tls_shutdown_timeout=tls_shutdown_timeout),
            timeout_keep_alive=config.keep_alive_timeout,  # type: ignore[arg-type]
        ))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"

    def client(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("api_key", self.key or "unused")
        client = openai.OpenAI(base_url=self.url + "/v1", **kwargs)
        self._clients.append(client)
        return client

    def metrics(self) -> dict[str, float]:
        """Every sample of ``/metrics``, parsed by prometheus-client, as ``name{labels}`` -> value."""
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        response = httpx.get(self.url + "/metrics", headers=headers)
        response.raise_for_status()
        text = response.text
        samples: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return samples

    def stop(self) -> None:
        for client in self._clients:
            client.close()
        self._clients.clear()
        self.server.should_exit = True
        self.thread.join(timeout=60)
