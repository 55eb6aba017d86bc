"""Why a schema or grammar is refused: the error :mod:`.constraints` raises, and llguidance's text made fit to show.

llguidance reports a refused grammar as one line of text, sometimes with a source excerpt, an internal
tag (``<non-verbose/>``) or a dump of its own regular expressions, and never says where in the schema
the problem is. :mod:`.schema_refusals` and :mod:`.grammar_refusals` turn that text into a sentence
naming the place (a JSON pointer, a grammar rule and line) and the reason; this module holds what both
share: the error itself, how a part of a compiled schema is named for the client (:class:`SchemaPart`),
and the last-resort cleaning of a text neither recognises (:func:`clean`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["ConstraintError", "SchemaPart", "clean", "is_limit", "short"]

# Longest llguidance text read (its messages are short; a longer one is cut, so that matching it is bounded).
MAX_RAW_CHARS = 4096
_MAX_SHOWN_CHARS = 300
_TAG_BLOCK = re.compile(r"<(\w+)>.*?</\1>", re.S)
_TAG = re.compile(r"</?[\w-]+/?>")
_EXCERPT_LINE = re.compile(r"^ *\d+ \| .*$|^ *\^+ *$", re.M)
_LIMIT_WORDS = ("limit", "too many", "too big", "too large", "too complex", "fuel")


class ConstraintError(ValueError):
    """A schema or grammar the engine refuses, and why.

    ``str(error)`` is one sentence naming the part refused (a JSON pointer such as ``'#/properties/a'``,
    or a grammar rule and its line) and the reason, with nothing of llguidance's internals.

    ``code`` is ``invalid_schema`` for a schema or grammar that is invalid or uses a feature llguidance
    does not implement, ``schema_too_complex`` for one past :class:`~.constraints.ConstraintLimits`.
    ``field`` is the :class:`SchemaPart` field the refusal lies in, when the schema was compiled with
    parts and it lies in one (the message then locates it inside that part), else None.
    """

    def __init__(self, message: str, code: str = "invalid_schema", field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.field = field


@dataclass(frozen=True)
class SchemaPart:
    """A subschema that came from a field of its own, such as one function's parameters inside a schema
    choosing between several functions: a refusal inside it is located relative to it and names ``field``.

    ``pointer`` is where it lies in the compiled schema, as JSON pointer tokens (``("anyOf", "0",
    "properties", "arguments")``; ``()`` for the whole schema).
    """

    pointer: tuple[str, ...]
    field: str


def is_limit(raw: str) -> bool:
    """True if llguidance's text reports a limit of :class:`~.constraints.ConstraintLimits` reached."""
    lowered = raw[:MAX_RAW_CHARS].lower()
    if lowered.startswith(("regex parse error", "unsatisfiable schema")):
        return False
    return any(word in lowered for word in _LIMIT_WORDS)


def clean(raw: str) -> str:
    """llguidance's text without its internal tags, source excerpts and line breaks, cut to 300 characters."""
    text = _TAG.sub("", _TAG_BLOCK.sub("", raw[:MAX_RAW_CHARS]))
    text = " ".join(_EXCERPT_LINE.sub("", text).split())
    if len(text) > _MAX_SHOWN_CHARS:
        text = text[: _MAX_SHOWN_CHARS - 3].rstrip() + "..."
    return text or "llguidance gave no reason"


def short(value: Any, limit: int = 60) -> str:
    """``value`` as JSON, cut to ``limit`` characters: a value quoted inside a message."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
