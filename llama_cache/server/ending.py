"""Which parts of a schema or grammar can end: the check behind "refers to itself with no way to end".

A JSON schema such as ``{"$ref": "#"}``, or one whose required property is the schema itself, has no
finite instance; nor does a GBNF rule ``root ::= "a" root`` match a finite text. llguidance compiles
some of these and then fails at the first token (``NoExtensionBias``), and others it runs until
``max_tokens`` with a text that can never be complete. Both are refused before generating instead: the
schema or grammar is read into an :class:`EndingGraph`, whose nodes end when all (``"all"``) or one
(``"any"``) of their children do, and whose least fixpoint says which can.

The graph is the schema's or grammar's size; :meth:`EndingGraph.ending` is linear in it (each edge is
followed once) and iterative, so a hostile input costs no more than reading it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["EndingGraph", "Step"]

Kind = Literal["all", "any"]


@dataclass(frozen=True)
class Step:
    """One edge of a path: from ``source`` to ``target``, labelled as its graph's builder named it."""

    source: int
    label: str
    target: int


@dataclass
class EndingGraph:
    """Nodes that end when all (``"all"``) or any (``"any"``) of their children end.

    An ``"all"`` node without children ends (a literal, a schema with nothing it requires); an ``"any"``
    node without children never does (a ``false`` schema).
    """

    kinds: list[Kind] = field(default_factory=list)
    children: list[list[tuple[str, int]]] = field(default_factory=list)

    def add(self, kind: Kind) -> int:
        """A new node; its index."""
        self.kinds.append(kind)
        self.children.append([])
        return len(self.kinds) - 1

    def link(self, parent: int, label: str, child: int) -> None:
        """``parent`` needs ``child`` (all of them, or one of them, as its kind says); ``label`` says why."""
        self.children[parent].append((label, child))

    def ending(self) -> list[bool]:
        """For each node, whether it can end: the least fixpoint, in O(nodes + edges)."""
        n = len(self.kinds)
        parents: list[list[int]] = [[] for _ in range(n)]
        waiting = [0] * n
        ends = [False] * n
        ready: deque[int] = deque()
        for node, edges in enumerate(self.children):
            distinct = {child for _, child in edges}
            for child in distinct:
                parents[child].append(node)
            waiting[node] = len(distinct) if self.kinds[node] == "all" else (1 if distinct else 0)
            if self.kinds[node] == "all" and not distinct:
                ends[node] = True
                ready.append(node)
        while ready:
            child = ready.popleft()
            for parent in parents[child]:
                if not ends[parent]:
                    waiting[parent] -= 1
                    if waiting[parent] == 0:
                        ends[parent] = True
                        ready.append(parent)
        return ends

    def witness(self, start: int, ends: list[bool]) -> tuple[list[Step], int | None]:
        """Why ``start`` (a node that cannot end) cannot: the path through nodes that cannot end that it
        follows, each step to the first such child, until a node repeats or one with no children is reached.

        Returns:
            The steps, and the index in them where the repeated node was first left (the loop starts
            there), or None when the path ends at a node with no children (a ``false`` schema).
        """
        steps: list[Step] = []
        left: dict[int, int] = {}
        node = start
        while node not in left:
            nexts = [(label, child) for label, child in self.children[node] if not ends[child]]
            if not nexts:
                return steps, None
            left[node] = len(steps)
            label, child = nexts[0]
            steps.append(Step(node, label, child))
            node = child
        return steps, left[node]
