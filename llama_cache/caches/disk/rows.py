"""Rows of the disk tier's index, which are untrusted input, and what a process keeps of them.

Everything read from the index is validated here before any other module uses it: ids and sizes are
integers (never bools), keys are blobs of whole non-negative int32 tokens, namespaces and model
descriptions are short texts, payload names match ``ab/<32 hex>.llst`` exactly, and sizes are within
what a state with that many tokens can be (``STATE_BASE_BYTES + STATE_BYTES_PER_TOKEN`` per token, at
most ``MAX_STATE_BYTES``). A row that does not validate raises :class:`BadRow`; callers log and skip
it. A valid row becomes an :class:`Entry` (in memory) and, for listings, a public :class:`DiskEntry`.

Also here: the encoding of keys (``key_blob``, ``key_hash``, ``key_tokens``) and the validation of the
caller-supplied values that end up in rows (fingerprints, model descriptions). Pure functions, no I/O.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from llama_cache.caches.disk.payloads import CODECS, FILE_NAME
from llama_cache.state.chunks import KIND_CHUNKED
from llama_cache.state.format import KIND_LLAMA_CACHE, KIND_UPSTREAM

# Bounds on what the index may claim (everything read from it is untrusted).
MAX_NAMESPACE = 256  # characters of a namespace (fingerprints are 32)
MAX_KEY_TOKENS = 1 << 24  # the longest key (and state) a row may hold
STATE_BASE_BYTES = 256 << 20  # recurrent memory, a logits row, headers...
STATE_BYTES_PER_TOKEN = 4 << 20  # KV per token of the largest models, or a scores row of a huge vocabulary
MAX_STATE_BYTES = 64 << 30  # no encoded state read back is believed larger (state_cap)
_ZLIB_MAX_RATIO = 1032  # deflate cannot compress better than about 1032:1
_MAX_MODEL_INFO = 16  # fields of a model description
_MAX_MODEL_FIELD = 200  # characters of each


@dataclass(frozen=True, slots=True)
class DiskEntry:
    """One entry of a disk cache, as :meth:`LlamaDiskCache.entries` lists it.

    Attributes:
        id: the entry's row id (never reused).
        namespace: the fingerprint of the model that made the state.
        n_tokens: length of the key.
        size: bytes of the payload file (of a chunked entry: its chain head, without the chunks).
        raw_size: bytes of the encoded state (differs from ``size`` when compressed).
        codec: ``"raw"`` or ``"zlib"``.
        file: payload path relative to the data directory.
        created: unix time it was stored.
        accessed: unix time of its last store or hit.
        hits: lookups it answered.
        kind: ``"llama_cache"`` (stored whole), ``"chunked"`` (a llama-cache state stored as a chain
            head and shared chunks) or ``"llama_cpp"`` (llama-cpp-python's ``LlamaState``).
        can_be_cut: whether the state answers queries diverging from its key.
    """

    id: int
    namespace: str
    n_tokens: int
    size: int
    raw_size: int
    codec: str
    file: str
    created: float
    accessed: float
    hits: int
    kind: str = "llama_cache"
    can_be_cut: bool = True



class Entry:
    """What a process keeps in memory per entry (the key lives in the radix index, not here)."""

    __slots__ = ("id", "namespace", "size", "raw_size", "file", "codec", "recency", "kind", "cut", "logits",
                 "n_state", "n_key")

    def __init__(
        self, id: int, namespace: str, size: int, raw_size: int, file: str, codec: str, recency: int,
        kind: int, cut: bool, logits: bool, n_state: int, n_key: int,
    ) -> None:
        self.id = id
        self.namespace = namespace
        self.size = size
        self.raw_size = raw_size
        self.file = file
        self.codec = codec
        self.recency = recency
        self.kind = kind
        self.cut = cut
        self.logits = logits
        self.n_state = n_state
        self.n_key = n_key


class BadRow(Exception):
    """A row of the index that does not validate."""


def is_int(value: object) -> bool:
    """Whether ``value`` is an ``int`` and not a ``bool`` (what SQLite hands back for an integer column)."""
    return isinstance(value, int) and not isinstance(value, bool)


def state_cap(n_key: int) -> int:
    """The most bytes an encoded state filed under a key of ``n_key`` tokens may take."""
    return min(MAX_STATE_BYTES, STATE_BASE_BYTES + n_key * STATE_BYTES_PER_TOKEN)


def entry_from_row(row: Sequence[Any]) -> tuple[Entry, npt.NDArray[np.int32]]:
    """Validate one ``entries`` row (columns of ``ENTRY_ROW``) and return its entry and key.

    Raises:
        BadRow: anything about the row is wrong.
    """
    if len(row) != 12:
        raise BadRow("wrong number of columns")
    entry_id, namespace, key, kind, cut, logits, n_state, file, size, raw_size, codec, recency = row
    if not is_int(entry_id):
        raise BadRow("id is not an integer")
    if not isinstance(namespace, str) or not 0 < len(namespace) <= MAX_NAMESPACE:
        raise BadRow("namespace is not a short non-empty text")
    if not isinstance(key, bytes) or len(key) % 4 or len(key) > 4 * MAX_KEY_TOKENS:
        raise BadRow("key is not a blob of int32 tokens")
    tokens = key_tokens(key)
    if len(tokens) and int(tokens.min()) < 0:
        raise BadRow("key holds a negative token")
    if kind not in (KIND_LLAMA_CACHE, KIND_UPSTREAM, KIND_CHUNKED) or not is_int(kind):
        raise BadRow("unknown kind")
    if cut not in (0, 1) or logits not in (0, 1) or not is_int(cut) or not is_int(logits):
        raise BadRow("cut/logits are not 0 or 1")
    if kind in (KIND_UPSTREAM, KIND_CHUNKED) and not cut:
        raise BadRow("a llama-cpp-python or chunked state is always cut")
    if not is_int(n_state) or not len(tokens) <= n_state <= MAX_KEY_TOKENS:
        raise BadRow("n_state is not a token count at least the key's")
    if not isinstance(file, str) or not FILE_NAME.fullmatch(file):
        raise BadRow("file is not a payload name")
    cap = state_cap(len(tokens))
    if not is_int(size) or not 0 < size <= cap:
        raise BadRow("size out of bounds")
    if codec not in CODECS or not isinstance(codec, str):
        raise BadRow("unknown codec")
    if not is_int(raw_size) or not 0 < raw_size <= cap:
        raise BadRow("raw_size out of bounds")
    if codec == "raw" and raw_size != size:
        raise BadRow("raw payload whose raw_size differs from its size")
    if codec == "zlib" and raw_size > size * _ZLIB_MAX_RATIO + 1024:
        raise BadRow("raw_size beyond what the compressed size can hold")
    if not is_int(recency):
        raise BadRow("recency is not an integer")
    entry = Entry(entry_id, namespace, size, raw_size, file, codec, recency, kind, bool(cut), bool(logits),
                   n_state, len(tokens))
    return entry, tokens


def model_info_from_row(fingerprint: Any, info: Any) -> dict[str, str]:
    """Validate one ``models`` row. Raises BadRow."""
    if not isinstance(fingerprint, str) or not 0 < len(fingerprint) <= MAX_NAMESPACE:
        raise BadRow("fingerprint is not a short non-empty text")
    if not isinstance(info, str) or len(info) > 8 * _MAX_MODEL_INFO * _MAX_MODEL_FIELD:
        raise BadRow("info is not a short text")
    try:
        parsed = json.loads(info)
    except ValueError:
        raise BadRow("info is not JSON") from None
    try:
        return check_model_info(parsed)
    except (TypeError, ValueError) as error:
        raise BadRow(str(error)) from None


def check_model_info(info: object) -> dict[str, str]:
    """A model description: a mapping of at most 16 short strings to short strings.

    Raises:
        TypeError, ValueError: it is not one.
    """
    if not isinstance(info, Mapping):
        raise TypeError(f"model_info must be a mapping of str to str, got {type(info).__name__}")
    if len(info) > _MAX_MODEL_INFO:
        raise ValueError(f"model_info has more than {_MAX_MODEL_INFO} fields")
    out: dict[str, str] = {}
    for name, value in info.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError("model_info must map str to str")
        if not name or len(name) > _MAX_MODEL_FIELD or len(value) > _MAX_MODEL_FIELD:
            raise ValueError(f"model_info field {name[:40]!r} is empty or too long")
        out[name] = value
    return out


def check_fingerprint(fingerprint: object) -> None:
    """Refuse a fingerprint argument that is not None or a short non-empty str (TypeError, ValueError)."""
    if fingerprint is None:
        return
    if not isinstance(fingerprint, str):
        raise TypeError(f"fingerprint must be a str or None, got {type(fingerprint).__name__}")
    if not 0 < len(fingerprint) <= MAX_NAMESPACE:
        raise ValueError(f"fingerprint must be 1..{MAX_NAMESPACE} characters")


def key_blob(tokens: npt.NDArray[np.int32]) -> bytes:
    """A key as the index stores it: int32 little-endian."""
    return np.ascontiguousarray(tokens, dtype="<i4").tobytes()


def key_hash(blob: bytes) -> bytes:
    """The ``key_hash`` column of a key's blob (BLAKE2b-128): what the uniqueness constraint compares."""
    return hashlib.blake2b(blob, digest_size=16).digest()


def key_tokens(blob: bytes) -> npt.NDArray[np.int32]:
    """The tokens of a key blob (a view of it; the caller checks the length and the values)."""
    return np.frombuffer(blob, dtype="<i4")


def as_float(value: object) -> float:
    """A timestamp column read back: the number when it is a finite one, else 0.0."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) else 0.0

