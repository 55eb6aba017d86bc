"""Real ``redis-server`` processes on loopback for tests and benchmarks: one server, or a small cluster.

:class:`RedisServer` starts Debian's ``redis-server`` on a free loopback port with its own temporary
directory (no persistence, no config file of the machine's), waits until it answers ``PING`` and stops
it on :meth:`RedisServer.stop` (or at exit). :meth:`RedisServer.kill` and :meth:`RedisServer.start`
restart it on the same port, as an outage would. :class:`RedisCluster` starts N servers with
``--cluster-enabled yes`` and joins them with ``redis-cli --cluster create``.
"""

from __future__ import annotations

import atexit
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["RedisCluster", "RedisServer", "free_port", "redis_available"]


def redis_available() -> bool:
    """Whether ``redis-server`` and ``redis-cli`` are on PATH."""
    return shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None


def free_port(below: int = 65536) -> int:
    """A TCP port below ``below`` free on 127.0.0.1 right now."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port < below:
            return port


class RedisServer:
    """A ``redis-server`` on 127.0.0.1, in a temporary directory, stopped at :meth:`stop` or exit.

    Args:
        port: the port (default: a free one).
        args: extra ``redis-server`` options, e.g. ``["--maxmemory", "10mb"]``.
    """

    def __init__(self, port: int | None = None, args: list[str] | None = None) -> None:
        if not redis_available():
            raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server)")
        self.port = port or free_port()
        self.args = list(args or [])
        self.directory = Path(tempfile.mkdtemp(prefix="llama-cache-redis-"))
        self.process: subprocess.Popen[bytes] | None = None
        atexit.register(self.stop)
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        """Start (or restart) the server and wait until it answers."""
        if self.process is not None and self.process.poll() is None:
            return
        command = [
            "redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
            "--save", "", "--appendonly", "no", "--protected-mode", "no", *self.args,
        ]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while not self.ping():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith((b"+PONG", b"-NOAUTH"))  # up (a password may be required)
        except OSError:
            return False

    def cli(self, *args: str) -> str:
        """Run ``redis-cli -p PORT ARGS`` and return its output."""
        done = subprocess.run(["redis-cli", "-p", str(self.port), *args], capture_output=True, text=True, timeout=30)
        return done.stdout

    def kill(self) -> None:
        """SIGKILL the server (its data is lost: no persistence)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        """Stop the server and remove its directory. Idempotent."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class RedisCluster:
    """``n`` (at least 3) cluster-enabled servers on loopback, joined into one cluster with no replicas."""

    def __init__(self, n: int = 3, args: list[str] | None = None, timeout: float = 30.0) -> None:
        # A cluster node also listens on its port + 10000 (the cluster bus).
        self.servers = [
            RedisServer(free_port(below=55536), ["--cluster-enabled", "yes", "--cluster-node-timeout", "2000", *(args or [])])
            for _ in range(n)
        ]
        nodes = [f"127.0.0.1:{server.port}" for server in self.servers]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=timeout,
        )
        deadline = time.monotonic() + timeout
        while "cluster_state:ok" not in self.servers[0].cli("cluster", "info"):
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis cluster did not become ready")
            time.sleep(0.1)

    @property
    def url(self) -> str:
        """A URL naming every node (what :class:`~llama_cache.caches.redis_tier.LlamaRedisCache` takes)."""
        return "redis://" + ",".join(f"127.0.0.1:{server.port}" for server in self.servers)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> RedisCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
