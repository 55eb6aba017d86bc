"""Several ``llama-cache serve`` instances behind a real nginx, sharing one Redis (a server or a 3-node
cluster): one conversation moves between instances and each later turn evaluates only its new tokens.

Everything is real and on loopback: Debian's nginx and redis-server, and ``llama-cache serve`` child
processes on the embedded default model.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llama_cache.testing.deployment import Nginx, ServeProcess, nginx_available
from llama_cache.testing.redis_server import RedisCluster, RedisServer, redis_available

pytestmark = [
    pytest.mark.model, pytest.mark.slow,
    pytest.mark.skipif(not nginx_available() and not shutil.which("nginx"), reason="nginx is not installed"),
    pytest.mark.skipif(not redis_available(), reason="redis-server is not installed"),
]

SERVE = ["--parallel", "1", "--n-ctx", "2048", "--threads", "1", "--metrics-public"]
DOCUMENT = "Notes on the rivers of Europe. " + " ".join(
    f"River {i} carries barges from port {i} to port {i + 1} in {['spring', 'summer', 'autumn'][i % 3]}."
    for i in range(40))
QUESTIONS = ["Name one river from the notes.", "Which port does river 3 reach?", "And river 7?", "Say thanks."]
CHAT = "/v1/chat/completions"


def _served(url: str) -> float:
    """Chat completions an instance answered 200."""
    text = httpx.get(url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "llama_cache_requests_total" and sample.labels == {"endpoint": CHAT, "status": "200"}:
                return sample.value
    return 0.0


def _turn(url: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    response = httpx.post(url + CHAT, json={"messages": messages, "max_tokens": 8, "temperature": 0}, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()


def _conversation(url: str, instances: list[ServeProcess] | None = None) -> list[tuple[dict[str, Any], int]]:
    """Every turn's answer and, with ``instances``, which of them served it."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": DOCUMENT}]
    answers = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        before = [_served(instance.url) for instance in instances or []]
        answer = _turn(url, messages)
        after = [_served(instance.url) for instance in instances or []]
        served = [i for i, (b, a) in enumerate(zip(before, after)) if a > b]
        answers.append((answer, served[0] if served else -1))
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
    return answers


@pytest.fixture(scope="module")
def single() -> Iterator[list[tuple[dict[str, Any], int]]]:
    """The conversation on one instance, no Redis, no balancer: the answers to match."""
    instance = ServeProcess(SERVE)
    try:
        yield _conversation(instance.url)
    finally:
        instance.stop()


@pytest.mark.parametrize("shared", ["server", "cluster"])
def test_a_conversation_moving_between_instances_evaluates_only_its_new_tokens(
    shared: str, single: list[tuple[dict[str, Any], int]]
) -> None:
    redis = RedisServer() if shared == "server" else RedisCluster(3)
    instances: list[ServeProcess] = []
    nginx = None
    try:
        instances = [ServeProcess([*SERVE, "--redis", redis.url]) for _ in range(2)]
        nginx = Nginx([f"127.0.0.1:{instance.port}" for instance in instances])
        turns = _conversation(nginx.url, instances)
        # Round-robin moved the conversation at every turn.
        assert [served for _, served in turns] in ([0, 1, 0, 1], [1, 0, 1, 0])
        previous = None
        for (answer, _), (expected, _) in zip(turns, single):
            assert answer["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
            usage = answer["usage"]
            if previous is not None:
                # Everything the last turn held (its prompt and its answer) came from Redis: only the new
                # message and the template's tokens around it were evaluated.
                reused = previous["prompt_tokens"] + previous["completion_tokens"] - 1
                assert usage["prompt_tokens_details"]["cached_tokens"] >= reused, (previous, usage)
                assert usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"] < 40
            previous = usage

        # The instance that served the last turn dies: nginx retries the next on the other, which
        # continues from Redis.
        last = turns[-1][1]
        survivor = instances[1 - last]
        instances[last].kill()
        messages: list[dict[str, Any]] = [{"role": "system", "content": DOCUMENT}]
        for (answer, _), question in zip(turns, QUESTIONS):
            messages += [{"role": "user", "content": question},
                         {"role": "assistant", "content": answer["choices"][0]["message"]["content"]}]
        messages.append({"role": "user", "content": "One more river, please."})
        before = _served(survivor.url)
        after_kill = _turn(nginx.url, messages)
        assert _served(survivor.url) == before + 1
        usage = after_kill["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= previous["prompt_tokens"] + previous[
            "completion_tokens"] - 1
    finally:
        if nginx is not None:
            nginx.stop()
        for instance in instances:
            instance.stop()
        redis.stop()


def test_affinity_keeps_a_session_on_one_instance() -> None:
    with RedisServer() as redis:
        instances = [ServeProcess([*SERVE, "--redis", redis.url]) for _ in range(2)]
        nginx = Nginx([f"127.0.0.1:{instance.port}" for instance in instances], affinity_header="X-Session-Id")
        try:
            for session in ("alpha", "beta"):
                before = [_served(instance.url) for instance in instances]
                for _ in range(3):
                    response = httpx.post(nginx.url + CHAT, headers={"X-Session-Id": session}, timeout=600, json={
                        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
                    assert response.status_code == 200
                gained = [_served(instance.url) - b for instance, b in zip(instances, before)]
                assert sorted(gained) == [0, 3]
        finally:
            nginx.stop()
            for instance in instances:
                instance.stop()
