"""Model fingerprints: which model bytes and KV-shaping configuration a state belongs to.

A state is restored only into a context whose fingerprint equals the one it was made with. The
fingerprint covers:

- **the model's bytes**: a hash (XXH3-128) of the whole GGUF file, so two files differing anywhere (an
  edited layer, a partial merge) never share states. Hashing runs at disk speed once per file; the
  result is remembered per (device, inode, size, modification time), in this process and in a small
  file under ``~/.cache/llama-cache`` (``$LLAMA_CACHE_HOME``), so a model is hashed once per machine
  until it changes. :func:`file_identity` documents the cost.
- **what llama-cpp-python applies to the model**: metadata overrides (``kv_overrides``) and the LoRA
  adapter (its file's identity, base and scale);
- **the model's shape**: description, parameter count, layers, embedding size, heads, vocabulary, whether
  it is recurrent or hybrid;
- **every context parameter that changes what the KV holds or how it is read** (:data:`COVERED_PARAMS`):
  the RoPE/YaRN family (K is stored after RoPE), KV types, flash attention (V's layout), sliding-window
  cache size, unified KV, sequence and recurrent-snapshot counts, context type, embeddings, pooling
  and attention type.

Deliberately not covered (:data:`IGNORED_PARAMS`): sizes and scheduling that do not change a state's
bytes or meaning (``n_ctx``: a state fits any context large enough for it; ``n_batch``, ``n_ubatch``,
output buffer sizes, threads, defragmentation, offloading, callbacks, performance counters, backend
samplers). Control vectors set through the low-level C API (``llama_set_adapter_cvec``) are invisible
here, as llama-cpp-python does not apply them itself; callers who use them must keep separate caches.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from collections.abc import Mapping, Sequence
from typing import Any

import llama_cpp
import xxhash

logger = logging.getLogger(__name__)

__all__ = ["COVERED_PARAMS", "IGNORED_PARAMS", "MAX_NAMESPACE_BYTES", "file_identity", "model_description",
           "context_fingerprint", "describe_model", "model_fingerprint", "namespaced_fingerprint"]

MAX_NAMESPACE_BYTES = 4096
"""The longest cache namespace accepted, in UTF-8 bytes."""

COVERED_PARAMS: tuple[str, ...] = (
    "n_seq_max",
    "n_rs_seq",
    "ctx_type",
    "rope_scaling_type",
    "pooling_type",
    "attention_type",
    "flash_attn_type",
    "rope_freq_base",
    "rope_freq_scale",
    "yarn_ext_factor",
    "yarn_attn_factor",
    "yarn_beta_fast",
    "yarn_beta_slow",
    "yarn_orig_ctx",
    "type_k",
    "type_v",
    "embeddings",
    "swa_full",
    "kv_unified",
)
"""``llama_context_params`` fields in the fingerprint: each changes what the KV holds or how it is read."""

IGNORED_PARAMS: tuple[str, ...] = (
    "n_ctx",
    "n_batch",
    "n_ubatch",
    "n_outputs_max",
    "n_outputs_max_per_seq",
    "n_threads",
    "n_threads_batch",
    "defrag_thold",
    "cb_eval",
    "cb_eval_user_data",
    "abort_callback",
    "abort_callback_data",
    "offload_kqv",
    "no_perf",
    "op_offload",
    "samplers",
    "n_samplers",
    "ctx_other",
)
"""``llama_context_params`` fields deliberately left out: sizes, scheduling and placement only."""

_READ_BLOCK = 8 << 20
_memo: dict[tuple[int, int, int, int], str] = {}
_memo_lock = threading.Lock()


def _memo_file() -> Path:
    root = os.environ.get("LLAMA_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "llama-cache")
    return Path(root) / "file-identities.json"


def _load_memo_file() -> dict[str, str]:
    try:
        with open(_memo_file(), encoding="utf-8") as file:
            data = json.load(file)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str) and len(v) == 32}


def _save_memo_file(key: str, identity: str) -> None:
    """Remember an identity across processes; best effort (a read-only home only costs a re-hash)."""
    path = _memo_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _load_memo_file()
        data[key] = identity
        if len(data) > 256:  # keep the newest entries only: files come and go
            data = dict(list(data.items())[-256:])
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        with open(temporary, "w", encoding="utf-8") as file:
            json.dump(data, file)
        os.replace(temporary, path)
    except OSError as error:
        logger.debug("could not remember a model file's identity in %s: %s", path, error)


def file_identity(path: str | os.PathLike[str]) -> str:
    """A content hash of a whole file (XXH3-128 of its size and every byte): 32 hex characters.

    Complexity: one sequential read of the file the first time (about the disk's read speed; from the
    page cache, XXH3 runs at several GB/s), then O(1): the identity is remembered per (device, inode,
    size, modification time in ns) in this process and in ``file-identities.json`` under
    ``$LLAMA_CACHE_HOME`` (default ``~/.cache/llama-cache``). A file rewritten in place gets a new
    modification time and is hashed again. Thread-safe.

    Raises:
        OSError: the file cannot be read.
    """
    info = os.stat(path)
    stamp = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
    with _memo_lock:
        known = _memo.get(stamp)
    if known is not None:
        return known
    memo_key = f"{os.path.realpath(path)}|{'|'.join(map(str, stamp))}"
    remembered = _load_memo_file().get(memo_key)
    if remembered is not None:
        with _memo_lock:
            _memo[stamp] = remembered
        return remembered
    digest = xxhash.xxh3_128()
    digest.update(info.st_size.to_bytes(8, "little"))
    buffer = bytearray(_READ_BLOCK)
    view = memoryview(buffer)
    with open(path, "rb") as file:
        while True:
            n = file.readinto(buffer)
            if not n:
                break
            digest.update(view[:n])
    identity = digest.hexdigest()
    with _memo_lock:
        _memo[stamp] = identity
    _save_memo_file(memo_key, identity)
    return identity


def _describe(model: Any) -> str:
    description = llama_cpp.ctypes.create_string_buffer(256)
    llama_cpp.llama_model_desc(model, description, 256)
    return description.value.decode("utf-8", "replace")


def _param_value(params: Any, name: str) -> Any:
    value = getattr(params, name)
    if isinstance(value, float):
        return repr(value)  # exact: 10000.0 and 10000.000001 must differ
    if isinstance(value, bool):
        return value
    return int(value)


def model_fingerprint(llm: llama_cpp.Llama) -> str:
    """The fingerprint of a loaded ``llama_cpp.Llama`` (any subclass): 32 hex characters.

    Raises:
        OSError: the model file (or LoRA file) cannot be read.
    """
    if llm.model_params.vocab_only:  # no weights to describe (llama.cpp aborts on asking), no state to make
        facts = {"file": file_identity(llm.model_path), "vocab_only": True, "n_vocab": int(llm.n_vocab())}
        return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:32]
    lora = [file_identity(llm.lora_path) if llm.lora_path else None, llm.lora_base, repr(float(llm.lora_scale))]
    return context_fingerprint(llm.model_path, llm._model.model, llm.context_params, int(llm.n_vocab()),
                               kv_overrides=llm.kv_overrides, lora=lora)


def context_fingerprint(model_path: str | os.PathLike[str], model: Any, params: Any, n_vocab: int, *,
                        kv_overrides: Mapping[str, Any] | None = None, lora: Sequence[Any] | None = None) -> str:
    """The fingerprint of a context of the model at ``model_path`` (its loaded ``llama_model *``
    ``model``) made with ``llama_context_params`` ``params``: 32 hex characters, the same as
    :func:`model_fingerprint` of a ``llama_cpp.Llama`` with that model and those parameters.

    Raises:
        OSError: the model file cannot be read.
    """
    facts: dict[str, Any] = {
        "file": file_identity(model_path),
        "kv_overrides": sorted((str(k), repr(v)) for k, v in (kv_overrides or {}).items()),
        "desc": _describe(model),
        "n_params": int(llama_cpp.llama_model_n_params(model)),
        "n_layer": int(llama_cpp.llama_model_n_layer(model)),
        "n_embd": int(llama_cpp.llama_model_n_embd(model)),
        "n_head": int(llama_cpp.llama_model_n_head(model)),
        "n_head_kv": int(llama_cpp.llama_model_n_head_kv(model)),
        "n_vocab": int(n_vocab),
        "recurrent": bool(llama_cpp.llama_model_is_recurrent(model)),
        "hybrid": bool(llama_cpp.llama_model_is_hybrid(model)),
        "context": {name: _param_value(params, name) for name in COVERED_PARAMS},
        "lora": list(lora) if lora is not None else [None, None, repr(1.0)],
    }
    encoded = json.dumps(facts, sort_keys=True).encode()
    return hashlib.sha256(encoded).hexdigest()[:32]


def model_description(llm: llama_cpp.Llama) -> dict[str, str]:
    """What a person needs to recognise a fingerprint's model: file name, description, parameter count."""
    return describe_model(llm.model_path, llm._model.model)


def describe_model(model_path: str | os.PathLike[str], model: Any) -> dict[str, str]:
    """:func:`model_description` of the model at ``model_path``, loaded as ``model`` (``llama_model *``)."""
    return {
        "file": os.path.basename(str(model_path)),
        "desc": _describe(model),
        "n_params": str(int(llama_cpp.llama_model_n_params(model))),
    }


def namespaced_fingerprint(fingerprint: str, namespace: str | None) -> str:
    """The fingerprint of ``fingerprint``'s states in a cache namespace (a tenant, a salt).

    Every cache files a state under its fingerprint, answers a lookup from one fingerprint's states, and
    chains its chunk ids from it; a context restores only states of its own fingerprint. So states made
    under one namespace are never found, restored, deduplicated against or timed from another: the
    namespaces share nothing but the byte budgets. The value is derived the same way in every process
    (a keyed BLAKE2b of both, 32 hex digits like a model's fingerprint), so instances sharing a tier
    share each namespace; it does not reveal the namespace.

    Args:
        fingerprint: the model's (:func:`model_fingerprint`).
        namespace: any text up to :data:`MAX_NAMESPACE_BYTES` UTF-8 bytes; None or "": the model's own
            namespace (``fingerprint`` itself).

    Raises:
        TypeError: ``namespace`` is not a str.
        ValueError: it is too long.
    """
    if namespace is None or namespace == "":
        return fingerprint
    if not isinstance(namespace, str):
        raise TypeError(f"a cache namespace must be a str, got {type(namespace).__name__}")
    raw = namespace.encode("utf-8", "surrogatepass")
    if len(raw) > MAX_NAMESPACE_BYTES:
        raise ValueError(f"a cache namespace is at most {MAX_NAMESPACE_BYTES} bytes, got {len(raw)}")
    digest = hashlib.blake2b(key=b"llama-cache namespace", digest_size=16)
    digest.update(fingerprint.encode("utf-8"))
    digest.update(b"\0")
    digest.update(raw)
    return digest.hexdigest()
