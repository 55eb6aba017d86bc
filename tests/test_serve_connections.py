"""``llama-cache serve``'s connections: the header deadline, keep-alive, the bound on open ones, prompt closes.

In-process servers (one context of 512 tokens each): ``server`` has a 2-second header deadline and room
for 1,500 connections; ``crowded`` holds at most 3 connections, with a long header deadline and a short
keep-alive; ``tls_server`` speaks HTTPS with a certificate from a throwaway CA (trustme). Stopping is
tested on servers of their own, in-process and as ``llama-cache serve`` subprocesses sent SIGTERM.
Settings are tested without a model.

Time bounds here are correctness checks with wide margins, not performance: a connection is never closed
before its deadline, and is closed long before anything else would have closed it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import select
import selectors
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import trustme

from llama_cache.cli import main
from llama_cache.server import ServerConfig
from llama_cache.server.config import add_serve_command, config_from_args
from llama_cache.server.connections import CLOSE_LINGER, tls_context
from tests.live_server import LiveServer, free_port

N_CTX = 512
HEADER_TIMEOUT = 2.0
KEEP_ALIVE = 1.0
SILENT = 1000
MARGIN = 30.0  # seconds past a deadline by which its close must have been seen, on a loaded machine
REPO = Path(__file__).resolve().parents[1]
HEALTH = b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n"


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    live = LiveServer(ServerConfig(n_ctx=N_CTX, parallel=1, header_timeout=HEADER_TIMEOUT, keep_alive_timeout=0.5,
                                   max_connections=SILENT + 500))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def crowded() -> Iterator[LiveServer]:
    live = LiveServer(ServerConfig(n_ctx=N_CTX, parallel=1, header_timeout=120, keep_alive_timeout=KEEP_ALIVE,
                                   max_connections=3))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, ssl.SSLContext]:
    """A key, a certificate for 127.0.0.1 from a throwaway CA, and a client context trusting that CA."""
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1", "localhost")
    folder = tmp_path_factory.mktemp("tls")
    keyfile, certfile = folder / "server.key", folder / "server.pem"
    issued.private_key_pem.write_to_path(str(keyfile))
    for blob in issued.cert_chain_pems:
        blob.write_to_path(str(certfile), append=True)
    trusted = ssl.create_default_context()
    ca.configure_trust(trusted)
    return keyfile, certfile, trusted


@pytest.fixture(scope="module")
def tls_server(certificate: tuple[Path, Path, ssl.SSLContext]) -> Iterator[LiveServer]:
    keyfile, certfile, _ = certificate
    live = LiveServer(ServerConfig(n_ctx=N_CTX, parallel=1, header_timeout=HEADER_TIMEOUT, keep_alive_timeout=KEEP_ALIVE),
                      tls=tls_context(certfile, keyfile))
    yield live
    live.stop()


def _enough_open_files(count: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < count:
        if hard != resource.RLIM_INFINITY and hard < count:
            pytest.skip(f"the hard limit on open files ({hard}) is below the {count} this test needs")
        resource.setrlimit(resource.RLIMIT_NOFILE, (count, hard))


def _wait_for(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def _read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """What the server sends until it closes the connection, and when the close was seen."""
    sock.settimeout(timeout)
    received = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, ssl.SSLEOFError):  # closed without more ado: what came before counts
            chunk = b""
        except (TimeoutError, socket.timeout):
            pytest.fail(f"the connection was still open after {timeout:g} s")
        if not chunk:
            return received, time.monotonic()
        received += chunk


def _read_response(sock: socket.socket) -> bytes:
    """One whole response (it has a Content-Length), headers and body."""
    sock.settimeout(60)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response's end: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed before a response's end"
        body += chunk
    assert len(body) == length, "more than one response"
    return head + b"\r\n\r\n" + body


def _error(response: bytes) -> tuple[bytes, dict[str, str], dict[str, object]]:
    """A raw error response's status line, headers (lower-cased names) and OpenAI error."""
    head, _, body = response.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    headers = {name.strip().lower().decode(): value.strip().decode()
               for name, _, value in (line.partition(b":") for line in lines)}
    return status, headers, json.loads(body)["error"]


# ------------------------------------------------------------------------------------ header deadline

@pytest.mark.model
@pytest.mark.slow
def test_a_thousand_silent_connections_are_closed_after_the_header_timeout_while_requests_are_served(
        server: LiveServer) -> None:
    _enough_open_files(2 * SILENT + 512)  # both ends of each connection live in this process
    opened: dict[socket.socket, float] = {}
    try:
        for _ in range(SILENT):
            started = time.monotonic()
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
            opened[sock] = started
        # The server goes on serving meanwhile.
        with httpx.Client(base_url=server.url, timeout=120) as http:
            assert http.get("/health").status_code == 200
            reply = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
            assert reply.status_code == 200 and reply.json()["choices"]
        closed: dict[socket.socket, float] = {}
        with selectors.DefaultSelector() as selector:
            for sock in opened:
                sock.setblocking(False)
                selector.register(sock, selectors.EVENT_READ)
            deadline = time.monotonic() + HEADER_TIMEOUT + MARGIN
            while len(closed) < SILENT and time.monotonic() < deadline:
                for key, _ in selector.select(timeout=1):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    try:
                        data = sock.recv(1024)
                    except ConnectionResetError:
                        data = b""
                    assert data == b"", f"a silent connection was sent {data!r}"
                    closed[sock] = time.monotonic()
                    selector.unregister(sock)
        assert len(closed) == SILENT, f"{SILENT - len(closed)} silent connections still open"
        early = [when - opened[sock] for sock, when in closed.items() if when - opened[sock] < HEADER_TIMEOUT]
        assert not early, f"{len(early)} connections closed before the header timeout"
    finally:
        for sock in opened:
            sock.close()
    with httpx.Client(base_url=server.url, timeout=60) as http:  # and after
        assert http.get("/health").status_code == 200


def _dribble_until_answered(sock: socket.socket, limit: float) -> bytes:
    """Send a header's bytes one per 0.4 s, never ending it, until the server answers and closes."""
    deadline = time.monotonic() + limit
    sent = 0
    while time.monotonic() < deadline:
        readable, _, _ = select.select([sock], [], [], 0.4)
        if readable:
            return _read_until_closed(sock, timeout=MARGIN)[0]
        try:
            sock.sendall(b"a")
        except (BrokenPipeError, ConnectionResetError):
            return _read_until_closed(sock, timeout=MARGIN)[0]
        sent += 1
    pytest.fail(f"{sent} header bytes dribbled over {limit:g} s without an answer")


@pytest.mark.model
@pytest.mark.parametrize("request_number", ["first", "next on a keep-alive connection"])
def test_headers_dribbled_slower_than_the_deadline_get_a_408_and_the_connection_closed(
        server: LiveServer, request_number: str) -> None:
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        partial = b"GET /health HTTP/1.1\r\nHost: test\r\nX-Slow: "
        if request_number == "first":
            sock.sendall(partial)
        else:  # the next request's start comes with the first, so the connection is never idle
            started = time.monotonic()
            sock.sendall(HEALTH + partial)
            assert _read_response(sock).startswith(b"HTTP/1.1 200")
        response = _dribble_until_answered(sock, HEADER_TIMEOUT + MARGIN)
        answered_after = time.monotonic() - started
    status, headers, error = _error(response)
    assert status.startswith(b"HTTP/1.1 408") and headers["connection"] == "close"
    assert (error["code"], error["type"]) == ("request_timeout", "invalid_request_error")
    assert answered_after >= HEADER_TIMEOUT  # the deadline, from the opening or the previous response
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.get("/health").status_code == 200


# ----------------------------------------------------------------------------------------- keep-alive

@pytest.mark.model
def test_a_keep_alive_connection_is_reused_then_closed_once_idle_for_the_keep_alive_timeout(
        crowded: LiveServer) -> None:
    with socket.create_connection(("127.0.0.1", crowded.port), timeout=60) as sock:
        sock.sendall(HEALTH)
        assert _read_response(sock).startswith(b"HTTP/1.1 200")
        last_request = time.monotonic()
        sock.sendall(HEALTH)  # the same connection serves the next request
        assert _read_response(sock).startswith(b"HTTP/1.1 200")
        data, closed = _read_until_closed(sock, timeout=KEEP_ALIVE + MARGIN)
    assert data == b""  # closed quietly: no 408 for a connection that asked nothing
    # Closed by the keep-alive timeout, not before it, nor by the header deadline (120 s on this server).
    assert closed - last_request >= KEEP_ALIVE


# ------------------------------------------------------------------------------------ max connections

@pytest.mark.model
def test_past_max_connections_a_new_connection_gets_a_503_at_once_and_is_closed(crowded: LiveServer) -> None:
    held: list[socket.socket] = []
    try:
        for _ in range(20):  # a connection of an earlier test may still be counted: then try again
            _wait_for(lambda: httpx.get(crowded.url + "/health", timeout=60).status_code == 200)
            held = [socket.create_connection(("127.0.0.1", crowded.port), timeout=60) for _ in range(3)]
            refused = httpx.get(crowded.url + "/health", timeout=60)  # a 4th: it sends its request at once
            if not select.select(held, [], [], 0)[0]:  # the three were served, not refused
                break
            for sock in held:
                sock.close()
            time.sleep(0.5)
        else:
            pytest.fail("three connections were never served at once")
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.headers["connection"] == "close"
        assert (refused.json()["error"]["code"], refused.json()["error"]["type"]) == ("too_many_connections",
                                                                                       "server_error")
        # One that sends nothing gets the 503 too, unasked, and is not held.
        with socket.create_connection(("127.0.0.1", crowded.port), timeout=60) as silent:
            response, _ = _read_until_closed(silent, timeout=CLOSE_LINGER + MARGIN)
        assert _error(response)[0].startswith(b"HTTP/1.1 503")
        held.pop().close()  # room for one
        _wait_for(lambda: httpx.get(crowded.url + "/health", timeout=60).status_code == 200, timeout=MARGIN)
    finally:
        for sock in held:
            sock.close()


# ------------------------------------------------------------------------------------------------ TLS

@pytest.mark.model
def test_over_tls_the_handshake_and_the_headers_fall_under_the_deadline(
        tls_server: LiveServer, certificate: tuple[Path, Path, ssl.SSLContext]) -> None:
    trusted = certificate[2]
    with httpx.Client(base_url=tls_server.url, verify=trusted, timeout=60) as http:
        assert [http.get("/health").status_code for _ in range(2)] == [200, 200]
    # No handshake at all: a TCP connection that never says hello.
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", tls_server.port), timeout=60) as sock:
        data, closed = _read_until_closed(sock, timeout=HEADER_TIMEOUT + MARGIN)
    assert data == b"" and closed - started >= HEADER_TIMEOUT
    # A handshake, then nothing; then the start of a request's headers.
    for sent, answer in ((b"", b""), (b"GET /health HTTP/1.1\r\nHost: test\r\nX-Slow: a", b"HTTP/1.1 408")):
        started = time.monotonic()
        with trusted.wrap_socket(socket.create_connection(("127.0.0.1", tls_server.port), timeout=60),
                                 server_hostname="127.0.0.1") as sock:
            sock.sendall(sent)
            data, closed = _read_until_closed(sock, timeout=HEADER_TIMEOUT + MARGIN)
        assert data.startswith(answer) and closed - started >= HEADER_TIMEOUT
        if answer:
            assert _error(data)[2]["code"] == "request_timeout"


@pytest.mark.model
def test_stopping_closes_idle_tls_connections_at_once(certificate: tuple[Path, Path, ssl.SSLContext]) -> None:
    """Neither the keep-alive timeout, the header deadline nor TLS's wait for the peer would end them in time."""
    keyfile, certfile, trusted = certificate
    live = LiveServer(ServerConfig(n_ctx=N_CTX, parallel=1, header_timeout=300, keep_alive_timeout=300),
                      shutdown_timeout=300, tls=tls_context(certfile, keyfile), tls_shutdown_timeout=300)
    try:
        with httpx.Client(base_url=live.url, verify=trusted, timeout=60) as http:
            assert http.get("/health").status_code == 200  # its connection now idles in the client's pool
            with socket.create_connection(("127.0.0.1", live.port), timeout=60):  # and one never says hello
                started = time.monotonic()
                live.stop()
                stopped_after = time.monotonic() - started
    finally:
        live.stop()
    assert not live.thread.is_alive() and stopped_after < 60


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["https", "http"])
def test_sigterm_closes_idle_keep_alive_connections_at_once_and_drains_a_running_stream(
        tmp_path: Path, certificate: tuple[Path, Path, ssl.SSLContext], scheme: str) -> None:
    keyfile, certfile, trusted = certificate
    port = free_port()
    tls = ["--ssl-keyfile", str(keyfile), "--ssl-certfile", str(certfile)] if scheme == "https" else []
    env = dict(os.environ, PYTHONPATH=str(REPO))
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "llama_cache.cli", "serve", "--port", str(port), "--n-ctx", str(N_CTX),
             "--parallel", "1", "--shutdown-timeout", "120", "--header-timeout", "100",
             "--keep-alive-timeout", "100", *tls],
            env=env, stdout=sink, stderr=subprocess.STDOUT,
        )
    url = f"{scheme}://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, verify=trusted, timeout=60) as idle, \
                httpx.Client(base_url=url, verify=trusted, timeout=60) as streaming:
            def up() -> bool:
                assert process.poll() is None, log.read_text()
                try:
                    return idle.get("/health").status_code == 200
                except httpx.TransportError:
                    return False

            _wait_for(up, timeout=120)
            assert idle.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
            # idle's connection now waits in its pool, open, for a next request that never comes.
            body = {"prompt": "Once upon a time,", "max_tokens": 24, "stream": True, "temperature": 0}
            events: list[str] = []
            with streaming.stream("POST", "/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        if not events:
                            process.send_signal(signal.SIGTERM)
                            signalled = time.monotonic()
                        events.append(line)
            assert events[-1] == "data: [DONE]"  # the running request was drained, not cut
            # Well before the shutdown timeout (120 s), and before TLS's default wait for the peer (30 s).
            assert process.wait(timeout=25) == 0
            assert time.monotonic() - signalled < 25
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = log.read_text()
    assert f"listening on {scheme}://127.0.0.1:{port}" in output
    assert "Traceback" not in output and "Finished server process" in output


# ------------------------------------------------------------------------------------------- settings

def _parse(argv: list[str], environ: dict[str, str] | None = None) -> ServerConfig:
    parser = argparse.ArgumentParser()
    add_serve_command(parser.add_subparsers(), [])
    return config_from_args(parser.parse_args(["serve", *argv]), environ or {})


def test_connection_settings_come_from_options_then_the_environment() -> None:
    default = _parse([])
    assert (default.header_timeout, default.keep_alive_timeout, default.max_connections) == (10.0, 5.0, 1024)
    config = _parse(["--header-timeout", "2.5", "--keep-alive-timeout", "1", "--max-connections", "50"])
    assert (config.header_timeout, config.keep_alive_timeout, config.max_connections) == (2.5, 1.0, 50)
    environ = {"LLAMA_CACHE_HEADER_TIMEOUT": "20", "LLAMA_CACHE_KEEP_ALIVE_TIMEOUT": "15",
               "LLAMA_CACHE_MAX_CONNECTIONS": "4000"}
    config = _parse([], environ)
    assert (config.header_timeout, config.keep_alive_timeout, config.max_connections) == (20.0, 15.0, 4000)
    assert _parse(["--max-connections", "7"], environ).max_connections == 7  # an option wins


@pytest.mark.parametrize(("argv", "environ", "message"), [
    (["--header-timeout", "0"], {}, "header_timeout must be a positive number of seconds"),
    (["--header-timeout", "-3"], {}, "header_timeout must be a positive number of seconds"),
    (["--header-timeout", "nan"], {}, "header_timeout must be a positive number of seconds"),
    (["--header-timeout", "inf"], {}, "header_timeout must be a positive number of seconds"),
    (["--keep-alive-timeout", "0"], {}, "keep_alive_timeout must be a positive number of seconds"),
    (["--keep-alive-timeout", "11"], {}, r"keep_alive_timeout \(11 s\) must not exceed header_timeout \(10 s\)"),
    (["--header-timeout", "3"], {}, r"keep_alive_timeout \(5 s\) must not exceed header_timeout \(3 s\)"),
    (["--max-connections", "0"], {}, "max_connections must be a positive integer"),
    ([], {"LLAMA_CACHE_HEADER_TIMEOUT": "soon"}, r"\$LLAMA_CACHE_HEADER_TIMEOUT must be a float, got 'soon'"),
    ([], {"LLAMA_CACHE_KEEP_ALIVE_TIMEOUT": "-1"}, "keep_alive_timeout must be a positive number"),
    ([], {"LLAMA_CACHE_MAX_CONNECTIONS": "1.5"}, r"\$LLAMA_CACHE_MAX_CONNECTIONS must be a int, got '1.5'"),
])
def test_connection_settings_out_of_range_are_clear_errors(argv: list[str], environ: dict[str, str],
                                                           message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _parse(argv, environ)


def test_connection_settings_are_checked_in_the_config_itself() -> None:
    for bad in ({"max_connections": 2.5}, {"max_connections": True}, {"header_timeout": "10"}):
        with pytest.raises(ValueError):
            ServerConfig(**bad)  # type: ignore[arg-type]


def test_the_help_names_each_connection_option_with_its_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option, variable in (("--header-timeout", "$LLAMA_CACHE_HEADER_TIMEOUT"),
                             ("--keep-alive-timeout", "$LLAMA_CACHE_KEEP_ALIVE_TIMEOUT"),
                             ("--max-connections", "$LLAMA_CACHE_MAX_CONNECTIONS")):
        assert option in text and variable in text


def test_a_bad_tls_file_stops_the_command_with_a_message_before_the_model_loads(tmp_path: Path) -> None:
    pem = tmp_path / "not.pem"
    pem.write_text("not a key, nor a certificate\n")
    with pytest.raises(SystemExit, match="cannot serve: "):
        main(["serve", "--port", str(free_port()), "--ssl-keyfile", str(pem), "--ssl-certfile", str(pem)])


@pytest.mark.model
def test_an_address_in_use_stops_the_command_with_a_message() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(SystemExit, match="cannot serve: .*in use"):
            main(["serve", "--port", str(taken.getsockname()[1]), "--n-ctx", str(N_CTX), "--parallel", "1"])
