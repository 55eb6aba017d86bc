"""``llama-cache serve`` exposed: API keys, CORS, TLS, secrets kept out of logs, the body-read deadline.

Two in-process servers (one context of 512 tokens each): one asking for keys, with one allowed CORS
origin and a 1-second body deadline; one open to all, with CORS for any origin. The TLS test runs
``llama-cache serve`` as a subprocess with certificates from a throwaway CA (trustme). Settings and
redaction are tested without a model.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
import trustme

from llama_cache import LlamaRedisCache
from llama_cache.caches.redis_urls import redact_url
from llama_cache.server import ServerConfig, create_app, load_service, serve
from llama_cache.server.access import ApiKeyMiddleware, is_loopback
from llama_cache.server.config import DEFAULT_PARALLEL, add_serve_command, config_from_args
from llama_cache.testing.redis_server import RedisServer, redis_available
from tests.live_server import LiveServer, free_port

N_CTX = 512
KEYS = ("sk-first-0123456789", "sk-second-abcdefghij", "sk-third-ZYXWVUTSRQ")
WRONG_KEY = "sk-wrong-0000000000"
ORIGIN = "https://chat.example.com"
BODY_TIMEOUT = 1.0
REPO = Path(__file__).resolve().parents[1]
REFUSED = 'llama_cache_requests_total{endpoint="%s",status="401"}'


@pytest.fixture(scope="module")
def keyed() -> Iterator[LiveServer]:
    live = LiveServer(ServerConfig(n_ctx=N_CTX, parallel=1, api_keys=KEYS, cors_origins=(ORIGIN,),
                                   body_timeout=BODY_TIMEOUT))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def open_server() -> Iterator[LiveServer]:
    live = LiveServer(ServerConfig(n_ctx=N_CTX, parallel=1, cors_origins=("*",)))
    yield live
    live.stop()


def _wait_for(predicate: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def _parse(argv: list[str], environ: dict[str, str] | None = None) -> ServerConfig:
    parser = argparse.ArgumentParser()
    add_serve_command(parser.add_subparsers(), [])
    return config_from_args(parser.parse_args(["serve", *argv]), environ or {})


def _assert_invalid_key_body(response: Any) -> None:
    """``response`` (httpx's, or the openai client's own httpx2's) is the 401 for a missing or wrong key."""
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, "invalid_api_key")


# ------------------------------------------------------------------------------------------ API keys

@pytest.mark.model
def test_no_key_configured_leaves_every_route_open(open_server: LiveServer) -> None:
    client = open_server.client(max_retries=0)
    assert [model.id for model in client.models.list().data] == [open_server.service.model_name]
    assert client.completions.create(model="m", prompt="Hi", max_tokens=2, temperature=0).choices
    for path in ("/metrics", "/health"):
        assert httpx.get(open_server.url + path).status_code == 200


@pytest.mark.model
def test_every_configured_key_is_accepted_by_the_openai_client(keyed: LiveServer) -> None:
    for key in KEYS:
        client = keyed.client(api_key=key, max_retries=0)
        assert [model.id for model in client.models.list().data] == [keyed.service.model_name]
    reply = keyed.client(api_key=KEYS[2], max_retries=0).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0)
    assert reply.choices[0].message.role == "assistant"


@pytest.mark.model
def test_a_wrong_or_missing_key_is_a_401_that_echoes_no_key(keyed: LiveServer) -> None:
    with pytest.raises(openai.AuthenticationError) as raised:
        keyed.client(api_key=WRONG_KEY, max_retries=0).completions.create(model="m", prompt="Hi", max_tokens=2)
    assert raised.value.code == "invalid_api_key"
    _assert_invalid_key_body(raised.value.response)
    assert WRONG_KEY not in raised.value.response.text
    with httpx.Client(base_url=keyed.url) as http:
        for headers in ({}, {"Authorization": f"Bearer {WRONG_KEY}"}, {"X-Api-Key": WRONG_KEY},
                        {"Authorization": f"Basic {KEYS[0]}"}, {"Authorization": "Bearer"},
                        {"Authorization": f"Bearer {KEYS[0][:-1]}"}, {"Authorization": f"Bearer {KEYS[0]}x"}):
            response = http.get("/v1/models", headers=headers)
            _assert_invalid_key_body(response)
            assert all(key not in response.text for key in (*KEYS, WRONG_KEY))
        missing = http.post("/v1/chat/completions", json={"messages": []})
        _assert_invalid_key_body(missing)
        assert "Authorization: Bearer" in missing.json()["error"]["message"]  # says how to send one


@pytest.mark.model
def test_keys_are_read_from_either_header_and_the_scheme_in_any_case(keyed: LiveServer) -> None:
    with httpx.Client(base_url=keyed.url) as http:
        for headers in ({"X-Api-Key": KEYS[1]}, {"Authorization": f"bearer {KEYS[0]}"},
                        {"Authorization": f"Bearer {WRONG_KEY}", "X-Api-Key": KEYS[2]}):
            assert http.get("/v1/models", headers=headers).status_code == 200
        answer = http.post("/v1/completions", headers={"X-Api-Key": KEYS[1]},
                           json={"prompt": "Hi", "max_tokens": 2, "temperature": 0}, timeout=60)
        assert answer.status_code == 200 and answer.json()["choices"]


@pytest.mark.model
def test_health_is_public_metrics_and_unknown_paths_ask_for_the_key(keyed: LiveServer) -> None:
    with httpx.Client(base_url=keyed.url) as http:
        assert http.get("/health").status_code == 200
        _assert_invalid_key_body(http.get("/metrics"))
        assert http.get("/metrics", headers={"X-Api-Key": KEYS[0]}).status_code == 200
        _assert_invalid_key_body(http.get("/v1/no-such-route"))  # the routes are not revealed either
        assert http.get("/v1/no-such-route", headers={"X-Api-Key": KEYS[0]}).status_code == 404


@pytest.mark.model
def test_refusals_are_counted_by_endpoint_with_unknown_paths_as_other(keyed: LiveServer) -> None:
    before = keyed.metrics()
    with httpx.Client(base_url=keyed.url) as http:
        for path in ("/v1/models", "/v1/models", "/metrics", "/v1/no-such-route", "/v1/another-one"):
            assert http.get(path).status_code == 401
        assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 401
    after = keyed.metrics()
    for endpoint, count in (("/v1/models", 2), ("/metrics", 1), ("other", 2), ("/v1/completions", 1)):
        assert after[REFUSED % endpoint] - before.get(REFUSED % endpoint, 0) == count
    assert not any("no-such-route" in name or "another-one" in name for name in after)


def test_the_key_middleware_needs_a_key() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("not reached")

    with pytest.raises(ValueError):
        ApiKeyMiddleware(app, keys=[])


# ---------------------------------------------------------------------------------------------- CORS

@pytest.mark.model
def test_a_preflight_from_an_allowed_origin_needs_no_key_and_allows_the_key_headers(keyed: LiveServer) -> None:
    response = httpx.options(keyed.url + "/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, x-api-key, content-type"})
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in response.headers["access-control-allow-methods"]
    allowed = {name.strip().lower() for name in response.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "x-api-key", "content-type"} <= allowed
    with httpx.Client(base_url=keyed.url, headers={"Origin": ORIGIN}) as http:
        answered = http.get("/v1/models", headers={"Authorization": f"Bearer {KEYS[0]}"})
        refused = http.get("/v1/models")  # the page may read why it was refused
    assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == ORIGIN
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN


@pytest.mark.model
def test_a_disallowed_origin_gets_no_cors_headers(keyed: LiveServer) -> None:
    preflight = httpx.options(keyed.url + "/v1/chat/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 400
    assert "access-control-allow-origin" not in preflight.headers
    answered = httpx.get(keyed.url + "/v1/models", headers={"Origin": "https://evil.example", "X-Api-Key": KEYS[0]})
    assert answered.status_code == 200 and "access-control-allow-origin" not in answered.headers


@pytest.mark.model
def test_cors_for_any_origin(open_server: LiveServer) -> None:
    preflight = httpx.options(open_server.url + "/v1/completions", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, x-stainless-os"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
    assert "x-stainless-os" in preflight.headers["access-control-allow-headers"].lower()
    answered = httpx.get(open_server.url + "/v1/models", headers={"Origin": "https://anywhere.example"})
    assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == "*"


# ------------------------------------------------------------------------------------- body deadline

def _read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes the connection; fails if it has not within ``timeout``."""
    sock.settimeout(timeout)
    received = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:  # closed while our last byte was on its way: what came before counts
            return received
        if not chunk:
            return received
        received += chunk


@pytest.mark.model
def test_a_body_trickled_past_the_deadline_is_a_408_and_the_server_goes_on(keyed: LiveServer) -> None:
    before = keyed.metrics()
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 2}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEYS[0]}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    assert len(body) * 0.5 > 5 * BODY_TIMEOUT  # the whole body would take far longer than the deadline
    with socket.create_connection(("127.0.0.1", keyed.port), timeout=10) as sock:
        sock.sendall(head)
        started = time.monotonic()
        for byte in body:  # a byte every half second, until the server answers
            sock.sendall(bytes([byte]))
            readable, _, _ = select.select([sock], [], [], 0.5)
            if readable:
                break
        else:
            pytest.fail("the whole body was trickled in without an answer")
        answered_after = time.monotonic() - started
        response = _read_until_closed(sock, timeout=10)  # and the connection is dropped
    status_line, _, rest = response.partition(b"\r\n")
    headers, _, content = rest.partition(b"\r\n\r\n")
    assert status_line.startswith(b"HTTP/1.1 408")
    assert b"connection: close" in headers.lower()
    error = json.loads(content)["error"]
    assert (error["code"], error["type"]) == ("request_timeout", "invalid_request_error")
    assert BODY_TIMEOUT - 0.1 <= answered_after < BODY_TIMEOUT + 4  # 4 s of slack for a busy machine
    after = keyed.metrics()
    timed_out = 'llama_cache_requests_total{endpoint="/v1/completions",status="408"}'
    assert after[timed_out] - before.get(timed_out, 0) == 1
    assert keyed.client(max_retries=0).completions.create(model="m", prompt="Hi", max_tokens=2).choices


# ----------------------------------------------------------------------------------------------- TLS

def test_https_with_keys_from_a_file_and_the_environment_and_public_metrics(tmp_path: Path) -> None:
    """``llama-cache serve`` over TLS, called by the openai client trusting the test CA; keys stay out of its log."""
    ca = trustme.CA()
    certificate = ca.issue_cert("127.0.0.1", "localhost")
    keyfile, certfile = tmp_path / "server.key", tmp_path / "server.pem"
    certificate.private_key_pem.write_to_path(str(keyfile))
    for blob in certificate.cert_chain_pems:
        blob.write_to_path(str(certfile), append=True)
    trusted = ssl.create_default_context()
    ca.configure_trust(trusted)
    key_file = tmp_path / "keys"
    key_file.write_text("# the chat front end\nsk-file-one\n\n  sk-file-two  \n")
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), LLAMA_CACHE_API_KEY="sk-env-one,sk-env-two")
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "llama_cache.cli", "serve", "--port", str(port), "--n-ctx", str(N_CTX),
             "--parallel", "1", "--ssl-keyfile", str(keyfile), "--ssl-certfile", str(certfile),
             "--api-key-file", str(key_file), "--metrics-public"],
            env=env, stdout=sink, stderr=subprocess.STDOUT,
        )
    url = f"https://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, verify=trusted, timeout=60) as http:
            def up() -> bool:
                assert process.poll() is None, log.read_text()
                try:
                    return http.get("/health").status_code == 200
                except httpx.TransportError:
                    return False

            _wait_for(up)
            assert http.get("/metrics").status_code == 200  # --metrics-public
            assert http.get("/v1/models").status_code == 401
        with openai.DefaultHttpxClient(verify=trusted, timeout=60) as transport:
            for key in ("sk-file-one", "sk-file-two", "sk-env-one", "sk-env-two"):
                client = openai.OpenAI(base_url=url + "/v1", api_key=key, http_client=transport, max_retries=0)
                assert client.models.list().data
            reply = client.completions.create(model="m", prompt="Hello", max_tokens=2, temperature=0)
            assert reply.choices
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=url + "/v1", api_key=WRONG_KEY, http_client=transport,
                              max_retries=0).models.list()
        with pytest.raises(httpx.ConnectError):  # a certificate nobody else trusts: it is this server's
            httpx.get(url + "/health")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = log.read_text()
    assert "listening on https://127.0.0.1:" in output and "Traceback" not in output
    assert "no API key" not in output
    for secret in ("sk-file-one", "sk-file-two", "sk-env-one", "sk-env-two", WRONG_KEY):
        assert secret not in output


# ------------------------------------------------------------------------------------------- secrets

@pytest.mark.model
def test_keys_are_not_logged_on_refusal_or_success(keyed: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with httpx.Client(base_url=keyed.url) as http:
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {WRONG_KEY}"}).status_code == 401
        assert http.get("/v1/models", headers={"X-Api-Key": KEYS[1]}).status_code == 200
    assert all(key not in caplog.text for key in (*KEYS, WRONG_KEY))


@pytest.mark.skipif(not redis_available(), reason="redis-server is not installed")
@pytest.mark.model
def test_a_redis_password_from_a_file_stays_out_of_logs_repr_and_metrics(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    password = "redis-pass-9f8e7d"
    with RedisServer(args=["--requirepass", password]) as redis_server:
        url_file = tmp_path / "redis-url"
        url_file.write_text(f"redis://:{password}@127.0.0.1:{redis_server.port}/0\n")
        config = _parse(["--redis-url-file", str(url_file), "--n-ctx", str(N_CTX), "--parallel", "1",
                         "--api-key", KEYS[0]])
        assert config.redis_url == f"redis://:{password}@127.0.0.1:{redis_server.port}/0"
        caplog.set_level(logging.DEBUG)
        engine = load_service(config)
        try:
            app = create_app(engine, config)
            assert f"redis://:***@127.0.0.1:{redis_server.port}/0" in caplog.text  # the tier is named, redacted
            metrics = app.state.metrics.render().decode()  # asks Redis for its stats, with the password
            assert 'llama_cache_cache_entries{tier="redis"} 0.0' in metrics
            assert "failed" not in caplog.text
            shown = [caplog.text, metrics, repr(config), repr(engine.cache), str(config)]
        finally:
            engine.close()
    assert all(password not in text and KEYS[0] not in text for text in shown)
    assert "api_keys=<1 hidden>" in repr(config) and "redis://:***@" in repr(config)


def test_redis_error_messages_are_scrubbed_of_the_password(caplog: pytest.LogCaptureFixture) -> None:
    password = "p%40ss-word"  # percent-encoded in the URL; redis-py would use (and could print) "p@ss-word"

    class Failing:
        """A redis-py client whose every call fails with a message quoting the credentials."""

        def register_script(self, script: str) -> Any:
            return self._fail

        def __getattr__(self, name: str) -> Any:
            return self._fail

        def _fail(self, *args: Any, **kwargs: Any) -> Any:
            raise redis.ConnectionError("AUTH p@ss-word refused for redis://:p%40ss-word@10.0.0.1:6379/0")

    url = f"redis://:{password}@10.0.0.1:6379/0"
    cache = LlamaRedisCache(url, client=Failing(), fingerprint="model")
    caplog.set_level(logging.DEBUG)
    with pytest.raises(KeyError):
        cache[[1, 2, 3]]
    assert "refused" in caplog.text  # the failure is logged...
    assert "p@ss-word" not in caplog.text and password not in caplog.text  # ...without the password
    assert password not in repr(cache) and "p@ss" not in repr(cache)


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:secret@cache:6379/0", "redis://:***@cache:6379/0"),
    ("rediss://user:se%40cret@cache:6380/1", "rediss://user:***@cache:6380/1"),
    ("redis://secret@cache", "redis://***@cache"),
    ("redis://u:p@ss@a:1,b:2/0", "redis://u:***@a:1,b:2/0"),
    ("redis://cache:6379/0?password=secret&db=2", "redis://cache:6379/0?password=***&db=2"),
    ("redis://cache:6379/0", "redis://cache:6379/0"),
])
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


# ---------------------------------------------------------------------------------------- settings

def test_keys_come_from_options_the_environment_and_a_key_file(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# comment\n\n  sk-file-1  \nsk-file-2\n# sk-commented-out\nsk-cli\n")
    assert _parse([]).api_keys == ()
    assert _parse(["--api-key", "sk-a", "--api-key", "sk-b"]).api_keys == ("sk-a", "sk-b")
    assert _parse([], {"LLAMA_CACHE_API_KEY": "sk-a, sk-b,"}).api_keys == ("sk-a", "sk-b")
    # The option wins over its variable; the file's keys are added, each key once.
    both = _parse(["--api-key", "sk-cli", "--api-key-file", str(key_file)], {"LLAMA_CACHE_API_KEY": "sk-env"})
    assert both.api_keys == ("sk-cli", "sk-file-1", "sk-file-2")
    from_env = _parse([], {"LLAMA_CACHE_API_KEY": "sk-env", "LLAMA_CACHE_API_KEY_FILE": str(key_file)})
    assert from_env.api_keys == ("sk-env", "sk-file-1", "sk-file-2", "sk-cli")


@pytest.mark.parametrize(("content", "message"), [
    ("# only a comment\n\n", "holds no key"),
    ("sk-good\nsk-two words\n", "line 2 of the API key file"),
    (b"\xff\xfe", "not UTF-8"),
])
def test_a_bad_key_file_is_a_clear_error_quoting_no_key(tmp_path: Path, content: str | bytes, message: str) -> None:
    key_file = tmp_path / "keys"
    if isinstance(content, bytes):
        key_file.write_bytes(content)
    else:
        key_file.write_text(content)
    with pytest.raises(ValueError, match=message) as raised:
        _parse(["--api-key-file", str(key_file)])
    assert "sk-" not in str(raised.value).replace(str(key_file), "")


def test_settings_errors_are_clear_value_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read the API key file"):
        _parse(["--api-key-file", str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="LLAMA_CACHE_API_KEY holds no key"):
        _parse([], {"LLAMA_CACHE_API_KEY": " , "})
    with pytest.raises(ValueError, match="visible ASCII") as raised:
        ServerConfig(api_keys=("sk-with space",))
    assert "sk-with" not in str(raised.value)
    with pytest.raises(TypeError):
        ServerConfig(api_keys="sk-one-string")  # type: ignore[arg-type]
    pem = tmp_path / "server.pem"
    pem.write_text("not checked here")
    with pytest.raises(ValueError, match="both or neither"):
        _parse(["--ssl-certfile", str(pem)])
    with pytest.raises(ValueError, match="both or neither"):
        ServerConfig(ssl_keyfile=pem)
    with pytest.raises(ValueError, match="ssl_keyfile .* is not a file"):
        _parse(["--ssl-certfile", str(pem), "--ssl-keyfile", str(tmp_path / "missing.key")])
    assert _parse([], {"LLAMA_CACHE_SSL_KEYFILE": str(pem), "LLAMA_CACHE_SSL_CERTFILE": str(pem)}).ssl_keyfile == pem
    with pytest.raises(ValueError, match="CORS origin"):
        _parse(["--cors-origins", "https://app.example/"])
    with pytest.raises(ValueError, match="body_timeout"):
        _parse(["--body-timeout", "0"])
    with pytest.raises(ValueError, match="LLAMA_CACHE_METRICS_PUBLIC"):
        _parse([], {"LLAMA_CACHE_METRICS_PUBLIC": "perhaps"})


def test_access_settings_from_options_and_environment() -> None:
    default = _parse([])
    assert (default.parallel, default.body_timeout, default.metrics_public, default.cors_origins) == (
        DEFAULT_PARALLEL, 30.0, False, ())
    assert DEFAULT_PARALLEL == 4  # llama-server's
    config = _parse(["--cors-origins", "https://a.example, http://localhost:3000", "--metrics-public",
                     "--body-timeout", "2.5"])
    assert config.cors_origins == ("https://a.example", "http://localhost:3000")
    assert (config.metrics_public, config.body_timeout) == (True, 2.5)
    environ = {"LLAMA_CACHE_CORS_ORIGINS": "*", "LLAMA_CACHE_METRICS_PUBLIC": "on", "LLAMA_CACHE_BODY_TIMEOUT": "7"}
    config = _parse([], environ)
    assert (config.cors_origins, config.metrics_public, config.body_timeout) == (("*",), True, 7.0)


def test_the_redis_url_comes_from_an_option_a_file_or_the_environment(tmp_path: Path) -> None:
    url_file = tmp_path / "redis-url"
    url_file.write_text("# the shared cache\nredis://:secret@cache:6379/0\n")
    assert _parse(["--redis-url-file", str(url_file)]).redis_url == "redis://:secret@cache:6379/0"
    assert _parse([], {"LLAMA_CACHE_REDIS_URL_FILE": str(url_file)}).redis_url == "redis://:secret@cache:6379/0"
    # An option wins over either variable.
    assert _parse(["--redis-url-file", str(url_file)], {"LLAMA_CACHE_REDIS": "redis://other"}).redis_url == (
        "redis://:secret@cache:6379/0")
    assert _parse(["--redis", "redis://given"], {"LLAMA_CACHE_REDIS_URL_FILE": str(url_file)}).redis_url == (
        "redis://given")
    with pytest.raises(ValueError, match="not both"):
        _parse(["--redis", "redis://given", "--redis-url-file", str(url_file)])
    with pytest.raises(ValueError, match="not both"):
        _parse([], {"LLAMA_CACHE_REDIS": "redis://x", "LLAMA_CACHE_REDIS_URL_FILE": str(url_file)})
    url_file.write_text("redis://one\nredis://two\n")
    with pytest.raises(ValueError, match="one URL on one line"):
        _parse(["--redis-url-file", str(url_file)])
    with pytest.raises(ValueError, match="cannot read the Redis URL file"):
        _parse(["--redis-url-file", str(tmp_path / "missing")])


def test_a_server_open_beyond_loopback_is_warned_about_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = tmp_path / "missing.gguf"  # serve() stops at the model: the warning comes before it
    for host, keys, warned in (("0.0.0.0", (), True), ("192.168.1.5", (), True), ("0.0.0.0", ("sk-k",), False),
                               ("127.0.0.1", (), False), ("localhost", (), False), ("::1", (), False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING), pytest.raises(FileNotFoundError):
            serve(ServerConfig(host=host, model_path=missing, api_keys=keys))
        assert ("with no API key" in caplog.text) is warned, host
    assert is_loopback("127.0.0.2") and is_loopback("[::1]") and not is_loopback("example.com")
