"""GBNF grammars converted for llguidance, with refusals that name the rule and line at fault.

llguidance reads Lark, not llama.cpp's GBNF: its converter (``llguidance.gbnf_to_lark``) parses the
GBNF, resolves rule names (``root`` becomes ``start``, ``a-b`` becomes ``a_b``) and prints Lark. Its
errors quote a GBNF position as a Python repr (``Expected ')' at line 1, 'root ::= (' ^ ''``), and
llguidance's own errors on the Lark text point into that text, whose lines and rule names are not the
client's. :class:`GbnfGrammar` runs the converter's steps itself (its parser, ``resolve``, and the few
lines that print the rules: llguidance is pinned, and a test checks the printing against
``gbnf_to_lark``), keeping where each rule was defined, so that every refusal names a GBNF rule and
line, and checks that the ``root`` rule can end (:mod:`.ending`).

Cost: the converter's (its ``resolve`` is quadratic in the rules, bounded by the server's
``max_grammar_rules``) plus linear work over the rules read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from llguidance.gbnf_to_lark import (
    AlternativeNode,
    ASTNode,
    GbnfToLarkError,
    GrammarParser,
    Position,
    RepetitionNode,
    RuleNode,
    RuleRefNode,
    SequenceNode,
    resolve,
)

from llama_cache.server.ending import EndingGraph
from llama_cache.server.refusals import MAX_RAW_CHARS, ConstraintError, clean, short

__all__ = ["GbnfGrammar"]

_SHOWN_RULES = 8  # of a loop told in a message
_LARK_ERROR = re.compile(r"^at (\d+)\(\d+\): (.*)", re.S)
_REGEX_ERROR = re.compile(r"regex parse error:\n {4}(.*)\n *\^+ *\nerror: (.*)")
_BAD_RANGE = re.compile(r"range end must be >= start, got \((\d+), (\d+)\)")
_PARSE_REASONS = {
    "Expected ')'": "expected ')' closing a group",
    "Unexpected end of input": "the text ends inside a string or character class (a closing '\"' or ']' is missing)",
    "Expected ::=": "expected '::=' after a rule name",
    "Expected name": "expected a rule name",
    "Expected integer": "expected a number in a repetition {m,n}",
}


@dataclass
class GbnfGrammar:
    """A GBNF grammar as llguidance's Lark, and where each of its rules came from.

    Made by :meth:`convert`. ``lark`` is the text to compile (``LLMatcher.grammar_from_lark``).
    """

    text: str
    lark: str = ""
    rules: dict[str, RuleNode] = field(default_factory=dict)
    _names: dict[int, str] = field(default_factory=dict)
    _lines: dict[int, int] = field(default_factory=dict)
    _lark_rows: list[tuple[int, RuleNode]] = field(default_factory=list)

    @classmethod
    def convert(cls, text: str) -> GbnfGrammar:
        """Parse and convert ``text`` (GBNF, rule ``root`` the start).

        Raises:
            ConstraintError: it does not parse, refers to a rule it does not define, defines no ``root``,
                or two of its rule names become one in Lark; the message names the line and rule.
        """
        grammar = cls(text)
        parser = _Parser()
        try:
            parsed = parser.parse(text)
        except GbnfToLarkError as error:
            raise ConstraintError(grammar._parse_error(error, parser.starts)) from None
        except RecursionError:
            raise ConstraintError("the grammar nests groups too deeply to be read") from None
        for name, rule in parsed.items():
            grammar._names[id(rule)] = name
            grammar._lines[id(rule)] = parser.lines[id(rule)]
        try:
            resolve(parsed)
        except RecursionError:
            raise ConstraintError("the grammar nests groups too deeply to be read") from None
        except Exception as error:  # noqa: BLE001 - resolve raises plain Exception
            raise ConstraintError(grammar._resolve_error(str(error), parsed)) from None
        grammar.rules = parsed
        try:
            grammar._print()
        except RecursionError:
            raise ConstraintError("the grammar nests groups too deeply to be read") from None
        return grammar

    def _print(self) -> None:
        # gbnf_to_lark's printing, keeping the Lark line each rule starts on.
        out = ["%llguidance {}\n\n"]
        line, after_block = 3, True
        for rule in sorted(self.rules.values(), key=lambda r: r.order):
            text = str(rule)
            if not after_block and "\n" in text:
                out.append("\n")
                line += 1
            self._lark_rows.append((line, rule))
            out.append(text + "\n")
            line += text.count("\n") + 1
            after_block = "\n" in text
            if after_block:
                out.append("\n")
                line += 1
        self.lark = "".join(out)

    def rule_name(self, rule: RuleNode) -> str:
        """How the client's grammar names ``rule``: ``rule 'root' (line 1)``."""
        return f"rule '{self._names.get(id(rule), rule.name)}' (line {self._lines.get(id(rule), '?')})"

    def describe(self, raw: str) -> str:
        """The message for llguidance's refusal ``raw`` of :attr:`lark`: the GBNF rule it is about, and why."""
        raw = raw[:MAX_RAW_CHARS]
        if raw.startswith("NoExtensionBias"):
            return "the grammar matches no text: llguidance finds no token it could start with"
        match = _LARK_ERROR.match(raw)
        if match is None:
            return f"the grammar cannot be enforced: {clean(raw)}"
        row, detail = int(match.group(1)), match.group(2)
        rule = next((rule for start, rule in reversed(self._lark_rows) if start <= row), None)
        subject = self.rule_name(rule) if rule is not None else "the grammar"
        if found := _REGEX_ERROR.search(detail):
            return f"{subject}: the character class {found.group(1)} is not valid: {found.group(2).strip()}"
        if found := _BAD_RANGE.search(detail):
            return f"{subject}: the repetition {{{found.group(1)},{found.group(2)}}} has its maximum below its minimum"
        return f"{subject}: {clean(detail.split(chr(10), 1)[0])}"

    def unending(self) -> str | None:
        """Why no finite text matches the grammar (its ``root`` rule cannot end), or None if one may."""
        start = self.rules.get("start")
        if start is None:
            return None
        graph = EndingGraph()
        rule_nodes: dict[int, int] = {}
        owners: dict[int, RuleNode] = {}
        for rule in self.rules.values():
            rule_nodes[id(rule)] = graph.add("all")
            owners[rule_nodes[id(rule)]] = rule
        for rule in self.rules.values():
            body = _add_nodes(graph, rule.alternatives, rule_nodes)
            graph.link(rule_nodes[id(rule)], "", body)
        ends = graph.ending()
        if ends[rule_nodes[id(start)]]:
            return None
        steps, loop = graph.witness(rule_nodes[id(start)], ends)
        if loop is None:
            return "the grammar matches no text"
        # A loop passes through a rule (an expression alone is a tree): name the rules on it.
        cycle = [owners[step.source] for step in steps[loop:] if step.source in owners]
        names = [self._names.get(id(rule), rule.name) for rule in [*cycle, cycle[0]]]
        if len(names) > _SHOWN_RULES:
            names[_SHOWN_RULES - 2:-1] = [f"({len(names) - _SHOWN_RULES + 1} more)"]
        path = " -> ".join(names)
        again = "itself" if len(cycle) == 1 else f"'{self._names.get(id(cycle[1]), cycle[1].name)}', and so on"
        message = (f"{self.rule_name(cycle[0])} refers to itself with no way to end: every way to expand it "
                   f"needs {again} ({path}), so no finite text matches it")
        if loop:
            message += ", and rule 'root' needs it"
        return message

    def _parse_error(self, error: GbnfToLarkError, starts: list[int]) -> str:
        offset = error.pos.pos
        text = error.pos.text
        reason = str(error)
        suffix = f" at {error.pos}"
        if reason.endswith(suffix):
            reason = reason[: -len(suffix)]
        if reason == "Expected name" and text[offset:offset + 1] not in ("", "\n"):
            reason = f"unexpected {short(text[offset])} (a rule starts with its name and '::=')"
        reason = _PARSE_REASONS.get(reason, reason[:1].lower() + reason[1:])
        line = text.count("\n", 0, offset) + 1
        line_start = text.rfind("\n", 0, offset) + 1
        column = offset - line_start + 1
        rule = next((start for start in reversed(starts) if start <= offset), None)
        name = re.match(r"[\w-]*", text[rule:]).group(0) if rule is not None else ""  # type: ignore[union-attr]
        in_rule = f" (in rule '{name}')" if name else ""
        before = text[max(line_start, offset - 30): offset]
        near = f", after {json.dumps(before, ensure_ascii=False)}" if before.strip() else ""
        return f"the grammar at line {line}, column {column}{in_rule}: {reason}{near}"

    def _resolve_error(self, message: str, parsed: dict[str, RuleNode]) -> str:
        if found := re.fullmatch(r"Rule '(.*)' not found", message):
            missing = found.group(1)
            users = [rule for rule in parsed.values() if _refers_to(rule, missing)]
            subject = self.rule_name(users[0]) if users else "the grammar"
            return f"{subject} refers to {short(missing)}, which no rule defines"
        if message == "No 'root' rule found":
            if not parsed:
                return "the grammar is empty: it needs a rule 'root' (where the text starts)"
            defined = ", ".join(f"'{name}'" for name in list(parsed)[:5])
            return f"the grammar defines no rule 'root' (where the text starts); it defines {defined}"
        if found := re.fullmatch(r"Rule '(.*)' already exists", message):
            clash = found.group(1).lower()
            same = sorted((rule for rule in parsed.values()
                           if _lark_name(self._names.get(id(rule), rule.name)) == clash),
                          key=lambda rule: self._lines.get(id(rule), 0))
            named = " and ".join(self.rule_name(rule) for rule in same[:2]) or f"rule {short(clash)}"
            return (f"{named} have the same name for llguidance, which does not tell '-' from '_' nor "
                    "capitals in rule names, and calls 'root' 'start': rename one")
        return f"the grammar cannot be read: {clean(message)}"


class _Parser(GrammarParser):
    """llguidance's GBNF parser, noting where each rule starts (``starts``: offsets; ``lines``: by rule)."""

    def __init__(self) -> None:
        super().__init__()
        self.starts: list[int] = []
        self.lines: dict[int, int] = {}

    def _parse_rule(self, pos: Position) -> tuple[RuleNode, Position]:
        self.starts.append(pos.pos)
        rule, end = super()._parse_rule(pos)
        self.lines[id(rule)] = pos.text.count("\n", 0, pos.pos) + 1
        return rule, end


def _lark_name(name: str) -> str:
    """The name ``resolve`` gives a GBNF rule, lowercased (``root`` is ``start``)."""
    if name == "root":
        return "start"
    return re.sub(r"([a-z])([A-Z])", r"\1_\2", name.replace("-", "_")).lower()


def _nodes(root: ASTNode) -> list[ASTNode]:
    """Every node under ``root``, iteratively."""
    found, stack = [], [root]
    while stack:
        node = stack.pop()
        found.append(node)
        stack.extend(node.children())
    return found


def _refers_to(rule: RuleNode, name: str) -> bool:
    return any(isinstance(node, RuleRefNode) and node.name == name for node in _nodes(rule.alternatives))


def _add_nodes(graph: EndingGraph, root: ASTNode, rule_nodes: dict[int, int]) -> int:
    """``root``'s expression as graph nodes (a sequence needs all its parts, alternatives one, ``x*`` none)."""
    ids: dict[int, int] = {}
    order = _nodes(root)
    for node in order:
        ids[id(node)] = graph.add("any" if isinstance(node, AlternativeNode) else "all")
    for node in order:
        here = ids[id(node)]
        if isinstance(node, (SequenceNode, AlternativeNode)):
            for child in node.children():
                graph.link(here, "", ids[id(child)])
        elif isinstance(node, RepetitionNode) and node.min_times > 0:
            graph.link(here, "", ids[id(node.node)])
        elif isinstance(node, RuleRefNode) and node.target is not None:
            graph.link(here, "", rule_nodes[id(node.target)])
    return ids[id(root)]
