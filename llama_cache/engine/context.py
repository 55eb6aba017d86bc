"""The engine's one llama.cpp context: its batch, its decode, its memory and per-sequence state.

:class:`BatchContext` owns a ``llama_context`` with ``n_seq_max`` sequence ids and one reusable
``llama_batch`` whose arrays are numpy buffers: a step fills them with vectorised writes, not a ctypes
call per row. Its KV cache is unified by default (``kv_unified``: every sequence draws cells from one
pool of ``n_ctx``, as ``llama-server -c N --kv-unified``, and copied heads share their cells); without
it, each sequence has a stream of its own of ``n_ctx / n_seq_max`` cells (rounded up to 256 by
llama.cpp) whose cells are always in position order, and a copied head is copied, not shared.

What changes the context's memory is here, each a thin, checked call of llama.cpp's API
(``spec/llama_context_state_api.md``): :meth:`decode`, :meth:`copy_cells` (``llama_memory_seq_cp``:
cells shared, nothing copied; per-sequence streams: the source's state written into the target), :meth:`cut` (``llama_memory_seq_rm``), :meth:`read_sequence` /
:meth:`write_sequence` (``llama_state_seq_get_data_ext`` / ``_set_data_ext``). With a recurrent or
hybrid model each change is also reported to the checkpoint registry
(:mod:`llama_cache.checkpoints.registry`), which drops the checkpoints it invalidates.

Thread-safety: none. One thread (the scheduler's) makes every call; the numpy views returned by
:meth:`logits_row` are valid until its next :meth:`decode`.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np
import numpy.typing as npt

from llama_cache.checkpoints import notify_seq_changed, notify_seq_removed
from llama_cache.engine.kv_pages import KvPageWatch, kv_bytes, pool_cells
from llama_cache.engine.model import Model
from llama_cache.state.kv_layout import prefaulted

__all__ = ["BatchContext", "ContextSettings", "DecodeFailed", "NoCells", "flash_attention_for"]


class NoCells(Exception):
    """llama.cpp found no free cells for the batch (``llama_decode`` returned 1); nothing was evaluated."""


class DecodeFailed(RuntimeError):
    """``llama_decode`` failed for another reason than full memory (its return code in the message)."""


def flash_attention_for(requested: bool | None, deterministic: bool) -> bool:
    """Whether the engine's context runs llama.cpp's flash attention: ``requested``, or for None
    (auto) on. In one pool every query row meets every sequence's cells; with flash attention it
    skips the cells of other sequences (their mask is -inf), without it it multiplies through them,
    so a conversation's tokens cost what the whole pool holds, idle conversations included (measured:
    a later turn's first token 0.14 s on against 0.25 s off with five conversations idle beside it;
    docs/engine.md, "Flash attention", has the numbers and the CPUs where off generates faster).

    Deterministic mode rests on the flash-attention path that visits a sequence's cells in order and
    skips the others exactly (see :mod:`.scheduler`), so it refuses it off.

    Raises:
        ValueError: deterministic mode with flash attention off, or ``requested`` is not a bool or None.
    """
    if requested is not None and not isinstance(requested, bool):
        raise ValueError(f"flash_attn must be True, False or None (auto), got {requested!r}")
    if requested is None:
        return True
    if deterministic and not requested:
        raise ValueError("deterministic mode needs flash attention (its sums depend on the sequence alone there)")
    return requested


@dataclass(frozen=True)
class ContextSettings:
    """What a :class:`BatchContext` is made with.

    ``n_ctx`` is the pool of cells every sequence shares; ``n_seq_max`` the sequence ids (at most
    llama.cpp's ``llama_max_parallel_sequences()``); ``n_batch`` the most rows one decode takes (also
    its ubatch: one ubatch per decode); ``kv_unified`` False gives each sequence a stream of its own
    (see the module's docstring).
    """

    n_ctx: int
    n_seq_max: int
    n_batch: int = 512
    n_threads: int = 2
    flash_attn: bool = False
    kv_unified: bool = True


class BatchContext:
    """A llama.cpp context with a unified KV pool, ``n_seq_max`` sequences and one batch (see the module).

    Args:
        model: the loaded model (outlives the context).
        settings: sizes, threads and flash attention.

    Raises:
        ValueError: a setting is out of range or llama.cpp could not make the context.
    """

    def __init__(self, model: Model, settings: ContextSettings) -> None:
        limit = int(llama_cpp.llama_max_parallel_sequences())
        if not 1 <= settings.n_seq_max <= limit:
            raise ValueError(f"n_seq_max must be between 1 and {limit}, got {settings.n_seq_max}")
        if settings.n_ctx < 1 or settings.n_batch < 1 or settings.n_threads < 1:
            raise ValueError(f"n_ctx, n_batch and n_threads must be positive: {settings}")
        self.model = model
        self.settings = settings
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = settings.n_ctx
        params.n_batch = settings.n_batch
        params.n_ubatch = settings.n_batch
        params.n_seq_max = settings.n_seq_max
        params.n_threads = settings.n_threads
        params.n_threads_batch = settings.n_threads
        params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if settings.flash_attn
                                  else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        params.kv_unified = settings.kv_unified
        params.no_perf = True
        self.params = params
        """The ``llama_context_params`` used (what a state's fingerprint records)."""
        pool = pool_cells(settings.n_ctx, settings.n_seq_max, settings.kv_unified)
        with KvPageWatch(kv_bytes(model, pool)) as pages:
            pointer = llama_cpp.llama_init_from_model(model.pointer, params)
            n_ctx = int(llama_cpp.llama_n_ctx(pointer)) if pointer else 0
            released = pages.finish(kv_bytes(model, n_ctx)) if pointer else 0
        if not pointer:
            raise ValueError(f"llama.cpp could not make a context of {settings.n_ctx} cells")
        self.pointer: Any = pointer
        self.memory: Any = llama_cpp.llama_get_memory(pointer)
        self.n_ctx = n_ctx
        """Cells in the pool (llama.cpp may round ``settings.n_ctx`` up)."""
        self.kv_bytes_released = released
        """Bytes of the KV buffer handed back to the system until their cells are first used
        (:mod:`.kv_pages`; 0 where that could not be done)."""
        self.n_ctx_seq = int(llama_cpp.llama_n_ctx_seq(pointer))
        """The most cells one sequence may hold: the pool when unified, else its stream."""
        self.shares_cells = settings.kv_unified
        """Whether sequences share a head's cells (:meth:`copy_cells`) rather than copy them."""
        self.n_batch = settings.n_batch
        self.n_vocab = model.n_vocab
        n = settings.n_batch
        self.tokens = np.zeros(n, dtype=np.int32)
        self.positions = np.zeros(n, dtype=np.int32)
        self.sequences = np.zeros(n, dtype=np.int32)
        self.wants_logits = np.zeros(n, dtype=np.int8)
        self._n_seq_id = np.ones(n, dtype=np.int32)
        # One sequence id per row: row i's pointer points at sequences[i].
        base = self.sequences.ctypes.data
        self._seq_pointers = (ctypes.POINTER(llama_cpp.llama_seq_id) * n)(
            *(ctypes.cast(base + 4 * i, ctypes.POINTER(llama_cpp.llama_seq_id)) for i in range(n)))
        self._batch = llama_cpp.llama_batch(
            n_tokens=0,
            token=self.tokens.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token)),
            embd=None,
            pos=self.positions.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_pos)),
            n_seq_id=self._n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
            seq_id=self._seq_pointers,
            logits=self.wants_logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )
        self._closed = False

    # -- evaluation --------------------------------------------------------------------------------

    def decode(self, n_rows: int) -> None:
        """Evaluate the first ``n_rows`` rows of the batch arrays (``tokens``, ``positions``,
        ``sequences``, ``wants_logits``), filled by the caller. Returns once the work is done (a GPU
        backend's ``llama_decode`` returns when it is queued: the step budget times decodes).

        Raises:
            NoCells: the pool has no room for them; nothing was evaluated.
            DecodeFailed: any other failure.
        """
        if not 0 < n_rows <= self.n_batch:
            raise ValueError(f"a decode takes 1 to {self.n_batch} rows, got {n_rows}")
        self._batch.n_tokens = n_rows
        code = int(llama_cpp.llama_decode(self.pointer, self._batch))
        if code == 1:
            raise NoCells()
        if code != 0:
            raise DecodeFailed(f"llama_decode returned {code}")
        llama_cpp.llama_synchronize(self.pointer)

    def logits_row(self, row: int) -> npt.NDArray[np.float32]:
        """The logits of batch row ``row`` (it asked for them), as a writable view into llama.cpp's
        buffer: valid until the next decode."""
        pointer = llama_cpp.llama_get_logits_ith(self.pointer, row)
        if not pointer:
            raise DecodeFailed(f"no logits for row {row}")
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))

    # -- memory ------------------------------------------------------------------------------------

    def copy_cells(self, source: int, target: int, n_tokens: int) -> bool:
        """Make ``target`` (empty) hold ``source``'s first ``n_tokens`` positions: the same cells,
        shared (recurrent memory: its state is copied whole, ``n_tokens`` ignored). With a stream per
        sequence, ``source``'s state is read and written into ``target``'s stream, then cut: O(its
        bytes), done before this returns (llama.cpp's own cross-stream copy waits for the next decode,
        by when either stream may have changed).

        Returns:
            False (``target`` empty) if llama.cpp refused the copy.
        """
        if self.shares_cells:
            end = -1 if self.model.recurrent else n_tokens
            llama_cpp.llama_memory_seq_cp(self.memory, source, target, 0, end)
            self._changed(target)
            return True
        try:
            state = self.read_sequence(source)
        except DecodeFailed:
            return False
        if not self.write_sequence(target, state):
            return False
        if not self.model.recurrent and not self.cut(target, n_tokens):
            self.cut(target)
            return False
        return True

    def cut(self, sequence: int, start: int = 0) -> bool:
        """Drop ``sequence``'s positions from ``start`` on (0: all of them); False if the memory cannot
        (recurrent memory cut inside its history)."""
        removed = bool(llama_cpp.llama_memory_seq_rm(self.memory, sequence, start, -1))
        if self.model.recurrent:
            notify_seq_removed(self.pointer, sequence, start, -1)
        return removed

    def read_sequence(self, sequence: int, flags: int = 0) -> npt.NDArray[np.uint8]:
        """llama.cpp's state of one sequence (``llama_state_seq_get_data_ext``), a fresh buffer (its pages
        mapped before llama.cpp writes them: see :func:`~llama_cache.state.kv_layout.prefaulted`).

        Always in the one-stream form a unified KV writes: with a stream per sequence, llama.cpp
        writes every stream's cell count, all but the sequence's own zero, and those are left out
        (:meth:`write_sequence` puts them back), so that a state has one shape in every cache tier.

        Raises:
            DecodeFailed: llama.cpp wrote something else than it announced.
        """
        size = int(llama_cpp.llama_state_seq_get_size_ext(self.pointer, sequence, flags))
        buffer = prefaulted(size)
        written = int(llama_cpp.llama_state_seq_get_data_ext(
            self.pointer, buffer.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, sequence, flags))
        if written != size:
            raise DecodeFailed(f"llama.cpp wrote {written} of a {size}-byte sequence state")
        if self.shares_cells or self.model.recurrent:
            return buffer
        return _one_stream(buffer, self.settings.n_seq_max)

    def write_sequence(self, sequence: int, data: Any, flags: int = 0) -> bool:
        """Restore a state made by :meth:`read_sequence` (or a :class:`~llama_cache.LlamaState`'s bytes)
        into ``sequence``, which must be empty; False (and ``sequence`` empty) if llama.cpp refused it,
        e.g. when the pool has no contiguous run of free cells for it."""
        array = np.asarray(data, dtype=np.uint8)
        if not self.shares_cells and not self.model.recurrent:
            spread = _every_stream(array, self.settings.n_seq_max)
            if spread is None:
                return False
            array = spread
        read = int(llama_cpp.llama_state_seq_set_data_ext(
            self.pointer, array.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), len(array), sequence, flags))
        self._changed(sequence)
        if read != len(array):
            self.cut(sequence)
            return False
        return True

    def _changed(self, sequence: int) -> None:
        """Tell the checkpoint registry that ``sequence``'s memory was replaced (recurrent models keep
        checkpoints of it: :mod:`llama_cache.engine.rollback`)."""
        if self.model.recurrent:
            notify_seq_changed(self.pointer, sequence)

    def close(self) -> None:
        """Free the context (once)."""
        if not self._closed:
            self._closed = True
            llama_cpp.llama_free(self.pointer)


# A sequence's state starts with u32 magic, i32 sequence id, u32 stream count; then, per stream, a u32
# cell count and, if it is not 0, that stream's cells and their KV (``llama_kv_cache::state_write``).
_STREAMS_AT = 8
_BLOCKS_AT = 12


def _one_stream(data: npt.NDArray[np.uint8], n_stream: int) -> npt.NDArray[np.uint8]:
    """``data`` written by a KV with ``n_stream`` streams, of which one at most holds cells, in the form
    of a one-stream KV. O(its bytes): one copy.

    Raises:
        DecodeFailed: more than one stream holds cells, or the bytes are not shaped so.
    """
    if len(data) < _BLOCKS_AT + 4 * n_stream or int(data[_STREAMS_AT:_BLOCKS_AT].view("<u4")[0]) != n_stream:
        raise DecodeFailed("a sequence state of an unexpected shape")
    # The leading words up to the first non-zero one are empty streams' counts (what follows is cells).
    words = np.frombuffer(data, dtype="<u4", count=n_stream, offset=_BLOCKS_AT) != 0
    before = int(np.argmax(words)) if words.any() else n_stream
    if before == n_stream:  # no cells in any stream
        out = np.zeros(_BLOCKS_AT + 4, dtype=np.uint8)
        out[:_STREAMS_AT] = data[:_STREAMS_AT]
        out[_STREAMS_AT:_BLOCKS_AT].view("<u4")[0] = 1
        return out
    after = n_stream - 1 - before
    end = len(data) - 4 * after
    if after and (end < _BLOCKS_AT or data[end:].any()):
        raise DecodeFailed("a sequence state holds cells in more than one stream")
    start = _BLOCKS_AT + 4 * before
    out = np.empty(_BLOCKS_AT + end - start, dtype=np.uint8)
    out[:_STREAMS_AT] = data[:_STREAMS_AT]
    out[_STREAMS_AT:_BLOCKS_AT].view("<u4")[0] = 1
    out[_BLOCKS_AT:] = data[start:end]
    return out


def _every_stream(data: npt.NDArray[np.uint8], n_stream: int) -> npt.NDArray[np.uint8] | None:
    """A one-stream state (:func:`_one_stream`'s form) as a KV with ``n_stream`` streams reads it: its
    cells first (llama.cpp restores them into the target sequence's own stream), then the other
    streams' empty counts. None if ``data`` is not a one-stream state."""
    if len(data) < _BLOCKS_AT + 4 or int(data[_STREAMS_AT:_BLOCKS_AT].view("<u4")[0]) != 1:
        return None
    out = np.zeros(len(data) + 4 * (n_stream - 1), dtype=np.uint8)
    out[: len(data)] = data
    out[_STREAMS_AT:_BLOCKS_AT].view("<u4")[0] = n_stream
    return out
