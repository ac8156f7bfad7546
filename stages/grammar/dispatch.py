"""Which grammar backend compiles a constraint: a small table of schema features, each row backed by
a test (``tests/stages/test_grammar_dispatch.py``) that shows the failure it avoids.

xgrammar (0.2.8) is the default: its masks are fast and its JSON is what the engine was tuned on.
llguidance takes what xgrammar enforces wrongly or compiles slowly: it compiled the dev corpus's
schemas in milliseconds (xgrammar: p90 over a second, worst tens of seconds) and in strict mode it
refuses what it cannot enforce instead of ignoring it. Whatever either backend lets through, the
answer check (``stages/grammar/answer_check.py``) still catches; the dispatch only makes that rarer.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pipeline.types import GrammarSpec
from stages.grammar.schema_walk import SchemaWalk

__all__ = [
    "LLGUIDANCE_KINDS",
    "PARSED_KINDS",
    "ROWS",
    "Dispatch",
    "DispatchRow",
    "choose_backend",
    "is_lark",
    "schema_nodes",
]

# Constraint kinds llguidance can compile here (structural tags: those Lark says exactly).
LLGUIDANCE_KINDS = frozenset({"json_schema", "json_object", "regex", "choice", "grammar", "structural_tag"})
# Kinds in xgrammar's dialects: parsed before they wait for a compile slot (a malformed one is a 400
# at once), and an llguidance refusal of one waits for xgrammar's compile instead.
PARSED_KINDS = frozenset({"grammar", "structural_tag"})
# A schema with more nodes than this goes to llguidance: xgrammar's compile of a 5,000-property
# schema took minutes and 0.6-0.9 GB; llguidance builds its lexer lazily, in milliseconds.
MAX_XGRAMMAR_NODES = 2_000


@dataclass(frozen=True, slots=True)
class DispatchRow:
    feature: str
    matches: Callable[[dict[str, Any]], bool]  # on one subschema
    why: str  # the failure seen with xgrammar


@dataclass(frozen=True, slots=True)
class Dispatch:
    backend: str  # "xgrammar" | "llguidance"
    reason: str  # the row's feature, or "default"


def _is_string_schema(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


def _structured_literal(node: dict[str, Any]) -> bool:
    enum = node.get("enum")
    values: list[Any] = [node["const"]] if "const" in node else enum if isinstance(enum, list) else []
    return any(isinstance(v, dict | list) for v in values)


def _fractional_multiple(node: dict[str, Any]) -> bool:
    step = node.get("multipleOf")
    return isinstance(step, int | float) and not isinstance(step, bool) and float(step) != int(step)


ROWS: tuple[DispatchRow, ...] = (
    DispatchRow(
        "string pattern",
        lambda n: "pattern" in n,
        "pattern with maxLength ignores the length: '1543275' for ^[0-9]+$ with maxLength 2",
    ),
    DispatchRow(
        "bounded string",
        lambda n: _is_string_schema(n) and ("minLength" in n or "maxLength" in n),
        "xgrammar 0.2.8 lets a raw TAB into strings with minLength/maxLength (mlc-ai/xgrammar#800)",
    ),
    DispatchRow(
        "fractional multipleOf",
        _fractional_multiple,
        "multipleOf 0.5 is not enforced: 10 of 20 seeded answers invalid",
    ),
    DispatchRow(
        "const/enum holding an object or array",
        _structured_literal,
        "writes [1,2] and refuses the layout [1, 2] that its own JSON grammar writes elsewhere",
    ),
    DispatchRow(
        "array bounds without items",
        lambda n: ("minItems" in n or "maxItems" in n) and "items" not in n and "prefixItems" not in n,
        "allows only [] (or fails to compile: minItems greater than prefixItems)",
    ),
    DispatchRow(
        "patternProperties",
        lambda n: "patternProperties" in n,
        "patternProperties with minProperties writes duplicate keys",
    ),
    DispatchRow(
        "format",
        lambda n: isinstance(n.get("format"), str),
        "format ipv4 with leading zeros, format date writing 0053-02-30",
    ),
    DispatchRow(
        "anyOf beside other keywords",
        lambda n: "anyOf" in n and bool({"type", "properties", "required", "items"} & n.keys()),
        "type object beside an anyOf of required-only branches was answered with a string (corpus: "
        "JsonSchemaStore resolutions-schema): xgrammar drops the sibling keywords",
    ),
    DispatchRow(
        "oneOf/allOf",
        lambda n: "oneOf" in n or "allOf" in n,
        "a root $ref to a oneOf of allOf branches that each require an object was answered `true`",
    ),
)


def _subschemas(node: Any) -> Iterator[dict[str, Any]]:
    """Every object (dict) in the schema, depth first: the keyword values that are schemas, and
    any other objects (a ``properties`` map, an object inside an ``enum``); arrays are walked
    through, not yielded. A row matching a non-schema object only costs a backend choice, never
    correctness."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def schema_nodes(schema: Any) -> int:
    """The number of objects and arrays in ``schema``, counted as the admission limit counts them
    (``grammar_max_schema_nodes``, stages/grammar/limits.py): the estimate of its compile cost."""
    walk = SchemaWalk(schema)
    for _ in walk.nodes(sys.maxsize):
        pass
    return walk.num_nodes


def is_lark(grammar: Any) -> bool:
    """Whether a grammar's text is Lark (vLLM's ``guided_grammar`` takes it), not EBNF: EBNF rules are
    written ``name ::= ...`` (vLLM tells them apart the same way)."""
    return isinstance(grammar, str) and "::=" not in grammar


def choose_backend(spec: GrammarSpec) -> Dispatch:
    """The backend for ``spec`` by its features (the first matching row wins)."""
    if spec.kind not in LLGUIDANCE_KINDS:
        return Dispatch("xgrammar", f"{spec.kind} (xgrammar only)")
    if spec.kind != "json_schema" or not isinstance(spec.value, dict):
        return Dispatch("xgrammar", "default")
    if schema_nodes(spec.value) > MAX_XGRAMMAR_NODES:
        return Dispatch("llguidance", f"large schema (over {MAX_XGRAMMAR_NODES} nodes)")
    for node in _subschemas(spec.value):
        for row in ROWS:
            if row.matches(node):
                return Dispatch("llguidance", row.feature)
    return Dispatch("xgrammar", "default")
