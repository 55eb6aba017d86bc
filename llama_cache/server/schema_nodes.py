"""The subschemas of a JSON schema by JSON pointer, and where its local references lead.

What :mod:`.schema_refusals` and :mod:`.schema_ending` read to name the part of a schema a refusal is
about. :meth:`SchemaIndex.of` walks the schema once, iteratively (no recursion, whatever its depth), in
O(its size times its depth) (each pointer is a tuple of its path). References are followed as JSON
Schema does inside one document: ``#``, ``#/json/pointer`` and ``#anchor`` relative to the nearest
``$id`` (the document when none), and a ``$id`` named whole; any other reference (another document)
resolves to nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit, uses_relative

__all__ = ["Pointer", "SchemaIndex", "pointer_text", "where"]

Pointer = tuple[str, ...]

# Keywords whose value is one subschema, a list of them, or a map of names to them.
_ONE = frozenset({"additionalProperties", "additionalItems", "items", "contains", "not", "if", "then", "else",
                  "propertyNames", "unevaluatedItems", "unevaluatedProperties", "contentSchema"})
_LIST = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
_MAP = frozenset({"properties", "patternProperties", "dependentSchemas", "$defs", "definitions"})
# Subschemas used only through a reference: a refusal inside one unreferenced is not the schema's.
_DEFINITIONS = frozenset({"$defs", "definitions"})


def pointer_text(pointer: Pointer) -> str:
    """``pointer`` as a URI fragment JSON pointer: ``#``, ``#/properties/a~1b``."""
    return "#" + "".join("/" + token.replace("~", "~0").replace("/", "~1") for token in pointer)


def where(pointer: Pointer) -> str:
    """``pointer`` as a place in a sentence: ``the root`` or ``'#/properties/a'``."""
    return "the root" if not pointer else f"'{pointer_text(pointer)}'"


@dataclass
class SchemaIndex:
    """Every subschema of one schema, by pointer, in document order.

    Attributes:
        nodes: each subschema (an object or a boolean) by its pointer, the root ``()`` first.
        children: each object subschema's own subschemas as (keyword, pointer), in document order;
            definitions (``$defs``, ``definitions``) excluded, being reached only through references.
        malformed: places where a subschema belongs but something else is (``{"items": 5}``), in order.
    """

    nodes: dict[Pointer, Any] = field(default_factory=dict)
    children: dict[Pointer, list[tuple[str, Pointer]]] = field(default_factory=dict)
    malformed: list[Pointer] = field(default_factory=list)
    _resource: dict[Pointer, Pointer] = field(default_factory=dict)
    _base: dict[Pointer, str] = field(default_factory=dict)
    _ids: dict[str, Pointer] = field(default_factory=dict)
    _anchors: dict[tuple[Pointer, str], Pointer] = field(default_factory=dict)

    @classmethod
    def of(cls, schema: Any) -> SchemaIndex:
        """The index of ``schema`` (any JSON value: one that is not a schema indexes as ``malformed`` root)."""
        index = cls()
        stack: list[tuple[Pointer, Any, Pointer, str]] = [((), schema, (), "")]
        while stack:
            pointer, node, resource, base = stack.pop()
            if not isinstance(node, (dict, bool)):
                index.malformed.append(pointer)
                continue
            index.nodes[pointer] = node
            if isinstance(node, dict):
                resource, base = index._enter(pointer, node, resource, base)
            index._resource[pointer] = resource
            index._base[pointer] = base
            if not isinstance(node, dict):
                continue
            own: list[tuple[str, Pointer]] = []
            pending: list[tuple[Pointer, Any]] = []
            for keyword, value in node.items():
                for child, item in _subschemas(pointer, keyword, value):
                    pending.append((child, item))
                    if keyword not in _DEFINITIONS and isinstance(item, (dict, bool)):
                        own.append((keyword, child))
            index.children[pointer] = own
            stack.extend((child, item, resource, base) for child, item in reversed(pending))
        return index

    def _enter(self, pointer: Pointer, node: dict[str, Any], resource: Pointer, base: str) -> tuple[Pointer, str]:
        identifier = node.get("$id")
        if isinstance(identifier, str) and identifier and not identifier.startswith("#"):
            base = _join(base, identifier.split("#", 1)[0])
            resource = pointer
            self._ids.setdefault(base, pointer)
        anchor = node.get("$anchor")
        if isinstance(anchor, str):
            self._anchors.setdefault((resource, anchor), pointer)
        return resource, base

    def resolve(self, at: Pointer, ref: str) -> Pointer | None:
        """Where the reference ``ref`` made at ``at`` leads: a subschema's pointer, or None (another
        document, or nothing there)."""
        uri, _, fragment = ref.partition("#")
        if uri:
            resource = self._ids.get(_join(self._base.get(at, ""), uri))
            if resource is None:
                resource = self._ids.get(uri)
            if resource is None:
                return None
        else:
            resource = self._resource.get(at, ())
        fragment = unquote(fragment)
        if not fragment:
            return resource
        if not fragment.startswith("/"):
            return self._anchors.get((resource, fragment))
        tokens = tuple(token.replace("~1", "/").replace("~0", "~") for token in fragment[1:].split("/"))
        target = resource + tokens
        return target if target in self.nodes else None

    def reachable(self) -> Iterator[Pointer]:
        """The subschemas the root uses, each once, in document order: a node's own subschemas, then where
        its ``$ref`` leads. Definitions no reference reaches are left out (llguidance never reads them)."""
        seen: set[Pointer] = set()
        stack: list[Pointer] = [()] if () in self.nodes else []
        while stack:
            pointer = stack.pop()
            if pointer in seen:
                continue
            seen.add(pointer)
            yield pointer
            node = self.nodes[pointer]
            nexts = [child for _, child in self.children.get(pointer, ())]
            ref = node.get("$ref") if isinstance(node, dict) else None
            if isinstance(ref, str):
                target = self.resolve(pointer, ref)
                if target is not None:
                    nexts.append(target)
            stack.extend(reversed(nexts))


def _subschemas(pointer: Pointer, keyword: str, value: Any) -> Iterator[tuple[Pointer, Any]]:
    """The subschema positions a keyword's value holds, with what each holds."""
    if keyword in _LIST and isinstance(value, list):
        for position, item in enumerate(value):
            yield pointer + (keyword, str(position)), item
    elif keyword in _MAP and isinstance(value, dict):
        for name, item in value.items():
            yield pointer + (keyword, name), item
    elif keyword in _ONE:
        yield pointer + (keyword,), value


def _join(base: str, uri: str) -> str:
    if not base or urlsplit(base).scheme not in uses_relative:
        return uri or base
    return urljoin(base, uri)
