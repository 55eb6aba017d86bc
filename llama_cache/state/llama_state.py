"""LlamaState: a compact, shareable snapshot of one evaluated token sequence."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import llama_cpp
import numpy as np
import numpy.typing as npt

from llama_cache.state.kv_layout import (
    CELL_BYTES,
    SEQ_STATE_MAGIC,
    Bytes,
    KVLayout,
    KVSegment,
    StagingPool,
    canonical_seq_id,
    parse_seq_state,
    serialize_segments,
    serialize_segments_into,
)
from llama_cache.state.memory import MemoryBlock

# llama-cpp-python's load_state, which cannot restore our states (see LlamaState.scores).
_UPSTREAM_LOAD_STATE = llama_cpp.Llama.load_state.__code__

# Restoring the parent's bytes reads every token it holds once; assembling the state first copies its own
# tokens and then reads them (two passes): the parent wins while it holds fewer than twice the tokens.
_MAX_PARENT_EXTRA = 1.0

RESTORE_STAGING = StagingPool()
"""The buffers :meth:`LlamaState.restore_bytes` assembles states in, shared by every state of the process.

It holds at most ``max_idle`` (2) buffers of up to ``growth`` (1.5) times the largest state assembled
so far; ``RESTORE_STAGING.clear()`` gives them back to the system.
"""


class RestoreCopy:
    """llama.cpp's bytes for a whole sequence, kept beside a segmented state so that restoring it copies nothing.

    A state extended from another shares that state's KV and owns only its new tokens' (a segment of
    its own): restoring it would first assemble its segments into one buffer, which llama.cpp then
    copies again, about twice a canonical restore. The bytes llama.cpp handed over when the state was
    saved are that buffer already: keeping them costs the state's full size in memory and nothing in
    time. The state, its twin without logits and its prefix views share one copy (a view restores from
    it and cuts the tokens past its own, as from a parent's bytes).

    Caches charge a copy as one memory block and release it (:meth:`release`) under memory pressure
    before evicting any entry: a copy only uses budget no entry needs. A released copy frees its bytes
    once no restore still reads them; the states holding it restore by assembly again.

    A state can also be only *offered* a copy (:meth:`LlamaState.lend_restore_copy`): it restores from
    the copy while its lender keeps it alive, without holding or counting it, and a cache storing the
    state adopts it (:meth:`LlamaState.adopt_restore_copy`) and charges it to its own budget. That is
    how ``llama_cache.Llama.save_state`` hands states over: the state it returns holds one copy of the
    KV, the context keeps its last save's bytes until the next save, and a cache storing that state
    keeps them as the state's copy.

    Thread-safety: :meth:`release` may run while another thread restores from the copy; that restore
    holds its own reference to the bytes and completes.
    """

    __slots__ = ("_data", "n_tokens", "seq_id", "__weakref__")

    def __init__(self, data: Bytes, n_tokens: int, seq_id: int) -> None:
        self._data: Bytes | None = data
        self.n_tokens = n_tokens
        """Tokens the bytes hold (the state that made the copy): at least those of any state holding it."""
        self.seq_id = seq_id
        """The sequence the bytes name: they restore as they are into that sequence only."""

    @property
    def data(self) -> Bytes | None:
        """The bytes, or None once released."""
        return self._data

    @property
    def nbytes(self) -> int:
        """Bytes held: 0 once released."""
        data = self._data
        return 0 if data is None else int(data.nbytes)

    def release(self) -> int:
        """Drop the bytes (idempotent). Returns how many bytes this call dropped."""
        freed = self.nbytes
        self._data = None
        return freed

    def __repr__(self) -> str:
        return f"RestoreCopy(n_tokens={self.n_tokens}, seq_id={self.seq_id}, nbytes={self.nbytes})"


class IncompatibleStateError(KeyError):
    """A state cannot be restored here: made by another model or KV layout, or refused by llama.cpp.

    It subclasses :class:`KeyError` so that a cache lookup that yields such a state is a miss for
    llama-cpp-python's completion code, which treats ``KeyError`` as one.
    """

    def __str__(self) -> str:  # KeyError's repr-quoting is wrong for a message
        return str(self.args[0]) if self.args else ""


class LlamaState:
    """The state of one sequence after evaluating ``tokens``: what a cache stores.

    It holds the tokens, the logits row after the last token (so an exact repeat samples without a
    decode), llama.cpp's per-sequence memory, the sampling seed and the fingerprint of the model that
    made it. Transformer KV is held as :class:`~llama_cache.state.kv_layout.KVSegment`\\ s that
    several states can share: a state extended from another owns only its new tokens' KV.
    Other memory (recurrent, hybrid, unusual layouts) is held as opaque llama.cpp bytes. An extended
    state can also restore from llama.cpp's bytes for its whole sequence (a :class:`RestoreCopy`), so
    that restoring it copies no segments: held until a cache releases them, or only offered by whoever
    keeps them (:meth:`lend_restore_copy`) until a cache adopts them.

    States are immutable once made (releasing a restore copy changes only how fast they restore); share
    them freely between threads and caches.

    The attribute names of llama-cpp-python's ``LlamaState`` are kept (``input_ids``, ``scores``,
    ``n_tokens``, ``llama_state``, ``llama_state_size``, ``seed``) so code written for it reads ours.
    """

    __slots__ = ("tokens", "logits", "seed", "fingerprint", "_layout", "_segments", "_opaque", "_canonical", "_copy",
                 "_offer")

    def __init__(
        self,
        tokens: npt.NDArray[np.int32],
        logits: npt.NDArray[np.float32] | None,
        seed: int,
        fingerprint: str,
        *,
        layout: KVLayout | None = None,
        segments: tuple[KVSegment, ...] = (),
        opaque: Bytes | None = None,
    ) -> None:
        if (layout is None) == (opaque is None):
            raise ValueError("a state holds either a KV layout with segments or opaque bytes")
        if layout is not None and sum(s.n_tokens for s in segments) != len(tokens):
            raise ValueError("the KV segments do not cover the tokens")
        self.tokens = tokens
        self.logits = logits
        self.seed = seed
        self.fingerprint = fingerprint
        self._layout = layout
        self._segments = segments
        self._opaque = opaque
        # llama.cpp's own bytes for this state, when they are exactly what serialising the segments would
        # produce for the sequence id recorded in them: restoring then copies nothing.
        self._canonical: tuple[Bytes, int] | None = None
        # llama.cpp's bytes for this state or a longer one it is the head of, beside the segments.
        self._copy: RestoreCopy | None = None
        # A copy someone else holds and offers (see lend_restore_copy): used while alive, never counted.
        self._offer: weakref.ref[RestoreCopy] | None = None

    @classmethod
    def from_seq_bytes(
        cls,
        tokens: npt.NDArray[np.int32],
        logits: npt.NDArray[np.float32] | None,
        seed: int,
        fingerprint: str,
        seq_bytes: Bytes,
        *,
        parse: bool = True,
    ) -> LlamaState:
        """Make a state from llama.cpp's per-sequence bytes, parsing transformer KV when it can.

        The state keeps views into ``seq_bytes`` (no copy): the caller hands the buffer over.
        """
        parsed = parse_seq_state(seq_bytes) if parse else None
        if parsed is not None and parsed[1].n_tokens == len(tokens):
            layout, segment = parsed
            state = cls(tokens, logits, seed, fingerprint, layout=layout, segments=(segment,))
            canonical_seq = canonical_seq_id(seq_bytes, len(tokens))
            if canonical_seq is not None:
                state._canonical = (seq_bytes, canonical_seq)
            return state
        return cls(tokens, logits, seed, fingerprint, opaque=seq_bytes)

    # -- what it holds --------------------------------------------------------------------------

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def layout(self) -> KVLayout | None:
        """The transformer KV layout, or None for opaque state."""
        return self._layout

    @property
    def segments(self) -> tuple[KVSegment, ...]:
        return self._segments

    @property
    def restore_copy(self) -> RestoreCopy | None:
        """The :class:`RestoreCopy` this state holds, if any (released or not); not one only offered."""
        return self._copy

    def lend_restore_copy(self) -> RestoreCopy | None:
        """Stop holding this state's restore copy and only be offered it; return it (None: none held).

        The state, and the views and twins made from it before or after, keep restoring from the copy
        for as long as the caller keeps the returned object alive, but hold only a weak reference to it:
        their memory (:meth:`memory_blocks`, :attr:`nbytes`) no longer includes it. A cache storing one
        of them takes it back with :meth:`adopt_restore_copy`. O(1); not thread-safe against a
        concurrent :meth:`adopt_restore_copy` on the same state (the owner calls it right after making
        the state).
        """
        copy = self._copy
        if copy is None:
            return None
        self._copy = None
        self._offer = weakref.ref(copy)
        return copy

    def adopt_restore_copy(self) -> RestoreCopy | None:
        """Hold the restore copy this state is offered, if it is still alive and not released, and
        return it (then among :meth:`memory_blocks`: a cache charges it to its own budget and may
        release it). None when nothing is offered any more. O(1); idempotent.
        """
        offered = None if self._offer is None else self._offer()
        if self._copy is None and offered is not None and offered.data is not None:
            self._copy = offered
        return self._copy

    def _usable_copy(self) -> RestoreCopy | None:
        """The copy held, else the one offered while alive."""
        if self._copy is not None:
            return self._copy
        return None if self._offer is None else self._offer()

    def seq_bytes(self, seq_id: int = 0) -> Bytes:
        """llama.cpp's per-sequence bytes for this state, ready for ``llama_state_seq_set_data``.

        Opaque states return their buffer, and so do states made from llama.cpp bytes already in
        canonical form (cells in position order, of ``seq_id``); segmented ones are assembled (one copy)
        into a new buffer the caller may keep. To restore, :meth:`restore_bytes` is faster.
        """
        direct = self._direct_bytes(seq_id)
        if direct is not None:
            return direct
        assert self._layout is not None
        return serialize_segments(self._layout, list(self._segments), seq_id)

    @contextmanager
    def restore_bytes(self, seq_id: int = 0) -> Iterator[Bytes]:
        """The bytes :meth:`seq_bytes` gives, as a read-only contiguous view valid inside the block only.

        Bytes the state holds whole (opaque or canonical) are lent as they are. Segmented states are
        assembled into a reused, already-faulted buffer of :data:`RESTORE_STAGING`: one copy at memory
        speed, where assembling into fresh memory spends most of its time faulting pages in. The
        buffer goes back to the pool when the block ends and is overwritten by the next restore, so
        hand the view to ``llama_state_seq_set_data`` inside the block and keep nothing of it.

        Thread-safety: concurrent blocks (from any threads, of the same state or others) each get a
        buffer of their own.
        """
        direct = self._direct_bytes(seq_id)
        if direct is not None:
            yield _read_only(np.ascontiguousarray(direct))
            return
        assert self._layout is not None
        with RESTORE_STAGING.borrow(self.llama_state_size) as buffer:
            assembled = serialize_segments_into(self._layout, list(self._segments), buffer, seq_id)
            yield _read_only(assembled)

    @contextmanager
    def restore_source(self, seq_id: int = 0) -> Iterator[tuple[Bytes, int]]:
        """Bytes to restore this state from and the tokens they hold, valid inside the block only.

        Like :meth:`restore_bytes`, with one more way to skip assembly: a view of the first tokens of
        a state made from llama.cpp's bytes (the prompt's state cut from prompt + completion) is lent
        its parent's bytes whole, and a view of an extended state its parent's :class:`RestoreCopy`,
        when those hold fewer than twice its tokens. The tokens held are then more than
        :attr:`n_tokens`, and after ``llama_state_seq_set_data`` the caller removes positions
        ``n_tokens`` onwards (``llama_memory_seq_rm(memory, seq_id, n_tokens, -1)``): the sequence is
        then exactly this state's, restored at the cost of a canonical state's.

        Yields:
            ``(data, held)``: read-only contiguous bytes for ``llama_state_seq_set_data`` and the
            number of tokens they hold (``held >= n_tokens``).
        """
        held = self._held_bytes(seq_id)
        if held is not None:
            yield _read_only(held[0]), held[1]
            return
        with self.restore_bytes(seq_id) as data:
            yield data, self.n_tokens

    def _held_bytes(self, seq_id: int) -> tuple[Bytes, int] | None:
        """llama.cpp's bytes of a longer sequence this state is the head of, and their token count.

        Its restore copy if not released, else its segment's buffer (:meth:`_parent_bytes`), when they
        hold at most ``_MAX_PARENT_EXTRA`` more tokens. None when the state holds its own bytes whole
        (:meth:`_direct_bytes`).
        """
        if self._direct_bytes(seq_id) is not None:
            return None
        copy = self._usable_copy()
        data = None if copy is None else copy.data
        if copy is not None and data is not None and copy.seq_id == seq_id and self._close_enough(copy.n_tokens):
            return data, copy.n_tokens
        return self._parent_bytes(seq_id)

    def _close_enough(self, held: int) -> bool:
        """Whether restoring ``held`` tokens and cutting the rest beats assembling this state's own."""
        return self.n_tokens <= held <= self.n_tokens * (1 + _MAX_PARENT_EXTRA)

    def _parent_bytes(self, seq_id: int) -> tuple[Bytes, int] | None:
        """llama.cpp's canonical bytes this state's only segment is the head of, and their token count.

        None unless the segment's buffer is such bytes for ``seq_id``, the segment's first layer sits
        where parsing them puts it, and they hold at most ``_MAX_PARENT_EXTRA`` more tokens.
        """
        if self._layout is None or len(self._segments) != 1:
            return None
        segment = self._segments[0]
        buffer = segment.buffer
        if buffer.ndim != 1 or len(buffer) < 16 or not buffer.flags.c_contiguous:
            return None
        held = int(buffer[12:16].view("<u4")[0])
        if not self._close_enough(held):
            return None
        if len(buffer) != self._layout.serialized_size(held) or int(buffer[:4].view("<u4")[0]) != SEQ_STATE_MAGIC:
            return None
        first_keys = 16 + held * CELL_BYTES + 8 + 12  # header, cells, v_trans and n_layer, layer 0's header
        if segment.k[0].ctypes.data != buffer.ctypes.data + first_keys:
            return None
        if canonical_seq_id(buffer, held) != seq_id:
            return None
        return buffer, held

    def needs_assembly(self, seq_id: int = 0) -> bool:
        """Whether restoring into ``seq_id`` through :meth:`restore_source` copies KV segments first.

        False for opaque states, for states holding llama.cpp's own bytes for that sequence (a
        :class:`RestoreCopy` not released included) and for views restored from their parent's bytes.
        """
        return self._direct_bytes(seq_id) is None and self._held_bytes(seq_id) is None

    def _direct_bytes(self, seq_id: int) -> Bytes | None:
        """The bytes this state holds whole, if they are what restoring it into ``seq_id`` needs."""
        if self._opaque is not None:
            return self._opaque
        if self._canonical is not None and self._canonical[1] == seq_id:
            return self._canonical[0]
        copy = self._usable_copy()
        data = None if copy is None else copy.data
        if copy is not None and data is not None and copy.seq_id == seq_id and copy.n_tokens == self.n_tokens:
            return data
        return None

    def _stage_ahead(self) -> LlamaState:
        """Have a staging buffer ready for this state, so its first restore faults no memory in."""
        if self.needs_assembly(0):
            RESTORE_STAGING.reserve(self.llama_state_size)
        return self

    def memory_blocks(self) -> list[MemoryBlock]:
        """The buffers this state holds, for caches that charge shared buffers once.

        A :class:`RestoreCopy` not released is one block, identified by the copy itself: caches that
        find one among a state's blocks may release it to make room. A copy only offered (see
        :meth:`lend_restore_copy`) is not among them: its lender holds it.
        """
        blocks: list[MemoryBlock] = [(id(self.tokens), int(self.tokens.nbytes))]
        if self.logits is not None:
            blocks.append((id(self.logits), int(self.logits.nbytes)))
        if self._opaque is not None:
            blocks.append((id(self._opaque), int(self._opaque.nbytes)))
        for segment in self._segments:
            blocks.append((id(segment.buffer), int(segment.buffer.nbytes)))
        copy = self._copy
        copy_bytes = 0 if copy is None else copy.nbytes
        if copy is not None and copy_bytes:
            blocks.append((copy, copy_bytes))
        return blocks

    @property
    def nbytes(self) -> int:
        """Bytes this state holds (shared segment buffers and a restore copy counted in full, once each)."""
        return sum(size for _, size in {identity: size for identity, size in self.memory_blocks()}.items())

    def prefix(self, n_tokens: int, logits: npt.NDArray[np.float32] | None) -> LlamaState:
        """The state of this state's first ``n_tokens`` tokens, sharing its KV and restore copy (no copy).

        Only segmented (transformer) states can be cut; ``logits`` must be the row after token
        ``n_tokens - 1``, or None.

        Raises:
            ValueError: the state is opaque, or ``n_tokens`` is out of range.
        """
        if self._layout is None:
            raise ValueError("opaque (recurrent or unrecognised) state cannot be cut")
        if not 0 < n_tokens <= self.n_tokens:
            raise ValueError(f"prefix length {n_tokens} outside 1..{self.n_tokens}")
        state = LlamaState(
            self.tokens[:n_tokens],
            logits,
            self.seed,
            self.fingerprint,
            layout=self._layout,
            segments=tuple(_head_segments(self._segments, n_tokens, self._layout)),
        )
        state._copy, state._offer = self._copy, self._offer
        return state._stage_ahead()

    def without_logits(self) -> LlamaState:
        """This state without its logits row, sharing everything else (no copy)."""
        if self.logits is None:
            return self
        state = LlamaState(self.tokens, None, self.seed, self.fingerprint, layout=self._layout,
                           segments=self._segments, opaque=self._opaque)
        state._canonical = self._canonical
        state._copy, state._offer = self._copy, self._offer
        return state

    def extended(
        self,
        shared_tokens: int,
        tokens: npt.NDArray[np.int32],
        logits: npt.NDArray[np.float32] | None,
        seed: int,
        seq_bytes: Bytes,
    ) -> LlamaState:
        """A state for ``tokens`` whose first ``shared_tokens`` have this state's KV.

        ``seq_bytes`` is llama.cpp's serialisation of the whole new sequence; only the KV of the new
        positions is copied out of it, the rest is shared with this state. When the new state would
        need assembling and the bytes are in canonical form, they are kept too, as its
        :class:`RestoreCopy` (taken over, no copy): restoring it then copies nothing, for as long as no
        cache releases them. Falls back to a state owning ``seq_bytes`` when the bytes do not parse
        into this state's layout.
        """
        parsed = parse_seq_state(seq_bytes)
        if (
            self._layout is None
            or parsed is None
            or parsed[0] != self._layout
            or parsed[1].n_tokens != len(tokens)
            or not 0 < shared_tokens <= min(self.n_tokens, len(tokens))
        ):
            return LlamaState.from_seq_bytes(tokens, logits, seed, self.fingerprint, seq_bytes)
        layout, whole = parsed
        segments = list(_head_segments(self._segments, shared_tokens, layout))
        if len(tokens) > shared_tokens:
            segments.append(whole.slice_copy(shared_tokens, layout))
        state = LlamaState(tokens, logits, seed, self.fingerprint, layout=layout, segments=tuple(segments))
        if len(tokens) == shared_tokens:
            state._copy, state._offer = self._copy, self._offer  # a head of this state: restored as its views are
        canonical_seq = canonical_seq_id(seq_bytes, len(tokens))
        if canonical_seq is not None and state.needs_assembly(canonical_seq):
            state._copy = RestoreCopy(seq_bytes, len(tokens), canonical_seq)
        return state._stage_ahead()

    # -- llama-cpp-python compatible names --------------------------------------------------------

    @property
    def input_ids(self) -> npt.NDArray[np.int32]:
        return self.tokens

    @property
    def scores(self) -> npt.NDArray[np.float32]:
        """The last logits row as a (1, n_vocab) array; (0, 0) when the state has none.

        Raises:
            IncompatibleStateError: read by ``llama_cpp.Llama.load_state``, which cannot restore this
                per-sequence state (it would first overwrite its scores and tokens, then fail in llama.cpp).
                A ``KeyError``: inside a completion, a cache miss.
        """
        # `scores` is the first attribute llama-cpp-python's load_state reads: stop it before it mutates.
        if sys._getframe(1).f_code is _UPSTREAM_LOAD_STATE:
            raise IncompatibleStateError(
                "a llama_cache.LlamaState is restored by llama_cache.Llama, not by a plain llama_cpp.Llama: "
                "use llama_cache.Llama, or a cache of llama-cpp-python's own states"
            )
        if self.logits is None:
            return np.zeros((0, 0), dtype=np.float32)
        return self.logits.reshape(1, -1)

    @property
    def llama_state(self) -> bytes:
        return self.seq_bytes().tobytes()

    @property
    def llama_state_size(self) -> int:
        if self._opaque is not None:
            return len(self._opaque)
        assert self._layout is not None
        return self._layout.serialized_size(self.n_tokens)

    def __repr__(self) -> str:
        kind = "opaque" if self._layout is None else f"{len(self._segments)} segment(s)"
        return f"LlamaState(n_tokens={self.n_tokens}, {kind}, nbytes={self.nbytes})"


def _read_only(array: Bytes) -> Bytes:
    view = array.view()
    view.flags.writeable = False
    return view


def _head_segments(segments: tuple[KVSegment, ...], n_tokens: int, layout: KVLayout) -> Iterator[KVSegment]:
    remaining = n_tokens
    for segment in segments:
        if remaining <= 0:
            return
        take = min(remaining, segment.n_tokens)
        yield segment.head(take, layout)
        remaining -= take
