"""Tenants: a prompt cache namespace per API key and per ``cache_salt``, on the real model.

Without namespaces, a key's client could read another key's prompts back: a correct guess of a cached
prompt's head is answered with ``cached_tokens`` of that length and fast, a wrong one is not. Here a
guess from another namespace is evaluated in full: ``cached_tokens`` 0, and every prompt token is
evaluated (the evaluated-token counter), which is what makes its time to the first token a cold one.
Within a namespace, reuse is unchanged.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llama_cache.server import ServerConfig
from llama_cache.server.access import key_id
from tests.live_server import LiveServer

N_CTX = 1024
KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-0123456789"
EVALUATED = "llama_cache_evaluated_tokens_total"


def _prompt(tag: str) -> str:
    return (f"{tag}: the secret plan of the committee, section by section, " * 12).strip()


def _complete(server: LiveServer, key: str | None, prompt: str, **extra: Any) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.post(server.url + "/v1/completions", headers=headers, timeout=300,
                          json={"prompt": prompt, "max_tokens": 2, "temperature": 0, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def _evaluated(server: LiveServer, action: Any) -> tuple[Any, int]:
    before = server.metrics()[EVALUATED]
    result = action()
    return result, int(server.metrics()[EVALUATED] - before)


@pytest.fixture(scope="module")
def keyed() -> Iterator[LiveServer]:
    live = LiveServer(ServerConfig(n_ctx=N_CTX, parallel=2, api_keys=(KEY_A, KEY_B)))
    yield live
    live.stop()


def test_another_key_s_correct_guess_is_a_cold_evaluation(keyed: LiveServer) -> None:
    prompt = _prompt("alpha")
    first = _complete(keyed, KEY_A, prompt)
    n = first["usage"]["prompt_tokens"]
    assert n > 100
    # A's next turn reuses its prompt (a live context or the cache)...
    again, _ = _evaluated(keyed, lambda: _complete(keyed, KEY_A, prompt + " And then?"))
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= n - 1
    # ...B's correct guess of it reuses nothing: every prompt token is evaluated.
    guess, evaluated = _evaluated(keyed, lambda: _complete(keyed, KEY_B, prompt))
    assert guess["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert evaluated >= n  # the prompt in full (and the sampled token)
    # Nor does a guess of its head only (in a namespace of B's that has seen nothing yet).
    head, evaluated = _evaluated(keyed, lambda: _complete(keyed, KEY_B, prompt[: len(prompt) // 2] + " guess",
                                                          cache_salt="fresh"))
    assert head["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert evaluated >= head["usage"]["prompt_tokens"]
    # The answers are the same: only the cache is apart.
    assert guess["choices"][0]["text"] == first["choices"][0]["text"]


def test_keys_reuse_their_own_prompts_and_are_counted_by_key_id(keyed: LiveServer) -> None:
    prompt = _prompt("beta")
    _complete(keyed, KEY_B, prompt)
    again = _complete(keyed, KEY_B, prompt + " More.")
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 100
    metrics = keyed.metrics()
    for key in (KEY_A, KEY_B):
        digest = hashlib.sha256(key.encode()).digest()
        assert metrics[f'llama_cache_key_prompt_tokens_total{{key="{key_id(digest)}"}}'] > 0
    assert not any(KEY_A in name or KEY_B in name for name in metrics)


def test_a_salt_separates_namespaces_within_a_key(keyed: LiveServer) -> None:
    prompt = _prompt("gamma")
    _complete(keyed, KEY_A, prompt, cache_salt="project-1")
    same = _complete(keyed, KEY_A, prompt + " Go on.", cache_salt="project-1")
    assert same["usage"]["prompt_tokens_details"]["cached_tokens"] > 100
    other = _complete(keyed, KEY_A, prompt + " Go on.", cache_salt="project-2")
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    unsalted = _complete(keyed, KEY_A, prompt + " Go on.")
    assert unsalted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_bad_salt_is_a_400(keyed: LiveServer) -> None:
    for salt in ("", 7, ["a"], "x" * 257):
        response = httpx.post(keyed.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY_A}"},
                              json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                                    "cache_salt": salt}, timeout=60)
        assert response.status_code == 400, salt
        assert response.json()["error"]["param"] == "cache_salt"


def test_salts_separate_requests_without_keys_and_through_the_disk_tier(tmp_path: Path) -> None:
    config = ServerConfig(n_ctx=N_CTX, parallel=1, cache_dir=tmp_path / "cache")
    prompt = _prompt("delta")
    live = LiveServer(config)
    try:
        _complete(live, None, prompt, cache_salt="tenant-1")
        hit = _complete(live, None, prompt + " Next.", cache_salt="tenant-1")
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] > 100
    finally:
        live.stop()
    # A new server: an empty RAM tier and idle contexts; the disk tier holds tenant-1's states only.
    live = LiveServer(config)
    try:
        for salt in ("tenant-2", None):
            extra = {"cache_salt": salt} if salt else {}
            cold = _complete(live, None, prompt + " Next.", **extra)
            assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, salt
        warm = _complete(live, None, prompt + " Next.", cache_salt="tenant-1")
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 100
    finally:
        live.stop()


def test_keys_may_share_the_cache_when_the_operator_says_so() -> None:
    live = LiveServer(ServerConfig(n_ctx=N_CTX, parallel=1, api_keys=(KEY_A, KEY_B), cache_shared_across_keys=True))
    try:
        prompt = _prompt("epsilon")
        _complete(live, KEY_A, prompt)
        shared = _complete(live, KEY_B, prompt + " Then.")
        assert shared["usage"]["prompt_tokens_details"]["cached_tokens"] > 100
    finally:
        live.stop()
