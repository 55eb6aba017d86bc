"""llguidance's refusal of a JSON schema, told as where in the schema and why.

llguidance 1.9.1 names the keyword or value at fault (``Unimplemented keys: ["not"]``, ``Pointer
'/$defs/x' does not exist``, ``Unsatisfiable schema: minimum (5) is greater than maximum (1)``) but
not where it is. :func:`describe` recognises its messages and finds the subschema they are about: the
first, in document order, of those the root uses (:meth:`.SchemaIndex.reachable`) that holds the
keyword or value named, as llguidance reads definitions only when referenced. A message it does not
recognise is shown cleaned (:func:`.refusals.clean`), without a place.

Cost: one pass over the index per message, and the regular expressions here run on at most
:data:`.refusals.MAX_RAW_CHARS` characters of it, each linear in them.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

from llama_cache.server.refusals import MAX_RAW_CHARS, clean, short
from llama_cache.server.schema_nodes import Pointer, SchemaIndex, pointer_text

__all__ = ["describe"]

Refusal = tuple[Pointer | None, str]
_TYPES = ("array", "boolean", "integer", "null", "number", "object", "string")
_KINDS = {"f64": "a number", "string": "a string", "array": "an array", "object": "an object",
          "bool": "a boolean", "boolean": "a boolean", "u64": "a non-negative integer", "i64": "an integer"}
_PROCESSING = re.compile(r"\n\s*while processing (\S+)")


def describe(index: SchemaIndex, raw: str) -> Refusal:
    """Where and why, for llguidance's refusal ``raw`` of the schema ``index`` was built from.

    Returns:
        The pointer of the subschema at fault (None when no place is known) and the reason: a phrase
        following "the schema at '<pointer>'" (or "the schema").
    """
    raw = raw[:MAX_RAW_CHARS]
    processing = _PROCESSING.search(raw)
    message = raw[: processing.start()] if processing else raw
    hint = _processing_pointer(index, processing.group(1)) if processing else None
    for pattern, handler in _HANDLERS:
        match = pattern.search(message)
        if match:
            pointer, reason = handler(index, match)
            if hint is not None and (pointer is None or pointer[: len(hint)] != hint):
                pointer = hint  # llguidance named the definition it was compiling
            return pointer, reason
    return hint, f"cannot be enforced: {clean(message)}"


# ------------------------------------------------------------------------------ finding the place

def _find(index: SchemaIndex, test: Callable[[dict[str, Any]], bool]) -> Pointer | None:
    """The first subschema the root uses that passes ``test``; else the first of all (a definition)."""
    for pointers in (index.reachable(), iter(index.nodes)):
        for pointer in pointers:
            node = index.nodes[pointer]
            if isinstance(node, dict) and test(node):
                return pointer
    return None


def _processing_pointer(index: SchemaIndex, uri: str) -> Pointer | None:
    """The subschema llguidance's "while processing <uri>#<pointer>" names (the document's is ``json-schema:///``)."""
    base, _, fragment = uri.partition("#")
    if base.startswith("json-schema:///"):
        base = base[len("json-schema:///"):]
    return index.resolve((), f"{base}#{fragment}")


def _has(keyword: str, value: Any = ...) -> Callable[[dict[str, Any]], bool]:
    return lambda node: keyword in node and (value is ... or _same(node[keyword], value))


def _same(left: Any, right: Any) -> bool:
    """JSON equality of a schema's value and one llguidance printed (numbers by value: 5 == 5.0)."""
    if isinstance(left, (int, float)) and not isinstance(left, bool):
        try:
            return math.isclose(float(left), float(right), rel_tol=1e-12)
        except (TypeError, ValueError):
            return False
    return left == right


def _number(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


# ------------------------------------------------------------------------------------ the handlers

def _unimplemented(index: SchemaIndex, match: re.Match[str]) -> Refusal:
    keys = re.findall(r'"((?:[^"\\]|\\.)*)"', match.group(1)) or [match.group(1)]
    pointer = _find(index, lambda node: any(key in node for key in keys))
    named = " and ".join(json.dumps(key) for key in keys)
    return pointer, f"uses {named}, which structured outputs do not support"


def _missing_pointer(index: SchemaIndex, match: re.Match[str]) -> Refusal:
    missing = match.group(1)

    def refers(node: dict[str, Any]) -> bool:
        ref = node.get("$ref")
        return isinstance(ref, str) and "#" in ref and unquote(ref.partition("#")[2]) == unquote(missing)
    pointer = _find(index, refers)
    ref = index.nodes[pointer]["$ref"] if pointer is not None else "#" + missing
    return pointer, f'refers to {json.dumps(ref)} ("$ref"), which is not in the schema'


def _remote(index: SchemaIndex, match: re.Match[str]) -> Refusal:
    resource = match.group(1)
    local = resource[len("json-schema:///"):] if resource.startswith("json-schema:///") else resource
    for keyword in ("$ref", "$schema"):
        pointer = _find(index, lambda node, k=keyword: isinstance(node.get(k), str)
                        and node[k].partition("#")[0] in (resource, local))
        if pointer is not None:
            value = index.nodes[pointer][keyword]
            if keyword == "$schema":
                return pointer, f'declares "$schema": {short(value)}, which is not a JSON Schema draft llguidance knows'
            return pointer, (f'refers to {short(value)} ("$ref"), another document: only references inside the '
                             'schema ("#...") are followed')
    return None, f"refers to {short(local)}, another document: only references inside the schema are followed"


def _unknown_draft(index: SchemaIndex, match: re.Match[str]) -> Refusal:
    return (_find(index, _has("$schema")),
            f'declares "$schema": {short(match.group(1))}, which is not a JSON Schema draft llguidance knows')


def _format(index: SchemaIndex, match: re.Match[str]) -> Refusal:
    name = match.group(1).strip()
    return (_find(index, _has("format", name)),
            f'has "format": {short(name)}, which structured outputs do not know')


def _regex(index: SchemaIndex, match: re.Match[str]) -> Refusal:
    shown, carets, reason = match.group(1), match.group(2), match.group(3).strip()
    regex = shown[4:] if shown.startswith("    ") else shown.strip()
    column = max(len(carets) - len(carets.lstrip(" ")) - 4, 0)

    def holds(node: dict[str, Any]) -> bool:
        names = node.get("patternProperties")
        return node.get("pattern") == regex or (isinstance(names, dict) and regex in names)
    pointer = _find(index, holds)
    where = '"patternProperties" name' if pointer is not None and index.nodes[pointer].get("pattern") != regex \
        else '"pattern"'
    return pointer, (f"has a {where} {short(regex)} that is not a regular expression structured outputs "
                     f"support: {reason} (at character {column + 1})")


def _unsatisfiable(index: SchemaIndex, match: re.Match[str]) -> Refusal:
    detail = match.group(1).strip()
    for pattern, handler in _UNSATISFIABLE:
        found = pattern.search(detail)
        if found:
            return handler(index, found)
    return None, f"allows no value: {clean(detail)}"


def _compare(index: SchemaIndex, match: re.Match[str]) -> Refusal:
    low, low_value, relation, high, high_value = match.groups()
    pointer = _find(index, lambda node: _same(node.get(low), _number(low_value))
                    and (high not in node or _same(node[high], _number(high_value))))
    if pointer is None:
        pointer = _find(index, _has(high, _number(high_value)))
    return pointer, f"allows no value: {low} ({low_value}) is {relation} {high} ({high_value})"


def _compare_keywords(index: SchemaIndex, match: re.Match[str]) -> Refusal:
    low, high = match.groups()

    def inverted(node: dict[str, Any]) -> bool:
        try:
            return node[low] > node[high]
        except (KeyError, TypeError):
            return False
    pointer = _find(index, inverted)
    if pointer is None:
        return None, f"allows no value: {low} is greater than {high}"
    node = index.nodes[pointer]
    return pointer, f"allows no value: {low} ({short(node[low])}) is greater than {high} ({short(node[high])})"


def _no_integer(index: SchemaIndex, match: re.Match[str]) -> Refusal:
    low, high = match.groups()

    def bounded(node: dict[str, Any]) -> bool:
        kinds = node.get("type")
        return (kinds == "integer" or isinstance(kinds, list) and "integer" in kinds) and any(
            _same(node.get(key), _number(bound)) for key in ("minimum", "exclusiveMinimum", "maximum",
                                                            "exclusiveMaximum") for bound in (low, high))
    return _find(index, bounded), f"allows no integer: its bounds [{low}, {high}] hold none"


def _required(index: SchemaIndex, match: re.Match[str]) -> Refusal:
    name = match.group(1)
    pointer = _find(index, lambda node: isinstance(node.get("required"), list) and name in node["required"]
                    and _forbids(node, name) is not None)
    if pointer is None:
        return None, f"requires the property {short(name)}, which no value can have"
    reason = _forbids(index.nodes[pointer], name)
    inner = pointer + ("properties", name)
    node = index.nodes.get(inner)
    why = _contradiction(index, inner, node) if isinstance(node, dict) else None
    if why is not None:
        reason = f"whose schema at '{pointer_text(inner)}' allows no value: {why}"
    return pointer, f"requires the property {short(name)}, {reason}"


_MAX_DEPTH = 32  # required properties followed down, at most (the server's schemas nest no deeper)
_BOUNDS = (("minimum", "maximum"), ("exclusiveMinimum", "exclusiveMaximum"), ("minimum", "exclusiveMaximum"),
           ("exclusiveMinimum", "maximum"), ("minLength", "maxLength"), ("minItems", "maxItems"),
           ("minProperties", "maxProperties"))


def _contradiction(index: SchemaIndex, pointer: Pointer, node: dict[str, Any], depth: int = 0) -> str | None:
    """An evident reason ``node`` allows no value (bounds the wrong way round, types in conflict, an
    empty ``enum``, a required property with such a reason), or None: what llguidance reports of a
    required property only as "unsatisfiable". Each subschema is looked at once at most."""
    for low, high in _BOUNDS:
        try:
            inverted = node[low] > node[high] or (node[low] == node[high] and "exclusive" in low + high)
        except (KeyError, TypeError):
            continue
        if inverted:
            relation = "greater than" if node[low] > node[high] else "equal to"
            return f"{low} ({short(node[low])}) is {relation} {high} ({short(node[high])})"
    if node.get("enum") == []:
        return 'its "enum" is empty'
    conflict = _type_conflict(index, pointer, node)
    if conflict is not None or depth >= _MAX_DEPTH or not isinstance(node.get("required"), list):
        return conflict
    for name in node["required"]:
        if not isinstance(name, str):
            continue
        inner = pointer + ("properties", name)
        child = index.nodes.get(inner)
        why = _contradiction(index, inner, child, depth + 1) if isinstance(child, dict) else None
        if why is not None:
            return f"it requires the property {short(name)}, whose schema at '{pointer_text(inner)}' allows no value: {why}"
    return None


def _forbids(node: dict[str, Any], name: str) -> str | None:
    """Why an object schema cannot have the property ``name``, or None if it may."""
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    if name in properties:
        return "whose schema is false" if properties[name] is False else "whose schema allows no value"
    if node.get("additionalProperties") is False:
        return 'which "additionalProperties": false forbids'
    if "additionalProperties" not in node and "patternProperties" not in node and "properties" in node:
        return ('which its "properties" do not list: an object schema listing "properties" allows no other '
                'property here unless "additionalProperties" says so')
    return None


def _incompatible(index: SchemaIndex, match: re.Match[str]) -> Refusal:
    del match
    for pointer in index.reachable():
        node = index.nodes[pointer]
        if isinstance(node, dict):
            conflict = _type_conflict(index, pointer, node)
            if conflict:
                return pointer, f"allows no value: {conflict}"
    return None, "allows no value: it asks for types no value has at once"


def _type_conflict(index: SchemaIndex, pointer: Pointer, node: dict[str, Any]) -> str | None:
    """Two parts of ``node`` (its ``type``, ``const``, ``enum``, ``allOf`` items' types) no value satisfies together."""
    parts: list[tuple[str, set[str]]] = []
    if (kinds := _types(node.get("type"))) is not None:
        parts.append((f'"type": {short(node["type"])}', kinds))
    if "const" in node:
        parts.append((f'"const": {short(node["const"])}', _value_types(node["const"])))
    if isinstance(node.get("enum"), list) and node["enum"]:
        parts.append((f'"enum": {short(node["enum"])}', set().union(*(_value_types(v) for v in node["enum"]))))
    for position, item in enumerate(node.get("allOf") or [] if isinstance(node.get("allOf"), list) else []):
        if isinstance(item, dict) and (kinds := _types(item.get("type"))) is not None:
            parts.append((f'"allOf" item {position} ("type": {short(item["type"])})', kinds))
    for first in range(len(parts)):
        for second in range(first + 1, len(parts)):
            if not _compatible(parts[first][1], parts[second][1]):
                return f"{parts[first][0]} and {parts[second][0]} have no type in common"
    return None


def _types(value: Any) -> set[str] | None:
    if isinstance(value, str):
        return {value}
    if isinstance(value, list) and all(isinstance(kind, str) for kind in value):
        return set(value)
    return None


def _value_types(value: Any) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or isinstance(value, float) and value.is_integer():
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    return {"string" if isinstance(value, str) else "array" if isinstance(value, list) else "object"}


def _compatible(left: set[str], right: set[str]) -> bool:
    widened = [kinds | ({"integer"} if "number" in kinds else set()) for kinds in (left, right)]
    return bool(widened[0] & widened[1])


def _empty_choice(index: SchemaIndex, match: re.Match[str]) -> Refusal:
    del match
    for keyword in ("enum", "anyOf", "oneOf"):
        pointer = _find(index, _has(keyword, []))
        if pointer is not None:
            return pointer, f'allows no value: its "{keyword}" is empty'
    return None, "allows no value: it offers no option"


def _empty_regex(index: SchemaIndex, match: re.Match[str]) -> Refusal:
    del match
    pointer = _find(index, lambda node: "pattern" in node or "format" in node)
    if pointer is None:
        return None, "allows no string: no string matches its pattern, format and length bounds together"
    node = index.nodes[pointer]
    parts = [f'"{key}": {short(node[key])}' for key in ("pattern", "format", "minLength", "maxLength") if key in node]
    together = " together" if len(parts) > 1 else ""
    return pointer, f"allows no string: no string matches {', '.join(parts)}{together}"


def _required_item(index: SchemaIndex, match: re.Match[str]) -> Refusal:
    least = match.group(2)
    pointer = _find(index, lambda node: isinstance(node.get("minItems"), int) and node["minItems"] > 0
                    and (least is None or _same(node["minItems"], _number(least))))
    if match.group(1) is not None:
        items = "an item" if least == "1" else f"{least} items"
        return pointer, f'allows no value: it needs at least {items} ("minItems"), but item {match.group(1)} allows none'
    return pointer, 'allows no value: it needs at least one item ("minItems"), but its items allow none'


def _all_options(index: SchemaIndex, match: re.Match[str]) -> Refusal:
    del match
    return _find(index, _has("anyOf")), 'allows no value: no option of its "anyOf" allows one'


_UNSATISFIABLE: list[tuple[re.Pattern[str], Callable[[SchemaIndex, re.Match[str]], Refusal]]] = [
    (re.compile(r"(\w+) \(([^()]*)\) is (greater than|equal to) (\w+) \(([^()]*)\)"), _compare),
    (re.compile(r"(\w+) > (\w+)"), _compare_keywords),
    (re.compile(r"integer interval \[([^,\]]*), ([^\]]*)\] contains no integer"), _no_integer),
    (re.compile(r"required property '(.*)' is unsatisfiable"), _required),
    (re.compile(r"incompatible types"), _incompatible),
    (re.compile(r"anyOf is empty|No options in anyOf"), _empty_choice),
    (re.compile(r"All options in anyOf are unsatisfiable"), _all_options),
    (re.compile(r"Regex is empty"), _empty_regex),
    (re.compile(r"prefixItems\[(\d+)\] is unsatisfiable but minItems is (\d+)|required item is unsatisfiable()"),
     _required_item),
]


def _invalid_type(index: SchemaIndex, match: re.Match[str]) -> Refusal:
    name = match.group(1).strip()
    pointer = _find(index, lambda node: node.get("type") == name
                    or isinstance(node.get("type"), list) and name in node["type"])
    return pointer, f'has "type": {short(name)}, which is not a JSON Schema type ({", ".join(_TYPES)})'


def _wrong_value(keyword: str, kind: str) -> Callable[[SchemaIndex, re.Match[str]], Refusal]:
    """A handler for "<keyword> must be <kind>": the first subschema whose ``keyword`` is of another type."""
    def handler(index: SchemaIndex, match: re.Match[str]) -> Refusal:
        del match
        return _wrong(index, keyword, kind)
    return handler


def _expected(index: SchemaIndex, match: re.Match[str]) -> Refusal:
    kind, keyword = match.group(1), match.group(2)
    return _wrong(index, keyword, _KINDS.get(kind, kind))


def _must_be(index: SchemaIndex, match: re.Match[str]) -> Refusal:
    return _wrong(index, match.group(1), match.group(2))


def _wrong(index: SchemaIndex, keyword: str, kind: str) -> Refusal:
    test = _IS_KIND.get(kind, lambda value: False)
    pointer = _find(index, lambda node: keyword in node and not test(node[keyword]))
    shown = f": {short(index.nodes[pointer][keyword])}" if pointer is not None else ""
    return pointer, f'has "{keyword}"{shown}, which must be {kind}'


_IS_KIND: dict[str, Callable[[Any], bool]] = {
    "a number": lambda value: isinstance(value, (int, float)) and not isinstance(value, bool),
    "a non-negative integer": lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= 0,
    "an integer": lambda value: isinstance(value, int) and not isinstance(value, bool),
    "a string": lambda value: isinstance(value, str),
    "an array": lambda value: isinstance(value, list),
    "an object": lambda value: isinstance(value, dict),
    "a boolean": lambda value: isinstance(value, bool),
    "a string or array of strings": lambda value: isinstance(value, str) or isinstance(value, list) and all(
        isinstance(item, str) for item in value),
    "a type name or a list of them": lambda value: isinstance(value, str) or isinstance(value, list) and all(
        isinstance(item, str) for item in value),
}


def _not_a_schema(index: SchemaIndex, match: re.Match[str]) -> Refusal:
    del match
    used = set(index.reachable())
    places = [pointer for pointer in index.malformed if pointer[:-1] in used or pointer[:-2] in used]
    pointer = (places or index.malformed or [None])[0]
    return pointer, "is not a schema (an object or a boolean)"


def _options(index: SchemaIndex, match: re.Match[str]) -> Refusal:
    root = index.nodes.get(())
    return (() if isinstance(root, dict) and "x-guidance" in root else None,
            f'has "x-guidance" options llguidance cannot read: {clean(match.group(0))}')


def _one_of(index: SchemaIndex, match: re.Match[str]) -> Refusal:
    del match
    return _find(index, _has("oneOf")), 'uses "oneOf", which structured outputs do not support'


def _no_start(index: SchemaIndex, match: re.Match[str]) -> Refusal:
    del index, match
    return None, "allows no value: llguidance finds no token a value could start with"


_HANDLERS: list[tuple[re.Pattern[str], Callable[[SchemaIndex, re.Match[str]], Refusal]]] = [
    (re.compile(r"^NoExtensionBias"), _no_start),
    (re.compile(r"Unimplemented keys: \[(.*)\]"), _unimplemented),
    (re.compile(r"Pointer '(.*)' does not exist"), _missing_pointer),
    (re.compile(r"Resource '(.*)' is not present in a registry"), _remote),
    (re.compile(r"Unknown specification: (.*)"), _unknown_draft),
    (re.compile(r"Unknown format: (.*)"), _format),
    (re.compile(r"regex parse error:\n(.*)\n( *\^+)\s*\nerror: (.*)"), _regex),
    (re.compile(r"Unsatisfiable schema: (.*)", re.S), _unsatisfiable),
    (re.compile(r"Invalid type: (.*)"), _invalid_type),
    (re.compile(r"type must be a string or array of strings|type must be a string"),
     _wrong_value("type", "a type name or a list of them")),
    (re.compile(r"Expected (\w+) for '([^']+)'"), _expected),
    (re.compile(r"^schema must be an object or boolean"), _not_a_schema),
    (re.compile(r"^(\$?\w+) must be (an? \w+)"), _must_be),
    (re.compile(r"oneOf constraints are not supported"), _one_of),
    (re.compile(r"^(invalid type|unknown field|missing field|invalid value).*", re.S), _options),
]

