"""Real ``redis-server`` processes on loopback for tests and benchmarks: one server, or a small cluster.

:class:`RedisServer` starts Debian's ``redis-server`` on a free loopback port with its own temporary
directory (no persistence, no config file of the machine's), waits until it answers ``PING`` and stops
it on :meth:`RedisServer.stop` (or at exit). :meth:`RedisServer.kill` and :meth:`RedisServer.start`
restart it on the same port, as an outage would. :class:`RedisCluster` starts N servers with
``--cluster-enabled yes`` and joins them with ``redis-cli --cluster create``; :meth:`RedisServer.kill` on one
of its nodes is the loss of that node.
"""

from __future__ import annotations

import atexit
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from llama_cache.testing.processes import kill_process, stop_process

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
        password: the password :meth:`cli` authenticates with (``args`` must set it, e.g. with
            ``--requirepass``), or None.
    """

    def __init__(self, port: int | None = None, args: list[str] | None = None, password: str | None = None) -> None:
        if not redis_available():
            raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server)")
        self.port = port or free_port()
        self.args = list(args or [])
        self.password = password
        self.directory = Path(tempfile.mkdtemp(prefix="llama-cache-redis-"))
        self.process: subprocess.Popen[bytes] | None = None
        atexit.register(self.stop)
        self.start()

    @property
    def url(self) -> str:
        """``redis://[:password@]127.0.0.1:PORT/0``."""
        credentials = f":{self.password}@" if self.password is not None else ""
        return f"redis://{credentials}127.0.0.1:{self.port}/0"

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

    @property
    def running(self) -> bool:
        """Whether the process is alive (it may still be starting)."""
        return self.process is not None and self.process.poll() is None

    def auth_args(self) -> list[str]:
        """``redis-cli`` options authenticating as the ``default`` user (none without a password)."""
        return ["-a", self.password, "--no-auth-warning"] if self.password is not None else []

    def cli(self, *args: str) -> str:
        """Run ``redis-cli -p PORT ARGS`` (authenticated) and return its output."""
        done = subprocess.run(["redis-cli", "-p", str(self.port), *self.auth_args(), *args], capture_output=True,
                              text=True, timeout=30)
        return done.stdout

    def flushall(self) -> None:
        """Delete every key."""
        self.cli("flushall")

    def kill(self) -> None:
        """SIGKILL the server (its data is lost: no persistence)."""
        kill_process(self.process)

    def stop(self) -> None:
        """Stop the server and remove its directory. Idempotent."""
        stop_process(self.process)
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class RedisCluster:
    """``n`` (at least 3) cluster-enabled servers on loopback, joined into one cluster with no replicas.

    Each node is a :class:`RedisServer` with ``--cluster-enabled yes`` (its own temporary directory and
    nodes file, a free port whose cluster bus port, 10000 above, is free too). The constructor joins
    them with ``redis-cli --cluster create ... --cluster-replicas 0 --cluster-yes`` and returns once every
    node reports ``cluster_state:ok``; :meth:`stop` (or leaving the ``with`` block, or exit) stops them.

    Args:
        n: the number of primaries (at least 3, as ``redis-cli --cluster create`` requires).
        args: extra ``redis-server`` options for every node.
        password: the ``default`` user's password on every node (``--requirepass``), or None.
        tls: clients and the cluster bus use TLS, with a certificate for 127.0.0.1 from a throwaway CA
            (``trustme``, a test dependency); :attr:`url` is then a ``rediss://`` URL naming the TLS
            ports and the CA. Each node keeps a plaintext port for :meth:`cli`.
        timeout: seconds to wait for the cluster to form.

    Raises:
        RuntimeError: a node did not start or the cluster did not become ready in time.
    """

    def __init__(self, n: int = 3, args: list[str] | None = None, password: str | None = None, tls: bool = False,
                 timeout: float = 30.0) -> None:
        if n < 3:
            raise ValueError(f"a Redis cluster needs at least 3 primaries, got {n}")
        self.password = password
        self.certificates = Path(tempfile.mkdtemp(prefix="llama-cache-redis-tls-")) if tls else None
        self.tls_ports: list[int] = []
        auth = ["--requirepass", password, "--masterauth", password] if password is not None else []
        options = ["--cluster-enabled", "yes", "--cluster-node-timeout", "2000", *auth, *(args or [])]
        self.servers: list[RedisServer] = []
        try:
            if self.certificates is not None:
                options += _tls_options(self.certificates)
            for _ in range(n):
                own = []
                if self.certificates is not None:
                    self.tls_ports.append(_cluster_port())  # the bus listens 10000 above the TLS port then
                    own = ["--tls-port", str(self.tls_ports[-1])]
                self.servers.append(RedisServer(_cluster_port(), [*options, *own], password=password))
            ports = self.tls_ports or [server.port for server in self.servers]
            tls_cli = ["--tls", "--cacert", str(self.certificates / "ca.pem")] if self.certificates is not None else []
            subprocess.run(
                ["redis-cli", *tls_cli, *self.servers[0].auth_args(), "--cluster", "create",
                 *(f"127.0.0.1:{port}" for port in ports), "--cluster-replicas", "0", "--cluster-yes"],
                check=True, capture_output=True, timeout=timeout,
            )
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        """A URL naming every node (what :class:`~llama_cache.caches.redis_tier.LlamaRedisCache` takes):
        ``redis://[:password@]127.0.0.1:P1,127.0.0.1:P2,...``, or with TLS
        ``rediss://...TLS ports.../0?ssl_ca_certs=CA``."""
        credentials = f":{self.password}@" if self.password is not None else ""
        nodes = ",".join(f"127.0.0.1:{port}" for port in self.tls_ports or [server.port for server in self.servers])
        if self.certificates is not None:
            return f"rediss://{credentials}{nodes}/0?ssl_ca_certs={self.certificates / 'ca.pem'}"
        return f"redis://{credentials}{nodes}"

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until every running node reports ``cluster_state:ok``.

        Raises:
            RuntimeError: not within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        running = [server for server in self.servers if server.running]
        while not all("cluster_state:ok" in server.cli("cluster", "info") for server in running):
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis cluster did not become ready")
            time.sleep(0.1)

    def cli(self, *args: str) -> str:
        """Run ``redis-cli ARGS`` on every running node; their outputs, concatenated."""
        return "".join(server.cli(*args) for server in self.servers if server.running)

    def flushall(self) -> None:
        """Empty every node (the cluster's slots stay assigned)."""
        self.cli("flushall")

    def stop(self) -> None:
        """Stop every node and remove the directories. Idempotent."""
        for server in self.servers:
            server.stop()
        if self.certificates is not None:
            shutil.rmtree(self.certificates, ignore_errors=True)

    def __enter__(self) -> RedisCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _cluster_port() -> int:
    """A free port whose cluster bus port (the port + 10000) is free too."""
    while True:
        port = free_port(below=55536)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


def _tls_options(directory: Path) -> list[str]:
    """Write a throwaway CA and a certificate for 127.0.0.1 into ``directory``; the ``redis-server``
    options serving clients and the cluster bus with them (clients need no certificate of their own)."""
    import trustme

    authority = trustme.CA()
    certificate = authority.issue_cert("127.0.0.1", "localhost")
    authority.cert_pem.write_to_path(str(directory / "ca.pem"))
    certificate.private_key_pem.write_to_path(str(directory / "key.pem"))
    certificate.cert_chain_pems[0].write_to_path(str(directory / "cert.pem"))
    return ["--tls-cert-file", str(directory / "cert.pem"), "--tls-key-file", str(directory / "key.pem"),
            "--tls-ca-cert-file", str(directory / "ca.pem"), "--tls-auth-clients", "no", "--tls-cluster", "yes"]
