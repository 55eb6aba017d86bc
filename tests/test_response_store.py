"""The stored responses' backends (RAM, SQLite on disk, a real Redis) honour one contract: bounded per
record and in all, expiring, bound to their owner, and whatever is read back is checked: a bad value
is a logged miss, never an exception."""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llama_cache.server.response_store import (
    DiskResponseStore,
    MemoryResponseStore,
    RedisResponseStore,
    ResponseStore,
    StoredResponse,
    is_response_id,
    new_response_id,
    owner_of,
)
from llama_cache.testing.redis_server import RedisCluster, RedisServer, redis_available

KINDS = ["memory", "disk", "redis"]


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def _record(owner: str = "", text: str = "hello", tokens: list[int] | None = None) -> StoredResponse:
    response_id = new_response_id()
    response = {"id": response_id, "object": "response", "output": [
        {"type": "message", "id": "msg_1", "role": "assistant", "content": [{"type": "output_text", "text": text}]}]}
    return StoredResponse(id=response_id, owner=owner, expires_at=0.0, response=response,
                          conversation=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": text}],
                          tokens=tokens if tokens is not None else [1, 2, 3, 40000])


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    if not redis_available():
        pytest.skip("redis-server is not installed")
    with RedisServer() as server:
        yield server.url


def _store(kind: str, tmp_path: Path, redis_url: str | None, **settings: Any) -> ResponseStore:
    if kind == "memory":
        return MemoryResponseStore(**settings)
    if kind == "disk":
        return DiskResponseStore(tmp_path / "responses.sqlite3", **settings)
    assert redis_url is not None
    store = RedisResponseStore(redis_url, **settings)
    store._client.flushdb()  # noqa: SLF001 - a clean database per test
    return store


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    url = request.getfixturevalue("redis_url") if kind == "redis" else None
    made: list[ResponseStore] = []

    def factory(**settings: Any) -> ResponseStore:
        store = _store(kind, tmp_path, url, **settings)
        made.append(store)
        return store

    yield factory
    for store in made:
        store.close()


def test_ids_are_unguessable_and_checked() -> None:
    ids = {new_response_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(is_response_id(i) and len(i) == 5 + 48 for i in ids)
    for bad in ("resp_", "resp_../../etc", "msg_" + "0" * 48, None, 12, "resp_" + "G" * 48):
        assert not is_response_id(bad)
    assert owner_of(None) == ""
    assert owner_of(b"a" * 32) != owner_of(b"b" * 32)
    assert b"a" * 32 not in bytes.fromhex(owner_of(b"a" * 32))


def test_a_record_round_trips_for_its_owner_only(make: Any) -> None:
    store = make()
    record = _record(owner=owner_of(b"k" * 32))
    assert store.put(record)
    got = store.get(record.id, owner_of(b"k" * 32))
    assert got is not None
    assert (got.response, got.conversation, got.tokens) == (record.response, record.conversation, record.tokens)
    assert store.get(record.id, owner_of(b"x" * 32)) is None
    assert store.get(record.id, "") is None
    assert not store.delete(record.id, owner_of(b"x" * 32))  # another owner deletes nothing
    assert store.get(record.id, owner_of(b"k" * 32)) is not None
    assert store.delete(record.id, owner_of(b"k" * 32))
    assert store.get(record.id, owner_of(b"k" * 32)) is None
    assert not store.delete(record.id, owner_of(b"k" * 32))
    assert store.get(new_response_id(), "") is None


def test_a_record_too_large_is_not_stored(make: Any, caplog: pytest.LogCaptureFixture) -> None:
    store = make(max_record_bytes=2000)
    large = _record(text="x" * 5000)
    with caplog.at_level(logging.WARNING, logger="llama_cache.server.response_store"):
        assert not store.put(large)
    assert "not stored" in caplog.text
    assert store.get(large.id, "") is None
    small = _record()
    assert store.put(small)
    assert store.get(small.id, "") is not None


def test_the_oldest_records_go_first_past_the_capacity(make: Any) -> None:
    size = len(_record().encode())
    store = make(capacity_bytes=size * 3 + size // 2, max_record_bytes=size * 2)
    records = [_record() for _ in range(6)]
    for record in records:
        assert store.put(record)
        time.sleep(0.002)  # distinct store times on disk
    held = [store.get(record.id, "") is not None for record in records]
    assert held == [False, False, False, True, True, True]


def test_records_expire(kind: str, make: Any) -> None:
    if kind == "redis":  # Redis expires keys by its own clock
        store = make(ttl=1.0)
        record = _record()
        assert store.put(record)
        assert store.get(record.id, "") is not None
        time.sleep(1.3)
        assert store.get(record.id, "") is None
        return
    clock = Clock()
    store = make(ttl=60.0, clock=clock)
    record = _record()
    assert store.put(record)
    clock.now += 59
    assert store.get(record.id, "") is not None
    clock.now += 2
    assert store.get(record.id, "") is None
    later = _record()
    assert store.put(later)  # a store drops the expired ones
    assert store.get(later.id, "") is not None


# ----------------------------------------------------------------------------------------- tampering

def _tampered(record: StoredResponse) -> dict[str, Any]:
    """Ways a stored value can be bad, each as the bytes (or value) written in its place."""
    good = json.loads(record.encode())
    cases: dict[str, Any] = {
        "garbage": b"\x00\xff not json",
        "truncated": record.encode()[:-10],
        "a list": b"[1, 2, 3]",
        "another format": json.dumps({**good, "v": 99}).encode(),
        "another id": json.dumps({**good, "id": new_response_id()}).encode(),
        "owner not a string": json.dumps({**good, "owner": 7}).encode(),
        "expiry a string": json.dumps({**good, "expires_at": "soon"}).encode(),
        "expiry infinite": json.dumps({**good, "expires_at": float("inf")}).encode(),
        "response not an object": json.dumps({**good, "response": []}).encode(),
        "response of another id": json.dumps({**good, "response": {**good["response"], "id": "resp_x"}}).encode(),
        "output not a list": json.dumps({**good, "response": {**good["response"], "output": "x"}}).encode(),
        "conversation not a list": json.dumps({**good, "conversation": {}}).encode(),
        "a message without content": json.dumps({**good, "conversation": [{"role": "user"}]}).encode(),
        "a message of a bad role": json.dumps({**good, "conversation": [{"role": "root", "content": ""}]}).encode(),
        "a role that is a list": json.dumps({**good, "conversation": [{"role": ["user"], "content": ""}]}).encode(),
        "a tool call id that is a number": json.dumps({**good, "conversation": [
            {"role": "tool", "content": "", "tool_call_id": 5}]}).encode(),
        "tokens not base64": json.dumps({**good, "tokens": "!!!"}).encode(),
        "tokens of a bad length": json.dumps({**good, "tokens": "AAA="}).encode(),
        "a negative token": json.dumps({**good, "tokens": "/////w=="}).encode(),
        "deep nesting": b"[" * 100000 + b"]" * 100000,
        "too large": b" " * 5000,
    }
    return cases


def _overwrite(kind: str, store: ResponseStore, tmp_path: Path, response_id: str, value: Any) -> None:
    if kind == "memory":
        store._records[response_id] = (time.time() + 60, value)  # noqa: SLF001 - tampering with what it holds
    elif kind == "disk":
        with sqlite3.connect(tmp_path / "responses.sqlite3") as conn:
            conn.execute("UPDATE responses SET data = ? WHERE id = ?", (value, response_id))
    else:
        store._client.set(f"llc:{{llc-responses}}:r:{response_id}", value)  # noqa: SLF001


def test_a_bad_stored_value_is_a_logged_miss_and_is_deleted(kind: str, make: Any, tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    store = make(max_record_bytes=4000)
    record = _record()
    for case, value in _tampered(record).items():
        assert store.put(record)
        _overwrite(kind, store, tmp_path, record.id, value)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="llama_cache.server.response_store"):
            assert store.get(record.id, "") is None, case
        assert "damaged" in caplog.text, case
        assert record.id not in caplog.text  # a log line never holds a usable id
        assert not store.delete(record.id, ""), case  # it was deleted
    if kind == "disk":  # a value of another type in the column
        assert store.put(record)
        with sqlite3.connect(tmp_path / "responses.sqlite3") as conn:
            conn.execute("UPDATE responses SET data = ? WHERE id = ?", ("text, not bytes", record.id))
        assert store.get(record.id, "") is None


def test_a_damaged_database_file_is_moved_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "responses.sqlite3"
    path.write_bytes(b"this is not a database" * 100)
    with caplog.at_level(logging.WARNING, logger="llama_cache.server.response_store"):
        store = DiskResponseStore(path)
    assert "damaged" in caplog.text
    assert list(tmp_path.glob("responses.sqlite3.damaged-*"))
    record = _record()
    assert store.put(record)
    assert store.get(record.id, "") is not None
    store.close()


def test_a_redis_store_that_cannot_be_reached_fails_softly(caplog: pytest.LogCaptureFixture) -> None:
    if not redis_available():
        pytest.skip("redis-server is not installed")
    server = RedisServer()
    store = RedisResponseStore(server.url, timeout=0.5)
    record = _record()
    assert store.put(record)
    server.stop()
    with caplog.at_level(logging.WARNING, logger="llama_cache.server.response_store"):
        assert store.get(record.id, "") is None
        assert not store.put(_record())
        assert not store.delete(record.id, "")
    assert "failed" in caplog.text
    store.close()


def test_a_redis_cluster_holds_the_records() -> None:
    """The records and their index share one hash tag: one slot, so the scripts run on a cluster too."""
    if not redis_available():
        pytest.skip("redis-server is not installed")
    with RedisCluster(3) as cluster:
        store = RedisResponseStore(cluster.url)
        record = _record()
        assert store.put(record)
        assert store.get(record.id, "") is not None
        assert store.delete(record.id, "")
        assert store.get(record.id, "") is None
        store.close()
