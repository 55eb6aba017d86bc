"""The parts of structured outputs' refusals that need no model: reading a schema by pointer, which schemas
and grammars can end, GBNF converted with its rules' lines, llguidance's text cleaned, and what each costs
on hostile input. The messages a live server sends are tested in ``test_serve_constraints.py``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from llguidance.gbnf_to_lark import gbnf_to_lark

from llama_cache.server.ending import EndingGraph
from llama_cache.server.grammar_refusals import GbnfGrammar
from llama_cache.server.refusals import ConstraintError, clean, is_limit
from llama_cache.server.schema_ending import unending
from llama_cache.server.schema_nodes import SchemaIndex, pointer_text
from llama_cache.server.schema_refusals import describe


def test_the_ending_graph_is_the_least_fixpoint_and_its_witness_a_loop_or_a_dead_end() -> None:
    graph = EndingGraph()
    leaf, loop, either, both, dead = (graph.add(kind) for kind in ("all", "all", "any", "all", "any"))
    graph.link(loop, "self", loop)
    graph.link(either, "loop", loop)
    graph.link(either, "leaf", leaf)
    graph.link(both, "leaf", leaf)
    graph.link(both, "loop", loop)
    assert graph.ending() == [True, False, True, False, False]
    ends = graph.ending()
    steps, start = graph.witness(both, ends)
    assert [(step.source, step.label, step.target) for step in steps] == [(both, "loop", loop), (loop, "self", loop)]
    assert start == 1  # the loop starts at the second step
    assert graph.witness(dead, ends) == ([], None)


def test_the_index_names_subschemas_by_pointer_and_resolves_local_references() -> None:
    schema = {"$defs": {"a/b": {"type": "string"}, "c d": {"$anchor": "cd", "type": "integer"},
                        "unused": {"not": {}}},
              "type": "object",
              "properties": {"x": {"$ref": "#/$defs/a~1b"}, "y": {"$ref": "#/$defs/c%20d"}, "z": {"$ref": "#cd"},
                             "w": {"$id": "urn:example:w", "$defs": {"n": {"type": "null"}}, "$ref": "#/$defs/n"},
                             "v": {"$ref": "urn:example:w"}, "u": {"$ref": "https://example.com/other.json"}},
              "items": 5}
    index = SchemaIndex.of(schema)
    assert index.resolve(("properties", "x"), "#/$defs/a~1b") == ("$defs", "a/b")
    assert index.resolve(("properties", "y"), "#/$defs/c%20d") == ("$defs", "c d")
    assert index.resolve(("properties", "z"), "#cd") == ("$defs", "c d")
    assert index.resolve(("properties", "w"), "#/$defs/n") == ("properties", "w", "$defs", "n")  # its own $id
    assert index.resolve(("properties", "v"), "urn:example:w") == ("properties", "w")
    assert index.resolve(("properties", "u"), "https://example.com/other.json") is None
    assert index.resolve((), "#/properties/missing") is None
    assert index.malformed == [("items",)]
    reached = list(index.reachable())
    assert reached[0] == () and ("$defs", "a/b") in reached and ("$defs", "unused") not in reached
    assert pointer_text(("$defs", "a/b", "~x")) == "#/$defs/a~1b/~0x"


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"next": {"$ref": "#"}}},  # a linked list, optional next
    {"anyOf": [{"type": "null"}, {"type": "array", "items": {"$ref": "#"}, "minItems": 1}]},
    {"type": "array", "items": {"$ref": "#"}},  # [] ends it
    {"properties": {"a": {"$ref": "#"}}, "required": ["a"]},  # no "type": any value that is no object ends it
    {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"$defs": {"loop": {"$ref": "#/$defs/loop"}}, "type": "string"},  # an unused loop
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]},  # llguidance's to refuse
])
def test_schemas_that_can_end_are_not_refused(schema: dict[str, Any]) -> None:
    assert unending(SchemaIndex.of(schema)) is None


def test_schemas_that_cannot_end_are_told_with_the_loop() -> None:
    assert unending(SchemaIndex.of({"$ref": "#"})) == ((), 'refers to itself with no way to end ("$ref": "#" at the root)')
    pointer, reason = unending(SchemaIndex.of(
        {"type": "array", "minItems": 2, "prefixItems": [{"type": "string"}], "items": {"$ref": "#"}})) or ((), "")
    assert pointer == () and 'its items ("items", with "minItems": 2) at the root' in reason
    pointer, reason = unending(SchemaIndex.of({"$ref": "#/$defs/f", "$defs": {"f": False}})) or ((), "")
    assert "is false" in reason and "'#/$defs/f'" in reason


def test_llguidance_text_is_cleaned_of_tags_excerpts_and_length() -> None:
    assert clean("NoExtensionBias\n<non-verbose/>") == "NoExtensionBias"
    assert clean("bad\n<state>\nTokens: x\n</state><grammar>{}</grammar>") == "bad"
    assert clean('at 3(8): oops\n   1 | %llguidance {}\n   3 | start: "a"\n              ^\n') == "at 3(8): oops"
    assert len(clean("x" * 10_000)) == 300
    assert is_limit("grammar size (number of symbols) too big (limit for this grammar: 50)")
    assert not is_limit("Unsatisfiable schema: minLength (5) is greater than maxLength (1)")


def test_an_unknown_llguidance_message_is_shown_cleaned_without_a_place() -> None:
    index = SchemaIndex.of({"type": "string"})
    assert describe(index, "Something new\n<non-verbose/>") == (None, "cannot be enforced: Something new")
    assert describe(index, "NoExtensionBias\n<non-verbose/>")[1].startswith("allows no value")


@pytest.mark.parametrize("text", [
    'root ::= answer "."\nanswer ::= "yes" | "no"',
    '# a comment\nroot ::= item+ ws\nitem ::= "a" | [b-d] item\nws ::= [ \\t\\n]*\n',
    'root ::= (x | y)* "z"{2,3}\nx ::= "x"\ny ::= ("y" | x)? "."\n',
    'root ::= camelCase\ncamelCase ::= "c" | "d" camelCase',
])
def test_the_lark_text_is_what_gbnf_to_lark_prints(text: str) -> None:
    assert GbnfGrammar.convert(text).lark == gbnf_to_lark(text)


def test_a_gbnf_error_names_the_line_column_and_rule() -> None:
    with pytest.raises(ConstraintError) as raised:
        GbnfGrammar.convert('root ::= a\na ::= "x" (')
    assert str(raised.value).startswith("the grammar at line 2, column 12 (in rule 'a'): expected ')'")
    grammar = GbnfGrammar.convert('root ::= a\na ::= "x" [z-a]')
    message = grammar.describe('at 4(3): invalid regex "[z-a]" (in regex): regex parse error:\n    [z-a]\n     ^^^\n'
                               'error: invalid character class range, the start must be <= the end\n   4 | A: "x" /[z-a]/\n')
    assert message.startswith("rule 'a' (line 2): the character class [z-a] is not valid: invalid character class")


def _timed(work: Any) -> float:
    started = time.monotonic()
    work()
    return time.monotonic() - started


def test_hostile_schemas_cost_linear_work() -> None:
    # 64 KiB of schema (the server's limit) as a loop of 1,500 definitions, each requiring the next.
    defs = {f"d{i}": {"type": "object", "properties": {"n": {"$ref": f"#/$defs/d{(i + 1) % 1500}"}}, "required": ["n"]}
            for i in range(1500)}
    loop = {"$defs": defs, "$ref": "#/$defs/d0"}
    assert _timed(lambda: unending(SchemaIndex.of(loop))) < 2
    pointer, reason = unending(SchemaIndex.of(loop)) or ((), "")
    assert pointer == ("$defs", "d0") and "2993 more steps" in reason and len(reason) < 1000
    # Wide: 4,000 properties, and a refusal looked for among them.
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer", "minimum": 0} for i in range(4000)}}
    wide["properties"]["p3999"] = {"not": {}}
    assert _timed(lambda: describe(SchemaIndex.of(wide), 'Unimplemented keys: ["not"]')) < 2
    assert describe(SchemaIndex.of(wide), 'Unimplemented keys: ["not"]')[0] == ("properties", "p3999")
    # Deep: the walks are iterative, whatever the depth.
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(5000):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    assert unending(SchemaIndex.of(deep)) is None


def test_hostile_grammars_cost_linear_work_past_the_conversion() -> None:
    chain = "\n".join(f'r{i} ::= "a" r{i + 1}' for i in range(127)) + '\nr127 ::= "b" r0\nroot ::= r0'
    grammar = GbnfGrammar.convert(chain)
    assert _timed(grammar.unending) < 1
    message = grammar.unending() or ""
    assert "refers to itself with no way to end" in message and "(122 more)" in message and len(message) < 400
