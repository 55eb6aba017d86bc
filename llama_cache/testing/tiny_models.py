"""Tiny random-weight GGUF models of the recurrent and hybrid architectures, for tests.

No installable package ships a small Mamba, Mamba-2, LFM2 or Granite-4.0-H model, yet llama-cache must be tested
on models whose state is recurrent (a fixed-size per-sequence state instead of, or next to, a KV cache). This
module writes such models from scratch with the ``gguf`` package: four layers, ``n_embd`` 32, float32 tensors,
seeded random weights. The tokenizer metadata (every ``tokenizer.*`` key, including ``tokenizer.ggml.pre``) is
copied from a real model, normally the embedded SmolLM2-135M-Instruct, so real text tokenizes as usual and the
vocabulary (49152 tokens for SmolLM2) sizes the embedding matrix. The output projection is tied to the token
embedding (every one of the four architectures falls back to ``token_embd.weight`` when ``output.weight`` is
absent), which keeps each file at about 8 MB: 6.3 MB of embedding, most of the rest the copied token list and
merges.

Needs the ``gguf`` package: install the ``testing`` extra (``pip install llama-cache[testing]``).

The weights are meaningless but numerically sane, so evaluation gives finite logits that depend on the whole
prefix, not just the last token:

* projection matrices are ``normal / sqrt(fan_in)``, which keeps activations of order one through the layers (the
  usual ``normal * 0.02`` would make every block's contribution to the residual stream nearly vanish, and with it
  the influence of earlier tokens); the token embedding (also the tied output head) is ``normal * 0.02``;
* depthwise convolution kernels are ``normal / sqrt(kernel_size)``, their biases zero;
* every RMS-norm weight is one;
* SSM parameters follow the published initialisations: ``A = -(1..d_state)`` per channel for Mamba (S4D-real),
  ``A = -uniform(1, 16)`` per head for Mamba-2, ``D = 1``, and the time-step bias is the inverse softplus of a
  log-uniform ``dt`` in [0.001, 0.1]. At that resting time step a channel keeps ``exp(dt * A)``, between about
  0.2 and 0.999, of its state per token, so the state carries information across many tokens, as in a trained
  model.

The hyperparameter keys and tensor names/shapes are the ones the llama.cpp vendored by llama-cpp-python 0.3.36
loads (``src/models/{mamba,mamba2,lfm2,granite-hybrid}.cpp``). Shapes below are written in ggml order
(``{ne0, ne1}``, fastest dimension first); the numpy arrays handed to ``gguf`` have them reversed.
"""

from __future__ import annotations

import functools
import math
import os
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import gguf
import numpy as np

__all__ = ["TINY_ARCHITECTURES", "write_tiny_model"]

TINY_ARCHITECTURES: tuple[str, ...] = ("mamba", "mamba2", "lfm2", "granitehybrid")

# Dimensions shared by all four models.
_N_EMBD = 32
_N_LAYER = 4
_N_CTX_TRAIN = 4096
_RMS_EPS = 1e-5
_N_FF = 64  # SwiGLU width of LFM2 and Granite-Hybrid layers

# Attention layers (LFM2, Granite-Hybrid): 4 query heads of 8 dims sharing 2 KV heads (grouped-query attention).
_N_HEAD = 4
_N_HEAD_KV = 2
_HEAD_DIM = _N_EMBD // _N_HEAD

# SSM mixers. llama.cpp's Mamba and Granite-Hybrid loaders only support an expansion factor of 2.
_SSM_D_CONV = 4
_SSM_D_INNER = 2 * _N_EMBD
_SSM_D_STATE = 16
_MAMBA_DT_RANK = math.ceil(_N_EMBD / 16)  # Mamba's default: the low-rank time-step projection
_MAMBA2_N_HEAD = 4  # Mamba-2 stores its head count in the "time step rank" key; head dim = 64 / 4 = 16
_MAMBA2_N_GROUP = 1

# LFM2 short convolution: kernel length 3, as in the released LFM2 models.
_SHORTCONV_L_CACHE = 3

# Layer patterns of the hybrids (True = attention layer). Both mix the two kinds and differ in where attention is.
_LFM2_ATTENTION_LAYERS = (False, True, False, True)
_GRANITE_ATTENTION_LAYERS = (False, False, True, False)


class _Tensors:
    """Adds float32 tensors to a GGUF writer, drawing random values from one seeded generator.

    Shapes are given in ggml order (fastest dimension first), as llama.cpp's ``create_tensor`` calls spell them.

    Args:
        writer: The writer the tensors are added to.
        rng: The generator every random tensor is drawn from, in call order.
    """

    def __init__(self, writer: gguf.GGUFWriter, rng: np.random.Generator) -> None:
        self._writer = writer
        self._rng = rng

    def add(self, name: str, values: np.ndarray[Any, Any], ne: Sequence[int]) -> None:
        """Add a tensor with ggml shape ``ne``, converting ``values`` to float32."""
        array = np.ascontiguousarray(np.asarray(values, dtype=np.float32).reshape(tuple(reversed(ne))))
        self._writer.add_tensor(name, array)

    def normal(self, name: str, ne: Sequence[int], std: float) -> None:
        """Add a tensor of independent ``normal(0, std)`` values."""
        self.add(name, self._rng.standard_normal(_count(ne)) * std, ne)

    def linear(self, name: str, n_in: int, n_out: int) -> None:
        """Add a projection ``{n_in, n_out}`` scaled by ``1 / sqrt(n_in)`` to keep activations of order one."""
        self.normal(name, (n_in, n_out), 1.0 / math.sqrt(n_in))

    def conv(self, name: str, kernel: int, channels: int) -> None:
        """Add a depthwise convolution kernel ``{kernel, channels}`` scaled by ``1 / sqrt(kernel)``."""
        self.normal(name, (kernel, channels), 1.0 / math.sqrt(kernel))

    def fill(self, name: str, ne: Sequence[int], value: float) -> None:
        """Add a constant tensor (norm weights = 1, biases = 0, Mamba-2's ``D`` = 1)."""
        self.add(name, np.full(_count(ne), value), ne)

    def dt_bias(self, name: str, ne: Sequence[int]) -> None:
        """Add a time-step bias: the inverse softplus of ``dt`` drawn log-uniformly from [0.001, 0.1]."""
        dt = np.exp(self._rng.uniform(math.log(1e-3), math.log(1e-1), _count(ne)))
        self.add(name, np.log(np.expm1(dt)), ne)

    def uniform(self, name: str, ne: Sequence[int], low: float, high: float) -> None:
        """Add a tensor of independent ``uniform(low, high)`` values."""
        self.add(name, self._rng.uniform(low, high, _count(ne)), ne)


def _count(ne: Sequence[int]) -> int:
    return math.prod(ne)


# --- tokenizer and hyperparameters shared by every architecture ---------------------------------------------------


def _field_value(field: gguf.ReaderField) -> Any:
    """Return a metadata value as the writer takes it, strings as raw bytes (tokens need not be valid UTF-8)."""
    main_type = field.types[0]
    if main_type == gguf.GGUFValueType.STRING:
        return field.parts[-1].tobytes()
    if main_type == gguf.GGUFValueType.ARRAY and field.types[-1] == gguf.GGUFValueType.STRING:
        return [field.parts[index].tobytes() for index in field.data]
    return field.contents()


# (key, value, type, array element type or None), as GGUFWriter.add_key_value takes them.
_MetadataEntry = tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None]


@functools.lru_cache(maxsize=4)
def _read_tokenizer(path: str, mtime_ns: int, size: int) -> tuple[_MetadataEntry, ...]:
    """Read the ``tokenizer.*`` metadata of a GGUF file, memoised (parsing ~100k strings takes about 2 s).

    ``mtime_ns`` and ``size`` are only part of the cache key, so a rewritten file is read again.
    """
    del mtime_ns, size
    reader = gguf.GGUFReader(path)
    entries: list[_MetadataEntry] = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            is_array = field.types[0] == gguf.GGUFValueType.ARRAY
            entries.append((key, _field_value(field), field.types[0], field.types[-1] if is_array else None))
    return tuple(entries)


def _copy_tokenizer(writer: gguf.GGUFWriter, source: str | os.PathLike[str]) -> int:
    """Copy every ``tokenizer.*`` key of ``source`` into ``writer``, with its original type.

    Returns:
        The vocabulary size (the length of ``tokenizer.ggml.tokens``).

    Raises:
        ValueError: ``source`` has no ``tokenizer.ggml.tokens``.
    """
    resolved = pathlib.Path(source).resolve()
    stat = resolved.stat()
    n_vocab = 0
    for key, value, value_type, sub_type in _read_tokenizer(str(resolved), stat.st_mtime_ns, stat.st_size):
        writer.add_key_value(key, value, value_type, sub_type=sub_type)
        if key == gguf.Keys.Tokenizer.LIST:
            n_vocab = len(value)
    if n_vocab == 0:
        raise ValueError(f"{os.fspath(source)!r} has no tokenizer.ggml.tokens to copy")
    return n_vocab


def _add_common_hparams(writer: gguf.GGUFWriter, arch: str, n_vocab: int) -> None:
    writer.add_name(f"tiny-random-{arch}")
    writer.add_vocab_size(n_vocab)
    writer.add_context_length(_N_CTX_TRAIN)
    writer.add_embedding_length(_N_EMBD)
    writer.add_block_count(_N_LAYER)
    writer.add_layer_norm_rms_eps(_RMS_EPS)


def _add_embedding(tensors: _Tensors, n_vocab: int, output_norm: str = "output_norm") -> None:
    """Add the token embedding (also the tied output head) and the final norm, named ``output_norm`` except in LFM2."""
    tensors.normal("token_embd.weight", (_N_EMBD, n_vocab), 0.02)
    tensors.fill(f"{output_norm}.weight", (_N_EMBD,), 1.0)


# --- building blocks -----------------------------------------------------------------------------------------------


def _add_ssm_hparams(writer: gguf.GGUFWriter, time_step_rank: int, n_group: int | None) -> None:
    writer.add_ssm_conv_kernel(_SSM_D_CONV)
    writer.add_ssm_inner_size(_SSM_D_INNER)
    writer.add_ssm_state_size(_SSM_D_STATE)
    writer.add_ssm_time_step_rank(time_step_rank)
    if n_group is not None:
        writer.add_ssm_group_count(n_group)


def _add_mamba2_mixer(tensors: _Tensors, layer: int) -> None:
    """Add the tensors of a Mamba-2 mixer (the Mamba-2 and Granite-Hybrid SSM layers).

    ``ssm_in`` projects to ``z`` (d_inner), ``xBC`` (d_inner + 2 * n_group * d_state) and ``dt`` (one per head);
    the convolution runs over ``xBC``; ``A``, ``D`` and the time-step bias are per head; ``ssm_norm`` is the gated
    RMS norm per group.
    """
    conv_dim = _SSM_D_INNER + 2 * _MAMBA2_N_GROUP * _SSM_D_STATE
    blk = f"blk.{layer}"
    tensors.linear(f"{blk}.ssm_in.weight", _N_EMBD, _SSM_D_INNER + conv_dim + _MAMBA2_N_HEAD)
    tensors.conv(f"{blk}.ssm_conv1d.weight", _SSM_D_CONV, conv_dim)
    tensors.fill(f"{blk}.ssm_conv1d.bias", (conv_dim,), 0.0)
    tensors.dt_bias(f"{blk}.ssm_dt.bias", (_MAMBA2_N_HEAD,))
    tensors.uniform(f"{blk}.ssm_a", (1, _MAMBA2_N_HEAD), -16.0, -1.0)
    tensors.fill(f"{blk}.ssm_d", (1, _MAMBA2_N_HEAD), 1.0)
    tensors.fill(f"{blk}.ssm_norm.weight", (_SSM_D_INNER // _MAMBA2_N_GROUP, _MAMBA2_N_GROUP), 1.0)
    tensors.linear(f"{blk}.ssm_out.weight", _SSM_D_INNER, _N_EMBD)


def _add_attention(tensors: _Tensors, layer: int, *, qk_norm: bool) -> None:
    """Add a grouped-query attention block without biases (LFM2 and Granite-Hybrid attention layers).

    LFM2 RMS-normalises queries and keys per head (``qk_norm``); Granite-Hybrid does not.
    """
    blk = f"blk.{layer}"
    n_embd_kv = _N_HEAD_KV * _HEAD_DIM
    tensors.linear(f"{blk}.attn_q.weight", _N_EMBD, _N_HEAD * _HEAD_DIM)
    tensors.linear(f"{blk}.attn_k.weight", _N_EMBD, n_embd_kv)
    tensors.linear(f"{blk}.attn_v.weight", _N_EMBD, n_embd_kv)
    tensors.linear(f"{blk}.attn_output.weight", _N_HEAD * _HEAD_DIM, _N_EMBD)
    if qk_norm:
        tensors.fill(f"{blk}.attn_q_norm.weight", (_HEAD_DIM,), 1.0)
        tensors.fill(f"{blk}.attn_k_norm.weight", (_HEAD_DIM,), 1.0)


def _add_swiglu_ffn(tensors: _Tensors, layer: int) -> None:
    """Add the pre-normed SwiGLU feed-forward block of every LFM2 and Granite-Hybrid layer."""
    blk = f"blk.{layer}"
    tensors.fill(f"{blk}.ffn_norm.weight", (_N_EMBD,), 1.0)
    tensors.linear(f"{blk}.ffn_gate.weight", _N_EMBD, _N_FF)
    tensors.linear(f"{blk}.ffn_up.weight", _N_EMBD, _N_FF)
    tensors.linear(f"{blk}.ffn_down.weight", _N_FF, _N_EMBD)


def _add_attention_hparams(writer: gguf.GGUFWriter, attention_layers: Sequence[bool]) -> None:
    """Write the FFN width and head counts of a hybrid; llama.cpp makes a layer recurrent iff its KV head count is 0."""
    writer.add_feed_forward_length(_N_FF)
    writer.add_head_count(_N_HEAD)
    writer.add_head_count_kv([_N_HEAD_KV if is_attention else 0 for is_attention in attention_layers])


# --- one function per architecture ----------------------------------------------------------------------------------


def _build_mamba(writer: gguf.GGUFWriter, tensors: _Tensors, n_vocab: int) -> None:
    """Mamba (1): four Mamba mixer layers, each pre-normed and residual.

    Per layer: ``ssm_in`` to ``x`` and ``z`` (2 * d_inner), a width-4 depthwise convolution over ``x``, ``ssm_x``
    to the low-rank ``dt`` (rank 2) and ``B``, ``C`` (d_state 16 each), ``ssm_dt`` back to one time step per
    channel, ``A`` (d_state x d_inner), ``D`` and ``ssm_out``.
    """
    _add_ssm_hparams(writer, _MAMBA_DT_RANK, n_group=None)
    _add_embedding(tensors, n_vocab)
    for layer in range(_N_LAYER):
        blk = f"blk.{layer}"
        tensors.fill(f"{blk}.attn_norm.weight", (_N_EMBD,), 1.0)
        tensors.linear(f"{blk}.ssm_in.weight", _N_EMBD, 2 * _SSM_D_INNER)
        tensors.conv(f"{blk}.ssm_conv1d.weight", _SSM_D_CONV, _SSM_D_INNER)
        tensors.fill(f"{blk}.ssm_conv1d.bias", (_SSM_D_INNER,), 0.0)
        tensors.linear(f"{blk}.ssm_x.weight", _SSM_D_INNER, _MAMBA_DT_RANK + 2 * _SSM_D_STATE)
        tensors.linear(f"{blk}.ssm_dt.weight", _MAMBA_DT_RANK, _SSM_D_INNER)
        tensors.dt_bias(f"{blk}.ssm_dt.bias", (_SSM_D_INNER,))
        s4d_real = np.tile(np.arange(1, _SSM_D_STATE + 1, dtype=np.float32), _SSM_D_INNER)
        tensors.add(f"{blk}.ssm_a", -s4d_real, (_SSM_D_STATE, _SSM_D_INNER))
        tensors.fill(f"{blk}.ssm_d", (_SSM_D_INNER,), 1.0)
        tensors.linear(f"{blk}.ssm_out.weight", _SSM_D_INNER, _N_EMBD)


def _build_mamba2(writer: gguf.GGUFWriter, tensors: _Tensors, n_vocab: int) -> None:
    """Mamba-2: four Mamba-2 mixer layers (4 heads of 16 dims, one group, d_state 16), each pre-normed."""
    _add_ssm_hparams(writer, _MAMBA2_N_HEAD, n_group=_MAMBA2_N_GROUP)
    _add_embedding(tensors, n_vocab)
    for layer in range(_N_LAYER):
        tensors.fill(f"blk.{layer}.attn_norm.weight", (_N_EMBD,), 1.0)
        _add_mamba2_mixer(tensors, layer)


def _build_lfm2(writer: gguf.GGUFWriter, tensors: _Tensors, n_vocab: int) -> None:
    """LFM2: short-convolution, attention, short-convolution, attention; every layer followed by a SwiGLU FFN.

    A short-convolution layer projects to three chunks ``B``, ``C``, ``x`` and outputs ``C * conv(B * x)`` with a
    width-3 kernel, so its recurrent state is just the last two inputs. The attention layers use per-head Q/K
    RMS norms. LFM2's final norm is stored under the historical name ``token_embd_norm``.
    """
    writer.add_shortconv_l_cache(_SHORTCONV_L_CACHE)
    writer.add_rope_freq_base(1_000_000.0)
    _add_attention_hparams(writer, _LFM2_ATTENTION_LAYERS)
    _add_embedding(tensors, n_vocab, output_norm="token_embd_norm")
    for layer, is_attention in enumerate(_LFM2_ATTENTION_LAYERS):
        blk = f"blk.{layer}"
        tensors.fill(f"{blk}.attn_norm.weight", (_N_EMBD,), 1.0)
        if is_attention:
            _add_attention(tensors, layer, qk_norm=True)
        else:
            tensors.conv(f"{blk}.shortconv.conv.weight", _SHORTCONV_L_CACHE, _N_EMBD)
            tensors.linear(f"{blk}.shortconv.in_proj.weight", _N_EMBD, 3 * _N_EMBD)
            tensors.linear(f"{blk}.shortconv.out_proj.weight", _N_EMBD, _N_EMBD)
        _add_swiglu_ffn(tensors, layer)


def _build_granitehybrid(writer: gguf.GGUFWriter, tensors: _Tensors, n_vocab: int) -> None:
    """Granite-4.0-H style: Mamba-2, Mamba-2, attention, Mamba-2; every layer followed by a SwiGLU FFN.

    The Mamba-2 mixers are those of :func:`_build_mamba2`; the attention layer uses RoPE (Granite enables it
    through ``rope.scaling.finetuned``, which defaults to true). The optional Granite multipliers (embedding,
    residual, attention and logit scales) are left out, so they keep their neutral defaults.
    """
    _add_ssm_hparams(writer, _MAMBA2_N_HEAD, n_group=_MAMBA2_N_GROUP)
    writer.add_rope_freq_base(10_000.0)
    _add_attention_hparams(writer, _GRANITE_ATTENTION_LAYERS)
    _add_embedding(tensors, n_vocab)
    for layer, is_attention in enumerate(_GRANITE_ATTENTION_LAYERS):
        tensors.fill(f"blk.{layer}.attn_norm.weight", (_N_EMBD,), 1.0)
        if is_attention:
            _add_attention(tensors, layer, qk_norm=False)
        else:
            _add_mamba2_mixer(tensors, layer)
        _add_swiglu_ffn(tensors, layer)


_BUILDERS: dict[str, Callable[[gguf.GGUFWriter, _Tensors, int], None]] = {
    "mamba": _build_mamba,
    "mamba2": _build_mamba2,
    "lfm2": _build_lfm2,
    "granitehybrid": _build_granitehybrid,
}


def write_tiny_model(
    arch: str,
    path: str | os.PathLike[str],
    *,
    tokenizer_from: str | os.PathLike[str],
    seed: int = 0,
) -> pathlib.Path:
    """Write a tiny random-weight GGUF model of a recurrent or hybrid architecture.

    The model has 4 layers, ``n_embd`` 32, float32 weights drawn from ``numpy.random.default_rng(seed)`` (the same
    seed gives the same file), the tokenizer of ``tokenizer_from`` and an output head tied to the token embedding.
    See the module docstring for the value choices and each ``_build_<arch>`` function for the layer layout.

    Args:
        arch: One of :data:`TINY_ARCHITECTURES`: ``"mamba"``, ``"mamba2"`` (recurrent), ``"lfm2"``,
            ``"granitehybrid"`` (hybrid: recurrent and attention layers).
        path: Where to write the ``.gguf`` file; an existing file is overwritten.
        tokenizer_from: A GGUF model whose ``tokenizer.*`` metadata is copied, normally the embedded
            SmolLM2-135M-Instruct (49152 tokens).
        seed: Seed of the weights.

    Returns:
        ``path`` as a :class:`pathlib.Path`.

    Raises:
        ValueError: ``arch`` is not one of :data:`TINY_ARCHITECTURES`, or ``tokenizer_from`` has no token list.
    """
    try:
        build = _BUILDERS[arch]
    except KeyError:
        raise ValueError(f"unknown tiny-model architecture {arch!r}; expected one of {TINY_ARCHITECTURES}") from None
    out = pathlib.Path(path)
    writer = gguf.GGUFWriter(out, arch)
    try:
        n_vocab = _copy_tokenizer(writer, tokenizer_from)
        _add_common_hparams(writer, arch, n_vocab)
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        build(writer, _Tensors(writer, np.random.default_rng(seed)), n_vocab)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except BaseException:
        writer.close()
        out.unlink(missing_ok=True)  # never leave a truncated model behind
        raise
    writer.close()
    return out
