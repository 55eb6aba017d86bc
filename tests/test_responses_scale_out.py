"""Server-side conversations across instances: two ``llama-cache serve`` behind a real nginx sharing one
Redis. A conversation chained by ``previous_response_id`` moves between the instances at every turn:
each finds the previous response in Redis (the stored responses' shared tier) and its state in the
prompt cache's Redis tier, so it evaluates only the new turn.
"""

from __future__ import annotations

import shutil
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llama_cache.testing.deployment import Nginx, ServeProcess, nginx_available
from llama_cache.testing.redis_server import RedisServer, redis_available

pytestmark = [
    pytest.mark.model, pytest.mark.slow,
    pytest.mark.skipif(not nginx_available() and not shutil.which("nginx"), reason="nginx is not installed"),
    pytest.mark.skipif(not redis_available(), reason="redis-server is not installed"),
]

SERVE = ["--parallel", "1", "--n-ctx", "2048", "--threads", "1", "--metrics-public"]
ROUTE = "/v1/responses"
DOCUMENT = "Notes on the rivers of Europe. " + " ".join(
    f"River {i} carries barges from port {i} to port {i + 1}." for i in range(30))
QUESTIONS = ["Name one river from the notes.", "Which port does river 3 reach?", "And river 7?", "Say thanks."]


def _served(url: str) -> float:
    """Responses an instance answered 200."""
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == "llama_cache_requests_total" and sample.labels == {"endpoint": ROUTE, "status": "200"}:
                return sample.value
    return 0.0


def test_a_conversation_chained_by_previous_response_id_moves_between_instances() -> None:
    redis = RedisServer()
    instances: list[ServeProcess] = []
    nginx = None
    try:
        instances = [ServeProcess([*SERVE, "--redis", redis.url]) for _ in range(2)]
        nginx = Nginx([f"127.0.0.1:{instance.port}" for instance in instances])
        client = openai.OpenAI(base_url=nginx.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        previous: Any = None
        served = []
        for question in QUESTIONS:
            before = [_served(instance.url) for instance in instances]
            response = client.responses.create(
                instructions=DOCUMENT, input=question, max_output_tokens=8, temperature=0,
                previous_response_id=previous.id if previous is not None else None)
            after = [_served(instance.url) for instance in instances]
            served += [i for i, (b, a) in enumerate(zip(before, after)) if a > b]
            if previous is not None:
                usage, last = response.usage, previous.usage
                # The last turn's prompt and answer came from Redis: only the new turn was evaluated.
                assert usage.input_tokens_details.cached_tokens >= last.input_tokens + last.output_tokens - 1, usage
                assert usage.input_tokens - usage.input_tokens_details.cached_tokens < 40
            previous = response
        assert served in ([0, 1, 0, 1], [1, 0, 1, 0])  # round-robin moved it at every turn
        # Every instance serves every stored response, and a delete on one is seen by the other.
        for instance in instances:
            assert httpx.get(f"{instance.url}{ROUTE}/{previous.id}", timeout=30).json()["id"] == previous.id
        client.responses.delete(previous.id)
        for instance in instances:
            assert httpx.get(f"{instance.url}{ROUTE}/{previous.id}", timeout=30).status_code == 404
        client.close()
    finally:
        if nginx is not None:
            nginx.stop()
        for instance in instances:
            instance.stop()
        redis.stop()
