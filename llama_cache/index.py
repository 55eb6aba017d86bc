"""A compressed radix tree (radix trie) over token ids, keyed by token prefixes.

:class:`RadixIndex` maps token sequences (tuples of non-negative ints below ``2**31``) to arbitrary
values and answers the two prefix questions a prompt-state cache needs:

* :meth:`RadixIndex.longest_prefix` -- the longest stored key that is a prefix of a query (a cached state
  that can be restored as-is, after which only the rest of the query needs evaluating);
* :meth:`RadixIndex.longest_common_prefix` -- the stored key sharing the most leading tokens with a query,
  even if it continues past the point where the two diverge (a state that can be restored and then
  truncated), ties going to the most recently used key.

Layout: every edge holds a run of tokens as one read-only ``numpy.int32`` array (4 bytes per token, not one
Python object per token). Each node keeps its children in a dict keyed by the first token of the child's
edge, so a lookup costs one dict probe per node plus one vectorised comparison per edge: O(K) in the query
length K, independent of the number of stored keys. Inserting a key that diverges inside an edge splits it;
removing a key merges a non-terminal node with its only child and prunes non-terminal leaves, so the tree
never holds more than ``2 * len(index) + 1`` nodes.

Token sequences are validated and converted by :mod:`llama_cache.tokens`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar, cast

import numpy as np

from llama_cache.tokens import TokenArray, Tokens, as_token_array
from llama_cache.tokens import readonly as _readonly

__all__ = ["Match", "RadixIndex", "TrieNode"]

V = TypeVar("V")

_EMPTY: TokenArray = _readonly(np.empty(0, dtype=np.int32))


def _matched(edge: TokenArray, query: TokenArray, pos: int) -> int:
    """Length of the common prefix of ``edge`` and ``query[pos:]``, knowing that ``edge[0] == query[pos]``.

    O(min(len(edge), len(query) - pos)), vectorised.
    """
    m = min(len(edge), len(query) - pos)
    if m <= 1:
        return m
    diff = edge[1:m] != query[pos + 1 : pos + m]
    first = int(diff.argmax())
    return first + 1 if diff[first] else m


class TrieNode(Generic[V]):
    """A node of :class:`RadixIndex`'s tree: the edge leading into it, its children, its entry if any.

    Public for introspection only (tests, debugging, memory accounting): :class:`RadixIndex` owns its
    nodes, and changing one from outside breaks the index.

    Attributes:
        edge: The token run on the edge from the parent (read-only int32 array; empty only at the root).
        children: Child nodes keyed by the first token of their edge (``children[t].edge[0] == t``).
        parent: The parent node, or None at the root.
        value: The value stored under the key ending here (meaningful only when ``stamp > 0``).
        stamp: 0 for a non-terminal node, else the recency stamp (> 0) of the key ending here.
        best: The terminal node with the highest stamp in this node's subtree (itself included), or None
            when the subtree holds no key (only possible for the root).
    """

    __slots__ = ("edge", "children", "parent", "value", "stamp", "best")

    def __init__(self, edge: TokenArray, parent: TrieNode[V] | None) -> None:
        self.edge = edge
        self.children: dict[int, TrieNode[V]] = {}
        self.parent = parent
        self.value: V | None = None
        self.stamp = 0
        self.best: TrieNode[V] | None = None

    def key(self) -> tuple[int, ...]:
        """The full key ending at this node. O(len(key) + depth)."""
        parts: list[TokenArray] = []
        node: TrieNode[V] | None = self
        while node is not None:
            parts.append(node.edge)
            node = node.parent
        parts.reverse()
        return tuple(np.concatenate(parts).tolist())


_Node = TrieNode  # private alias: code importing the old internal name keeps working


def _merge_with_child(node: TrieNode[V]) -> None:
    """Replace the non-root, non-terminal ``node`` by its only child, joining their edges. O(edges)."""
    parent = node.parent
    assert parent is not None and node.stamp == 0 and len(node.children) == 1
    (child,) = node.children.values()
    child.edge = _readonly(np.concatenate((node.edge, child.edge)))
    child.parent = parent
    parent.children[int(node.edge[0])] = child
    node.children = {}
    node.parent = None
    node.best = None


def _subtree_best(node: TrieNode[V]) -> TrieNode[V] | None:
    """The MRU terminal node of ``node``'s subtree, from its own stamp and its children's. O(children)."""
    best = node if node.stamp else None
    stamp = node.stamp
    for child in node.children.values():
        candidate = child.best
        if candidate is not None and candidate.stamp > stamp:
            best, stamp = candidate, candidate.stamp
    return best


@dataclass(frozen=True, slots=True)
class Match(Generic[V]):
    """The result of a prefix lookup.

    Attributes:
        value: The value stored under the matched key.
        common: Length of the common prefix of the matched key and the query.
        node: The terminal node of the matched key (for :meth:`RadixIndex.touch_match`).
    """

    value: V
    common: int
    node: TrieNode[V]

    @property
    def key(self) -> tuple[int, ...]:
        """The stored key that matched, rebuilt from the tree: O(len(key)), so only on demand."""
        return self.node.key()


class RadixIndex(Generic[V]):
    """A compressed radix tree mapping token sequences to values, with prefix lookups and recency.

    Keys are sequences of token ids in ``[0, 2**31)`` (anything :func:`as_token_array` accepts, including
    the empty sequence); they are copied in, so callers may reuse their buffers. Every stored key has a
    recency: :meth:`insert` and :meth:`touch` make it the most recently used (MRU), while lookups leave it
    alone. Recency only breaks ties in :meth:`longest_common_prefix`.

    Every node records the MRU terminal entry of its subtree, kept up to date on insert/touch (O(depth)) and
    on remove (recomputed from the children along the path), so no lookup ever scans a subtree.

    Complexity, for a key or query of K tokens and D nodes on its path (D <= K + 1): lookups are O(K) in
    total (one dict probe per node, one vectorised compare per edge) plus O(len(result key)) to build a
    :class:`Match`; :meth:`insert` is O(K + L) where L is the length of an edge it splits; :meth:`touch` is
    O(K); :meth:`remove` is O(K + L + C) where L is the length of an edge it merges and C the number of
    children of the nodes whose MRU entry must be recomputed. None of them depends on the number of keys.

    Not thread-safe: callers that share an index between threads must serialise every call (including
    lookups and iteration) with their own lock.
    """

    __slots__ = ("_root", "_len", "_clock", "_version")

    def __init__(self) -> None:
        """Create an empty index."""
        self._root: TrieNode[V] = TrieNode(_EMPTY, None)
        self._len = 0
        self._clock = 0  # recency stamps: strictly increasing per instance
        self._version = 0  # bumped by every change to the set of keys; guards iteration

    def __len__(self) -> int:
        """Number of stored keys. O(1)."""
        return self._len

    def __repr__(self) -> str:
        return f"{type(self).__name__}(<{self._len} keys>)"

    # ------------------------------------------------------------------------------------------ lookups

    def _find(self, query: TokenArray) -> TrieNode[V] | None:
        """The node at which ``query`` ends exactly, terminal or not, or None. O(K)."""
        node = self._root
        pos = 0
        n = len(query)
        while pos < n:
            child = node.children.get(int(query[pos]))
            if child is None:
                return None
            length = len(child.edge)
            if length > n - pos or (length > 1 and _matched(child.edge, query, pos) < length):
                return None
            pos += length
            node = child
        return node

    def __contains__(self, key: Tokens) -> bool:
        """Whether exactly ``key`` is stored. O(K); does not touch recency.

        Raises:
            TypeError, ValueError: ``key`` is not a valid token sequence (see :func:`as_token_array`).
        """
        node = self._find(as_token_array(key))
        return node is not None and node.stamp > 0

    def get(self, key: Tokens) -> V | None:
        """The value stored under exactly ``key``, or None if absent. O(K); does not touch recency.

        Raises:
            TypeError, ValueError: ``key`` is not a valid token sequence (see :func:`as_token_array`).
        """
        node = self._find(as_token_array(key))
        if node is None or node.stamp == 0:
            return None
        return node.value

    def longest_prefix(self, query: Tokens) -> Match[V] | None:
        """The longest stored key that is a prefix of ``query`` (``query`` itself included).

        The empty key, when stored, is a prefix of every query. ``common`` equals ``len(key)``.
        O(K); does not touch recency.

        Raises:
            TypeError, ValueError: ``query`` is not a valid token sequence (see :func:`as_token_array`).
        """
        q = as_token_array(query)
        node = self._root
        found = node if node.stamp else None
        depth = 0
        pos = 0
        n = len(q)
        while pos < n:
            child = node.children.get(int(q[pos]))
            if child is None:
                break
            length = len(child.edge)
            if length > n - pos or (length > 1 and _matched(child.edge, q, pos) < length):
                break
            pos += length
            node = child
            if node.stamp:
                found, depth = node, pos
        if found is None:
            return None
        return Match(cast(V, found.value), depth, found)

    def longest_common_prefix(self, query: Tokens) -> Match[V] | None:
        """The stored key sharing the longest non-empty common prefix with ``query``.

        The key may continue past the point where it diverges from the query or past the end of the query.
        When several keys share that longest common prefix, the most recently used one (inserted or touched
        last) wins. ``common`` is the length of the shared prefix (>= 1). The empty query, or a query whose
        first token starts no stored key, gives None.

        O(K): the answer is read off the MRU pointer of the deepest
        point reached along the query path; does not touch recency.

        Raises:
            TypeError, ValueError: ``query`` is not a valid token sequence (see :func:`as_token_array`).
        """
        q = as_token_array(query)
        node = self._root
        deepest: TrieNode[V] | None = None
        pos = 0
        n = len(q)
        while pos < n:
            child = node.children.get(int(q[pos]))
            if child is None:
                break
            matched = _matched(child.edge, q, pos)
            pos += matched
            deepest = child  # every key below `child` shares exactly `pos` tokens unless we go deeper
            if matched < len(child.edge):
                break
            node = child
        if deepest is None:
            return None
        best = deepest.best
        assert best is not None  # a non-root subtree always holds a key
        return Match(cast(V, best.value), pos, best)

    # ---------------------------------------------------------------------------------------- mutations

    def _mark_used(self, node: TrieNode[V]) -> None:
        """Give the terminal ``node`` a fresh stamp and make it the MRU entry of its ancestors. O(depth)."""
        self._clock += 1
        node.stamp = self._clock
        walk: TrieNode[V] | None = node
        while walk is not None:  # no early exit: being MRU low down says nothing about higher up
            walk.best = node
            walk = walk.parent

    def insert(self, key: Tokens, value: V) -> V | None:
        """Store ``value`` under ``key``, replacing any previous value, and mark ``key`` most recently used.

        O(K + L), L being the length of the edge split when ``key`` diverges inside one. Copies the tokens:
        the caller's buffer is not retained.

        Args:
            key: The token sequence (may be empty).
            value: The value to store.

        Returns:
            The value previously stored under ``key``, or None if it was absent.

        Raises:
            TypeError, ValueError: ``key`` is not a valid token sequence (see :func:`as_token_array`).
        """
        q = as_token_array(key)
        node = self._root
        pos = 0
        n = len(q)
        while pos < n:
            first = int(q[pos])
            child = node.children.get(first)
            if child is None:
                leaf: TrieNode[V] = TrieNode(_readonly(q[pos:].copy()), node)
                node.children[first] = leaf
                node = leaf
                break
            edge = child.edge
            matched = _matched(edge, q, pos)
            if matched < len(edge):
                # Split `child`'s edge: a new node takes the shared head, `child` keeps the tail.
                mid: TrieNode[V] = TrieNode(_readonly(edge[:matched].copy()), node)
                child.edge = _readonly(edge[matched:].copy())
                child.parent = mid
                mid.children[int(child.edge[0])] = child
                mid.best = child.best
                node.children[first] = mid
                node = mid
                pos += matched
                if pos < n:
                    leaf = TrieNode(_readonly(q[pos:].copy()), mid)
                    mid.children[int(q[pos])] = leaf
                    node = leaf
                break
            node = child
            pos += matched
        if node.stamp:
            old = node.value
        else:
            old = None
            self._len += 1
            self._version += 1
        node.value = value
        self._mark_used(node)
        return old

    def _terminal(self, key: Tokens) -> TrieNode[V]:
        """The node where the stored ``key`` ends. O(K). Raises KeyError when ``key`` is not stored."""
        q = as_token_array(key)
        node = self._find(q)
        if node is None or node.stamp == 0:
            raise KeyError(tuple(q.tolist()))
        return node

    def touch(self, key: Tokens) -> None:
        """Mark ``key`` as the most recently used key. O(K).

        Raises:
            KeyError: ``key`` is not stored.
            TypeError, ValueError: ``key`` is not a valid token sequence (see :func:`as_token_array`).
        """
        self._mark_used(self._terminal(key))

    def touch_match(self, match: Match[V]) -> None:
        """Mark the key of ``match`` as the most recently used, without walking the key again. O(depth).

        ``match`` must come from this index, with no removal or insertion since (which may reshape nodes).
        """
        self._mark_used(match.node)

    def remove(self, key: Tokens) -> V:
        """Remove ``key`` and return its value, restoring the tree's compressed shape.

        A node left non-terminal with a single child is merged with it; a node left non-terminal without
        children is pruned (and its parent merged, if that leaves the parent with a single child). The MRU
        pointers of the ancestors that pointed at ``key`` are recomputed from their children.
        O(K + L + C): see the class docstring.

        Raises:
            KeyError: ``key`` is not stored.
            TypeError, ValueError: ``key`` is not a valid token sequence (see :func:`as_token_array`).
        """
        node = self._terminal(key)
        value = cast(V, node.value)
        node.value = None
        node.stamp = 0
        self._len -= 1
        self._version += 1

        parent = node.parent
        start: TrieNode[V] | None = node  # lowest node whose subtree lost the key
        if parent is not None:  # the root is never pruned or merged
            if not node.children:
                del parent.children[int(node.edge[0])]
                node.parent = None
                node.best = None
                start = parent
                if parent.parent is not None and parent.stamp == 0 and len(parent.children) == 1:
                    start = parent.parent
                    _merge_with_child(parent)
            elif len(node.children) == 1:
                start = parent
                _merge_with_child(node)
        while start is not None and start.best is node:
            start.best = _subtree_best(start)
            start = start.parent
        return value

    def clear(self) -> None:
        """Remove every key. O(1) here; the old nodes are freed by the garbage collector."""
        self._root = TrieNode(_EMPTY, None)
        self._len = 0
        self._version += 1

    # ------------------------------------------------------------------------------------ introspection

    def items(self) -> Iterator[tuple[tuple[int, ...], V]]:
        """Iterate over ``(key, value)`` pairs in lexicographic key order. Does not touch recency.

        O(total size of the tree) for a full iteration; lazy. The index must not be changed while an
        iterator is live: the next step then raises RuntimeError (like a dict). ``touch`` is allowed.
        """
        version = self._version
        stack: list[tuple[TrieNode[V], tuple[int, ...]]] = [(self._root, ())]
        while stack:
            node, key = stack.pop()
            if node.stamp:
                yield key, cast(V, node.value)
                if self._version != version:
                    raise RuntimeError("RadixIndex changed during iteration")
            children = node.children
            for first in sorted(children, reverse=True):
                child = children[first]
                stack.append((child, key + tuple(child.edge.tolist())))

    def nbytes(self) -> int:
        """An estimate of the memory held by the index itself, in bytes, excluding the stored values.

        Counts, with ``sys.getsizeof``, the index object, every node object, every node's child dict and
        the int keys in it, and every edge array (header plus token data, 4 bytes a token). O(number of
        nodes); no side effects.
        """
        total = sys.getsizeof(self)
        stack = [self._root]
        while stack:
            node = stack.pop()
            edge = node.edge
            total += sys.getsizeof(node) + sys.getsizeof(node.children) + sys.getsizeof(edge)
            if edge.base is not None:  # a view: getsizeof counted only its header
                total += edge.nbytes
            for first, child in node.children.items():
                total += sys.getsizeof(first)
                stack.append(child)
        return total
