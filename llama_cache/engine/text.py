"""A generation's text, released as it grows: stop sequences cut it, incomplete characters wait.

:class:`StopText` is fed each sampled token's bytes and says which bytes are final: never the start of
a stop sequence that may still complete, never half a UTF-8 character. When a stop sequence appears,
the text ends just before it, as llama-cpp-python's completions end (stop sequences are matched on the
bytes of the text, not on tokens).

Cost: O(piece + longest stop sequence) per token; the text is kept once.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopText"]


class StopText:
    """The bytes of one generation's text and how many of them are released.

    Args:
        stops: the stop sequences (empty strings are ignored).
    """

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self._stops = [stop.encode("utf-8") for stop in stops if stop]
        self._longest = max((len(stop) for stop in self._stops), default=0)
        self.text = bytearray()
        self.released = 0
        self.stopped = False

    def add(self, piece: bytes) -> bytes:
        """Append ``piece``; return the bytes released by it (possibly none). Once a stop sequence has
        appeared (:attr:`stopped`), the text is cut before it and nothing more is taken."""
        if self.stopped or not piece:
            return b""
        before = len(self.text)
        self.text += piece
        if self._stops:
            window = max(before - self._longest + 1, 0)
            found = [i for i in (self.text.find(stop, window) for stop in self._stops) if i >= 0]
            if found:
                end = min(found)
                del self.text[end:]
                self.stopped = True
                return self._release(end, whole=True)
        held = self._held_for_stops()
        return self._release(len(self.text) - held, whole=False)

    def finish(self) -> bytes:
        """The generation ended: release whatever is held (an unfinished stop sequence's start, an
        incomplete character)."""
        return self._release(len(self.text), whole=True)

    def _held_for_stops(self) -> int:
        """The longest end of the text that starts some stop sequence (it may still complete)."""
        text = self.text
        for size in range(min(self._longest - 1, len(text) - self.released), 0, -1):
            tail = bytes(text[-size:])
            if any(stop.startswith(tail) for stop in self._stops):
                return size
        return 0

    def _release(self, end: int, whole: bool) -> bytes:
        if not whole:
            end = _character_boundary(self.text, self.released, end)
        if end <= self.released:
            return b""
        out = bytes(self.text[self.released : end])
        self.released = end
        return out


def _character_boundary(text: bytearray, start: int, end: int) -> int:
    """The largest position <= ``end`` (and >= ``start``) not inside a UTF-8 character."""
    for back in range(1, min(4, end - start) + 1):
        byte = text[end - back]
        if byte & 0xC0 == 0x80:
            continue  # a continuation byte: look further back for its lead
        if byte & 0x80 == 0:
            return end  # ASCII: complete
        size = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
        return end if back >= size else end - back
    return end
