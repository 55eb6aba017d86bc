"""A real scale-out deployment on loopback for tests and benchmarks: server processes behind nginx.

:class:`ServeProcess` runs ``llama-cache serve`` (or any OpenAI-compatible server command, such as
``llama-server``) as a child process on a free port and waits for ``/health``; :class:`Nginx` runs
Debian's ``nginx`` in front of such servers with a configuration of its own in a temporary directory:
round-robin by default, or ``hash $http_x_session_id consistent`` (a conversation stays on one
instance when the client sends a session header), retrying a request on the next instance when one
cannot be reached (``proxy_next_upstream``, POSTs included). :func:`nginx_config` is the configuration,
which the serving docs show.

Everything listens on 127.0.0.1, lives in temporary directories and is stopped by ``stop()`` or at exit.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from llama_cache.testing.processes import kill_process, stop_process
from llama_cache.testing.redis_server import free_port

__all__ = ["Nginx", "ServeProcess", "nginx_available", "nginx_config"]


def nginx_available() -> bool:
    """Whether ``nginx`` is installed (Debian: ``apt-get install nginx``)."""
    return shutil.which("nginx") is not None or Path("/usr/sbin/nginx").is_file()


def _wait_until_healthy(url: str, process: subprocess.Popen[bytes], timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited with {process.returncode}: {log.read_text(errors='replace')[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not become healthy in {timeout:g} s")
        time.sleep(0.1)


class ServeProcess:
    """A server process on 127.0.0.1, healthy once constructed, stopped at :meth:`stop` or exit.

    Args:
        arguments: the server's options after the port (default command: ``llama-cache serve``).
        command: the command before ``--port``; default ``[sys.executable, "-m", "llama_cache.cli", "serve"]``.
        environment: extra environment variables.
        timeout: seconds to wait for ``/health``.
    """

    def __init__(self, arguments: Sequence[str] = (), *, command: Sequence[str] | None = None,
                 environment: Mapping[str, str] | None = None, timeout: float = 120.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.directory = Path(tempfile.mkdtemp(prefix="llama-cache-serve-"))
        self.log = self.directory / "server.log"
        base = list(command) if command is not None else [sys.executable, "-m", "llama_cache.cli", "serve"]
        env = dict(os.environ, **(environment or {}))
        with self.log.open("wb") as sink:
            self.process = subprocess.Popen([*base, "--host", "127.0.0.1", "--port", str(self.port), *arguments],
                                            env=env, stdout=sink, stderr=subprocess.STDOUT)
        atexit.register(self.stop)
        try:
            _wait_until_healthy(self.url, self.process, timeout, self.log)
        except BaseException:
            self.stop()
            raise

    def kill(self) -> None:
        """SIGKILL the server, as a crash would."""
        kill_process(self.process, timeout=30)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and remove its directory. Idempotent."""
        stop_process(self.process, timeout=30)
        shutil.rmtree(self.directory, ignore_errors=True)


def nginx_config(upstreams: Sequence[str], port: int, directory: str | os.PathLike[str] = "/var/lib/nginx",
                 affinity_header: str | None = None) -> str:
    """An nginx configuration balancing ``upstreams`` (``host:port``) behind ``127.0.0.1:port``.

    Round-robin, or with ``affinity_header`` (say ``X-Session-Id``) ``hash ... consistent`` on it, so a
    conversation that sends one stays on one instance (requests without it spread as by round-robin).
    Streams pass through unbuffered; a request whose instance cannot be reached or answers 502/503 is
    retried once on the next one (``proxy_next_upstream``, ``non_idempotent``: completions are POSTs
    that change nothing an instance shares, so a retry is safe). ``directory`` holds the pid and
    temporary files.
    """
    balance = ""
    if affinity_header is not None:
        variable = "$http_" + affinity_header.lower().replace("-", "_")
        balance = f"        hash {variable} consistent;\n"
    servers = "".join(f"        server {upstream} max_fails=1 fail_timeout=10s;\n" for upstream in upstreams)
    return f"""worker_processes 1;
pid {directory}/nginx.pid;
error_log {directory}/error.log warn;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {directory}/body;
    proxy_temp_path {directory}/proxy;
    fastcgi_temp_path {directory}/fastcgi;
    uwsgi_temp_path {directory}/uwsgi;
    scgi_temp_path {directory}/scgi;
    client_max_body_size 8m;
    upstream llama_cache {{
{balance}{servers}        keepalive 16;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://llama_cache;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 300s;
            proxy_next_upstream error timeout http_502 http_503 non_idempotent;
            proxy_next_upstream_tries 2;
        }}
    }}
}}
"""


class Nginx:
    """Debian's nginx on a free loopback port in front of ``upstreams``, stopped at :meth:`stop` or exit.

    Args:
        upstreams: the servers' ``host:port``.
        affinity_header: see :func:`nginx_config`.
    """

    def __init__(self, upstreams: Sequence[str], affinity_header: str | None = None) -> None:
        if not nginx_available():
            raise RuntimeError("nginx is not installed (Debian: apt-get install nginx)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.directory = Path(tempfile.mkdtemp(prefix="llama-cache-nginx-"))
        config = self.directory / "nginx.conf"
        config.write_text(nginx_config(upstreams, self.port, self.directory, affinity_header))
        binary = shutil.which("nginx") or "/usr/sbin/nginx"
        self.process = subprocess.Popen(
            [binary, "-p", str(self.directory), "-c", str(config), "-e", str(self.directory / "error.log"),
             "-g", "daemon off;"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        atexit.register(self.stop)
        deadline = time.monotonic() + 10
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"nginx exited: {(self.directory / 'error.log').read_text(errors='replace')}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1):
                    return
            except urllib.error.HTTPError:
                return  # nginx answers (an upstream's status)
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("nginx did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        """Stop nginx and remove its directory. Idempotent."""
        stop_process(self.process)
        shutil.rmtree(self.directory, ignore_errors=True)
