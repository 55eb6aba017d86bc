"""Where the Responses API keeps stored responses (``store: true``): in RAM, on disk or in Redis.

A :class:`StoredResponse` is what a follow-up (``previous_response_id``) and ``GET /v1/responses/{id}``
need: the response object as served, the conversation it ends (chat messages, the chain's, without any
``instructions``) and the tokens its context held once it was answered (the rendered prompt and the
generated tokens).

Every backend honours the same contract (:class:`ResponseStore`):

- **Bounded**: a record larger than ``max_record_bytes`` once encoded is not stored (``put`` returns
  False, logged); the records held take at most ``capacity_bytes`` in all, the oldest dropped first.
- **Expiring**: a record is gone ``ttl`` seconds after it was stored (wall-clock time, the same on every
  instance).
- **Bound to its owner**: ``get`` and ``delete`` name the owner (a digest of the API key that made it,
  :func:`owner_of`); another owner's record is a miss, exactly as an unknown id is.
- **Validated**: whatever is read back is checked (its size, every field's type, the lengths, the id it
  is stored under) before use; a bad value is a logged miss, and it is deleted. Nothing a store holds
  can make ``get`` raise.
- **Failing softly**: a backend that cannot be reached (Redis down) fails ``get`` as a miss and ``put``
  as not stored, logged; nothing raises out of ``get``, ``put`` or ``delete``.

Backends: :class:`MemoryResponseStore` (an LRU by bytes), :class:`DiskResponseStore` (one SQLite file,
under ``--cache-dir``), :class:`RedisResponseStore` (the shared tier, ``--redis``: every instance behind
a balancer serves every stored response). :func:`open_store` picks the one a server's settings ask for.

Thread-safety: every store may be called from any thread.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import math
import re
import secrets
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["DiskResponseStore", "MemoryResponseStore", "RedisResponseStore", "ResponseStore", "StoredResponse",
           "is_response_id", "new_response_id", "open_store", "owner_of"]

logger = logging.getLogger(__name__)

DEFAULT_TTL = 24 * 3600.0
DEFAULT_CAPACITY_BYTES = 256 << 20
DEFAULT_MAX_RECORD_BYTES = 8 << 20
_RESPONSE_ID = re.compile(r"resp_[0-9a-f]{48}")
_FORMAT = 1
_ROLES = frozenset({"system", "user", "assistant", "tool"})
_MAX_TOKEN = 1 << 30


def new_response_id() -> str:
    """A fresh response id: ``resp_`` and 192 random bits (unguessable)."""
    return "resp_" + secrets.token_hex(24)


def is_response_id(text: object) -> bool:
    """Whether ``text`` has the shape of an id this server makes (checked before any store is asked)."""
    return isinstance(text, str) and _RESPONSE_ID.fullmatch(text) is not None


def owner_of(key_digest: bytes | None) -> str:
    """The owner a response made with this API key (its SHA-256 digest; None: no key) is stored under:
    a digest of it, never the key; ``""`` without a key."""
    if key_digest is None:
        return ""
    return hashlib.blake2b(key_digest, digest_size=16, person=b"llc-responses").hexdigest()


@dataclass(frozen=True)
class StoredResponse:
    """One stored response.

    Attributes:
        id: its id (``resp_...``).
        owner: :func:`owner_of` the key that made it.
        expires_at: wall-clock time (``time.time()``) after which it is gone.
        response: the response object, as ``GET /v1/responses/{id}`` serves it.
        conversation: the chat messages it ends (``{"role", "content"}``, and ``tool_call_id`` for a
            tool's output), the previous responses' included, its answer last; no instructions.
        tokens: the tokens its context held once answered (the prompt and what was generated).
    """

    id: str
    owner: str
    expires_at: float
    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    tokens: list[int]

    def encode(self) -> bytes:
        """The record as bytes (JSON; the tokens as base64 of little-endian int32)."""
        packed = base64.b64encode(np.asarray(self.tokens, dtype="<i4").tobytes()).decode("ascii")
        return json.dumps({"v": _FORMAT, "id": self.id, "owner": self.owner, "expires_at": self.expires_at,
                           "response": self.response, "conversation": self.conversation, "tokens": packed},
                          ensure_ascii=False, separators=(",", ":")).encode("utf-8")

    @classmethod
    def decode(cls, data: object, response_id: str, max_bytes: int) -> StoredResponse:
        """The record in ``data``, stored under ``response_id``, checked field by field.

        Raises:
            BadRecord: anything is not as :meth:`encode` writes it (the reason says what).
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise BadRecord(f"a {type(data).__name__}, not bytes")
        if len(data) > max_bytes:
            raise BadRecord(f"{len(data)} bytes, more than the {max_bytes} a record may hold")
        try:
            value = json.loads(bytes(data))
        except (ValueError, RecursionError) as error:
            raise BadRecord(f"not JSON ({type(error).__name__})") from None
        if not isinstance(value, dict) or value.get("v") != _FORMAT:
            raise BadRecord("not a record of this format")
        if value.get("id") != response_id:
            raise BadRecord("stored under another id")
        owner, expires, response = value.get("owner"), value.get("expires_at"), value.get("response")
        if not isinstance(owner, str) or len(owner) > 64:
            raise BadRecord("a bad owner")
        if isinstance(expires, bool) or not isinstance(expires, (int, float)) or not math.isfinite(expires):
            raise BadRecord("a bad expiry")
        if not isinstance(response, dict) or response.get("id") != response_id or not isinstance(
                response.get("output"), list):
            raise BadRecord("a bad response object")
        conversation = value.get("conversation")
        if not isinstance(conversation, list) or not all(_is_message(m) for m in conversation):
            raise BadRecord("a bad conversation")
        packed = value.get("tokens")
        if not isinstance(packed, str):
            raise BadRecord("bad tokens")
        try:
            raw = base64.b64decode(packed, validate=True)
        except ValueError:
            raise BadRecord("bad tokens") from None
        if len(raw) % 4:
            raise BadRecord("bad tokens")
        tokens = np.frombuffer(raw, dtype="<i4")
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= _MAX_TOKEN):
            raise BadRecord("a token out of range")
        return cls(id=response_id, owner=owner, expires_at=float(expires), response=response,
                   conversation=conversation, tokens=tokens.tolist())


def _is_message(message: object) -> bool:
    if not isinstance(message, dict) or not isinstance(message.get("content"), str):
        return False
    role = message.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        return False
    call = message.get("tool_call_id")
    return call is None or isinstance(call, str)


class BadRecord(ValueError):
    """A stored value that is not a record (damaged, truncated, or written by something else)."""


class ResponseStore:
    """The contract every backend honours (see the module's docstring).

    Args:
        ttl: seconds a record lives.
        capacity_bytes: bytes the records may take in all.
        max_record_bytes: the largest record stored.
        clock: the wall clock (``time.time``), for tests.
    """

    name = "store"

    def __init__(self, ttl: float = DEFAULT_TTL, capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, clock: Callable[[], float] = time.time) -> None:
        if not ttl > 0 or capacity_bytes <= 0 or max_record_bytes <= 0:
            raise ValueError("ttl, capacity_bytes and max_record_bytes must be positive")
        self.ttl = float(ttl)
        self.capacity_bytes = int(capacity_bytes)
        self.max_record_bytes = int(min(max_record_bytes, capacity_bytes))
        self.clock = clock

    def put(self, record: StoredResponse) -> bool:
        """Store ``record`` (its ``expires_at`` is set from ``ttl`` here); False if it was not stored
        (too large, or the backend failed: logged)."""
        data = StoredResponse(record.id, record.owner, self.clock() + self.ttl, record.response,
                              record.conversation, record.tokens).encode()
        if len(data) > self.max_record_bytes:
            logger.warning("response %s not stored: %d bytes, more than the %d a stored response may take",
                           _short(record.id), len(data), self.max_record_bytes)
            return False
        try:
            self._put(record.id, data)
        except Exception as error:  # noqa: BLE001 - a store that fails is a store that did not keep it
            logger.warning("response %s not stored: the %s store failed: %s: %s", _short(record.id), self.name,
                           type(error).__name__, error)
            return False
        return True

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The record stored under ``response_id`` for ``owner``, or None (unknown, expired, another
        owner's, damaged: logged and deleted, or the backend failed: logged)."""
        if not is_response_id(response_id):
            return None
        try:
            data = self._get(response_id)
        except Exception as error:  # noqa: BLE001 - a failing store holds nothing
            logger.warning("response %s not read: the %s store failed: %s: %s", _short(response_id), self.name,
                           type(error).__name__, error)
            return None
        if data is None:
            return None
        try:
            record = StoredResponse.decode(data, response_id, self.max_record_bytes)
        except BadRecord as error:
            logger.warning("stored response %s is damaged (%s): treated as missing and deleted",
                           _short(response_id), error)
            self._forget(response_id)
            return None
        if record.expires_at <= self.clock():
            self._forget(response_id)
            return None
        if not hmac.compare_digest(record.owner, owner):
            return None
        return record

    def delete(self, response_id: str, owner: str) -> bool:
        """Delete the record stored under ``response_id`` for ``owner``; False if there was none for them."""
        if self.get(response_id, owner) is None:
            return False
        return self._forget(response_id)

    def close(self) -> None:
        """Release the backend's resources (idempotent)."""

    def _forget(self, response_id: str) -> bool:
        try:
            return self._delete(response_id)
        except Exception as error:  # noqa: BLE001
            logger.warning("response %s not deleted: the %s store failed: %s: %s", _short(response_id), self.name,
                           type(error).__name__, error)
            return False

    # -- what a backend implements ---------------------------------------------------------------

    def _put(self, response_id: str, data: bytes) -> None:
        raise NotImplementedError

    def _get(self, response_id: str) -> object:
        """The bytes stored under ``response_id`` (None: nothing); a backend may return anything it
        read: :meth:`get` checks it."""
        raise NotImplementedError

    def _delete(self, response_id: str) -> bool:
        raise NotImplementedError


def _short(response_id: str) -> str:
    """Enough of an id for a log line, not enough to use it."""
    return response_id[:13] + "..."


class MemoryResponseStore(ResponseStore):
    """Records in this process's memory, in the order they were stored: the expired ones, then the
    oldest past the capacity, are dropped at each store (O(1) per record dropped)."""

    name = "memory"

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        self._records: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def _put(self, response_id: str, data: bytes) -> None:
        expires = self.clock() + self.ttl
        with self._lock:
            self._drop(response_id)
            self._records[response_id] = (expires, data)
            self._bytes += len(data)
            now = self.clock()
            # Stored in order with one ttl: the oldest expire first, at the front.
            while self._records and (self._bytes > self.capacity_bytes or next(iter(self._records.values()))[0] <= now):
                self._drop(next(iter(self._records)))

    def _get(self, response_id: str) -> object:
        with self._lock:
            entry = self._records.get(response_id)
            return None if entry is None else entry[1]

    def _delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        entry = self._records.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= len(entry[1])
        return True

    @property
    def nbytes(self) -> int:
        """Bytes of the records held."""
        return self._bytes


class DiskResponseStore(ResponseStore):
    """Records in one SQLite file (``path``), shared by the processes that open it.

    Each store drops the expired records, then the oldest until the rest fit the capacity. A file that is
    not a readable database of this store's schema is moved aside (``<path>.damaged-<time>``, logged) and
    a new one started.
    """

    name = "disk"

    def __init__(self, path: Path, **settings: Any) -> None:
        super().__init__(**settings)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        with self._lock:
            self._open()

    def _open(self) -> sqlite3.Connection:
        if self._conn is not None:
            return self._conn
        for attempt in range(2):
            conn = sqlite3.connect(self.path, timeout=10.0, isolation_level=None, check_same_thread=False)
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, expires REAL NOT NULL, "
                             "stored REAL NOT NULL, size INTEGER NOT NULL, data BLOB NOT NULL)")
                conn.execute("CREATE INDEX IF NOT EXISTS responses_stored ON responses (stored)")
                conn.execute("SELECT id, expires, stored, size, data FROM responses LIMIT 0")
            except sqlite3.DatabaseError as error:
                conn.close()
                if attempt:
                    raise
                aside = self.path.with_name(f"{self.path.name}.damaged-{int(time.time())}")
                logger.warning("the stored responses' file %s is damaged (%s): moved to %s, starting empty",
                               self.path, error, aside.name)
                self.path.replace(aside)
                continue
            self._conn = conn
            return conn
        raise AssertionError("unreachable")

    def _put(self, response_id: str, data: bytes) -> None:
        now = self.clock()
        with self._lock:
            conn = self._open()
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
                             (response_id, now + self.ttl, now, len(data), data))
                conn.execute("DELETE FROM responses WHERE expires <= ?", (now,))
                total = conn.execute("SELECT COALESCE(SUM(size), 0) FROM responses").fetchone()[0]
                while total > self.capacity_bytes:
                    oldest = conn.execute("SELECT id, size FROM responses ORDER BY stored LIMIT 1").fetchone()
                    if oldest is None:
                        break
                    conn.execute("DELETE FROM responses WHERE id = ?", (oldest[0],))
                    total -= oldest[1]
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

    def _get(self, response_id: str) -> object:
        with self._lock:
            row = self._open().execute("SELECT data FROM responses WHERE id = ?", (response_id,)).fetchone()
        return None if row is None else row[0]

    def _delete(self, response_id: str) -> bool:
        with self._lock:
            return self._open().execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


# Stores a record and keeps the records within their capacity. KEYS: record, index (sorted set of ids by
# expiry), sizes (hash id -> bytes), total (bytes held); all tagged {llc-responses}: one slot. ARGV: id,
# data, ttl in milliseconds, expiry, now, capacity, key prefix.
_PUT = """
local record, index, sizes, total = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local id, data, ttl, expires, now, capacity, prefix = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6]), ARGV[7]
local function drop(member)
  local size = tonumber(redis.call('HGET', sizes, member) or '0')
  redis.call('DEL', prefix .. member)
  redis.call('ZREM', index, member)
  redis.call('HDEL', sizes, member)
  if size > 0 then redis.call('DECRBY', total, size) end
end
drop(id)
redis.call('SET', record, data, 'PX', ttl)
redis.call('ZADD', index, expires, id)
redis.call('HSET', sizes, id, #data)
redis.call('INCRBY', total, #data)
for _, member in ipairs(redis.call('ZRANGEBYSCORE', index, '-inf', now)) do drop(member) end
while tonumber(redis.call('GET', total) or '0') > capacity do
  local oldest = redis.call('ZRANGE', index, 0, 0)[1]
  if not oldest then break end
  drop(oldest)
end
return 1
"""
# Deletes a record. KEYS: record, index, sizes, total. ARGV: id.
_DELETE = """
local size = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0')
local gone = redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
if size > 0 then redis.call('DECRBY', KEYS[4], size) end
return gone
"""


class RedisResponseStore(ResponseStore):
    """Records in Redis (a server or a cluster), shared by every instance that names it.

    Keys (the tag puts them in one cluster slot, so one script updates them atomically)::

        llc:{llc-responses}:r:<id>      a record, expiring by itself (PX ttl)
        llc:{llc-responses}:index       sorted set: ids by expiry (oldest first)
        llc:{llc-responses}:sizes       hash: id -> bytes
        llc:{llc-responses}:bytes       bytes held

    Each store drops the expired ids, then the oldest records until the bytes fit the capacity, in one
    script. Every call is bounded by ``timeout`` seconds.

    Args:
        url: the Redis URL (as ``--redis``; several ``host:port`` for a cluster).
        timeout: seconds each call may take.
    """

    name = "redis"
    _PREFIX = "llc:{llc-responses}:"

    def __init__(self, url: str, timeout: float = 2.0, **settings: Any) -> None:
        super().__init__(**settings)
        from llama_cache.caches.redis_client import connect

        self._client = connect(url, timeout, cluster=False)
        self._put_script = self._client.register_script(_PUT)
        self._delete_script = self._client.register_script(_DELETE)

    def _keys(self, response_id: str) -> list[str]:
        prefix = self._PREFIX
        return [f"{prefix}r:{response_id}", f"{prefix}index", f"{prefix}sizes", f"{prefix}bytes"]

    def _put(self, response_id: str, data: bytes) -> None:
        now = self.clock()
        self._put_script(keys=self._keys(response_id),
                         args=[response_id, data, max(int(self.ttl * 1000), 1), repr(now + self.ttl), repr(now),
                               self.capacity_bytes, f"{self._PREFIX}r:"])

    def _get(self, response_id: str) -> object:
        return self._client.get(self._keys(response_id)[0])

    def _delete(self, response_id: str) -> bool:
        return bool(self._delete_script(keys=self._keys(response_id), args=[response_id]))

    def close(self) -> None:
        self._client.close()


def open_store(*, redis_url: str | None, cache_dir: Path | None, ttl: float = DEFAULT_TTL,
               capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
               max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> ResponseStore:
    """The store a server's settings ask for: Redis when ``redis_url`` is set (every instance sees every
    stored response), else the disk under ``cache_dir`` (``responses/responses.sqlite3``), else memory."""
    settings: dict[str, Any] = dict(ttl=ttl, capacity_bytes=capacity_bytes, max_record_bytes=max_record_bytes)
    if redis_url is not None:
        return RedisResponseStore(redis_url, **settings)
    if cache_dir is not None:
        return DiskResponseStore(Path(cache_dir) / "responses" / "responses.sqlite3", **settings)
    return MemoryResponseStore(**settings)
