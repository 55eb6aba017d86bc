"""Reading an entry back: its payload (a whole state) or its chain (head and chunks), checked against its row.

:func:`load` is what lookups and ``check(deep=True)`` call: a whole-state entry's payload is read into
private memory (:meth:`.payloads.DataDir.read`), decoded in place and compared with its row (kind,
namespace, cut, logits, token count, key); a chunked entry is read by :func:`.chunked.load`. Nothing
here needs the store's lock (payload files never change once named) or holds state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from llama_cache.caches.disk import chunked
from llama_cache.caches.disk.payloads import Unreadable
from llama_cache.caches.disk.rows import Entry
from llama_cache.state.chunks import KIND_CHUNKED
from llama_cache.state.format import KIND_UPSTREAM, CorruptStateError, decode, decode_upstream, payload_kind
from llama_cache.state.llama_state import LlamaState
from llama_cache.state.values import can_be_cut

if TYPE_CHECKING:
    from llama_cache.caches.disk.store import DiskStore


def load(store: DiskStore, entry: Entry, key: npt.NDArray[np.int32] | None, upto: int | None = None) -> Any:
    """Read, decode and check an entry's payload. No lock needed: payload files never change.

    Args:
        entry: a validated entry.
        key: its key (None: do not compare the state's tokens with it).
        upto: return only the state of the first ``upto`` tokens (a cuttable entry's; None: all).

    Raises:
        Unreadable: the file is missing, not a regular file, has the wrong length, does not
            decode, or does not hold what its row says.
        BrokenChain: a chunked entry's links or chunks are.
    """
    if entry.kind == KIND_CHUNKED:
        return chunked.load(store, entry, key, upto)
    state = _load_whole(store, entry, key)
    if upto is not None and isinstance(state, LlamaState) and state.layout is not None:
        return state.prefix(upto, None)
    return state


def _load_whole(store: DiskStore, entry: Entry, key: npt.NDArray[np.int32] | None) -> Any:
    """Read an entry stored whole (a payload file)."""
    buffer = store.data.read(entry.file, entry.size, entry.codec, entry.raw_size)
    try:
        kind = payload_kind(buffer)
        if kind != entry.kind:
            raise Unreadable(f"payload of kind {kind}, the index says {entry.kind}")
        if kind == KIND_UPSTREAM:
            state, namespace = decode_upstream(buffer, verify=store.verify)
            fingerprint = getattr(state, "fingerprint", None)
            cut, logits = True, bool(np.any(state.scores))
            held: npt.NDArray[Any] = state.input_ids[: state.n_tokens]
            if fingerprint is not None and fingerprint != namespace:
                raise Unreadable("payload's fingerprint differs from its namespace")
        else:
            state = decode(buffer, verify=store.verify)
            namespace, cut, logits, held = state.fingerprint, can_be_cut(state), state.logits is not None, state.tokens
    except Unreadable:
        raise
    except CorruptStateError as error:
        raise Unreadable(f"corrupt payload: {error}") from None
    except Exception as error:  # noqa: BLE001 - odd bytes past the checksum must stay a miss
        raise Unreadable(f"undecodable payload: {type(error).__name__}: {error}") from None
    if namespace != entry.namespace:
        raise Unreadable("payload belongs to another model than its index entry")
    if cut != entry.cut or logits != entry.logits or len(held) != entry.n_state:
        raise Unreadable("payload does not hold what its index entry says")
    if key is not None and (len(key) != entry.n_key or not np.array_equal(held[: len(key)], key)):
        raise Unreadable("payload does not hold the tokens of its key")
    return state
