"""JSON schemas with no finite instance: ``{"$ref": "#"}``, a required property that is the schema again.

A subschema ends (has a finite instance) only if where its ``$ref`` leads, every ``allOf`` item, one
``anyOf``/``oneOf`` option, and, for ``"type": "object"``, each required property listed in
``properties`` (for ``"type": "array"``, the items ``minItems`` requires) end. Everything else is taken
to end, so the check errs only towards accepting: a schema it refuses has no finite instance at all
(llguidance would fail at its first token, or generate until ``max_tokens``). O(size of the schema).
"""

from __future__ import annotations

import json
from typing import Any

from llama_cache.server.ending import EndingGraph, Step
from llama_cache.server.schema_nodes import Pointer, SchemaIndex, where

__all__ = ["unending"]

_OPTION = "option "
_SHOWN_STEPS = 8  # of a loop or path told in a message (a loop may pass through every subschema)


def unending(index: SchemaIndex) -> tuple[Pointer, str] | None:
    """Why the schema has no finite instance, or None if it may have one.

    Returns:
        The pointer of the subschema that cannot end and the reason, a phrase following "the schema at
        '<pointer>'" (``refers to itself with no way to end ("$ref": "#" at the root)``).
    """
    if () not in index.nodes:
        return None
    graph = EndingGraph()
    owners: list[Pointer] = []  # the subschema each graph node stands for (or whose anyOf it is)
    ids: dict[Pointer, int] = {}
    for pointer, node in index.nodes.items():
        ids[pointer] = graph.add("any" if node is False else "all")
        owners.append(pointer)
    for pointer, node in index.nodes.items():
        if isinstance(node, dict):
            _link(graph, index, ids, owners, pointer, node)
    ends = graph.ending()
    if ends[ids[()]]:
        return None
    steps, loop = graph.witness(ids[()], ends)
    if loop is None:
        last = owners[steps[-1].target] if steps else ()
        return (), f"allows no value: it needs {_chain(steps, owners)}, and the schema at {where(last)} is false"
    cycle, approach = steps[loop:], steps[:loop]
    start = owners[cycle[0].source]
    reason = f"refers to itself with no way to end ({_chain(cycle, owners)})"
    if approach:
        reason += f", which the schema at {where(())} needs ({_chain(approach, owners)})"
    return start, reason


def _link(graph: EndingGraph, index: SchemaIndex, ids: dict[Pointer, int], owners: list[Pointer],
          pointer: Pointer, node: dict[str, Any]) -> None:
    here = ids[pointer]
    ref = node.get("$ref")
    if isinstance(ref, str):
        target = index.resolve(pointer, ref)
        if target is not None:
            graph.link(here, f'"$ref": {json.dumps(ref)}', ids[target])
    for position, child in _items(node.get("allOf"), pointer, "allOf", ids):
        graph.link(here, f'"allOf" item {position}', child)
    for keyword in ("anyOf", "oneOf"):
        options = _items(node.get(keyword), pointer, keyword, ids)
        if options and len(options) == len(node[keyword]):
            group = graph.add("any")
            owners.append(pointer)
            graph.link(here, f'every option of "{keyword}"', group)
            for position, child in options:
                graph.link(group, _OPTION + str(position), child)
    kind = node.get("type")
    kind = kind[0] if isinstance(kind, list) and len(kind) == 1 else kind
    if kind == "object":
        _link_required(graph, ids, pointer, node, here)
    elif kind == "array":
        _link_items(graph, ids, pointer, node, here)


def _link_required(graph: EndingGraph, ids: dict[Pointer, int], pointer: Pointer, node: dict[str, Any],
                   here: int) -> None:
    required, properties = node.get("required"), node.get("properties")
    if not isinstance(required, list) or not isinstance(properties, dict):
        return
    for name in dict.fromkeys(name for name in required if isinstance(name, str)):
        child = ids.get(pointer + ("properties", name))
        if child is not None:
            graph.link(here, f"the required property {json.dumps(name)}", child)


def _link_items(graph: EndingGraph, ids: dict[Pointer, int], pointer: Pointer, node: dict[str, Any],
                here: int) -> None:
    least = node.get("minItems")
    if isinstance(least, bool) or not isinstance(least, int) or least < 1:
        return
    keyword, rest = ("items", "additionalItems") if isinstance(node.get("items"), list) else ("prefixItems", "items")
    prefix = node.get(keyword) if isinstance(node.get(keyword), list) else []
    for position in range(min(least, len(prefix))):
        child = ids.get(pointer + (keyword, str(position)))
        if child is not None:
            graph.link(here, f'item {position} ("{keyword}", with "minItems": {least})', child)
    if least > len(prefix) and (child := ids.get(pointer + (rest,))) is not None:
        graph.link(here, f'its items ("{rest}", with "minItems": {least})', child)


def _items(value: Any, pointer: Pointer, keyword: str, ids: dict[Pointer, int]) -> list[tuple[int, int]]:
    if not isinstance(value, list):
        return []
    found = ((position, ids.get(pointer + (keyword, str(position)))) for position in range(len(value)))
    return [(position, child) for position, child in found if child is not None]


def _chain(steps: list[Step], owners: list[Pointer]) -> str:
    """The steps as ``"$ref": "#" at the root, then ... at '#/a'`` (an ``anyOf`` and its option: one step)."""
    parts: list[str] = []
    for step in steps:
        if parts and step.label.startswith(_OPTION):
            parts[-1] += f", such as {step.label}"
            continue
        parts.append(f"{step.label} at {where(owners[step.source])}")
    if len(parts) > _SHOWN_STEPS:
        parts[_SHOWN_STEPS - 2:-1] = [f"{len(parts) - _SHOWN_STEPS + 1} more steps"]
    return ", then ".join(parts)
