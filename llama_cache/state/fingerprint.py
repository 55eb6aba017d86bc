"""Model fingerprints: which model and KV configuration a state belongs to.

A state is restored only into a context whose fingerprint equals the one it was made with. The
fingerprint covers the identity of the GGUF file (its size and a hash of its first and last MiBs,
cheap even for large files) and everything that shapes the per-sequence state: architecture
description, layer count, embedding size, KV heads, KV cache types, flash attention (it decides whether
V is stored transposed), and the LoRA adapters llama-cpp-python loaded. ``n_ctx`` is not part of it: a
state fits any context large enough for its tokens.

Control vectors applied through the low-level C API after construction are invisible here; callers who
use them must keep separate caches.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import llama_cpp

_EDGE_BYTES = 1 << 20


def file_identity(path: str | os.PathLike[str]) -> str:
    """A content hash of a (possibly huge) file: its size plus its first and last MiB.

    Complexity: reads at most 2 MiB whatever the file size.
    """
    digest = hashlib.sha256()
    size = Path(path).stat().st_size
    digest.update(size.to_bytes(8, "little"))
    with open(path, "rb") as file:
        digest.update(file.read(_EDGE_BYTES))
        if size > 2 * _EDGE_BYTES:
            file.seek(size - _EDGE_BYTES)
        digest.update(file.read(_EDGE_BYTES))
    return digest.hexdigest()


def model_fingerprint(llm: llama_cpp.Llama) -> str:
    """The fingerprint of a loaded ``llama_cpp.Llama``: 32 hex characters."""
    model = llm._model.model
    description = llama_cpp.ctypes.create_string_buffer(256)
    llama_cpp.llama_model_desc(model, description, 256)
    params = llm.context_params
    facts: dict[str, Any] = {
        "file": file_identity(llm.model_path),
        "desc": description.value.decode("utf-8", "replace"),
        "n_params": int(llama_cpp.llama_model_n_params(model)),
        "n_layer": int(llama_cpp.llama_model_n_layer(model)),
        "n_embd": int(llama_cpp.llama_model_n_embd(model)),
        "n_head": int(llama_cpp.llama_model_n_head(model)),
        "n_head_kv": int(llama_cpp.llama_model_n_head_kv(model)),
        "n_vocab": int(llm.n_vocab()),
        "type_k": int(params.type_k),
        "type_v": int(params.type_v),
        "flash_attn": int(getattr(params, "flash_attn_type", getattr(params, "flash_attn", -1))),
        "recurrent": bool(llama_cpp.llama_model_is_recurrent(model)),
        "hybrid": bool(llama_cpp.llama_model_is_hybrid(model)),
        "lora": [
            file_identity(llm.lora_path) if llm.lora_path else None,
            llm.lora_base,
            llm.lora_scale,
        ],
    }
    encoded = json.dumps(facts, sort_keys=True).encode()
    return hashlib.sha256(encoded).hexdigest()[:32]
