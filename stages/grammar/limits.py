"""Bounds on what reaches the native grammar compilers: a constraint over one is a 400 naming its
field and the limit, before xgrammar or llguidance sees it.

Both compilers run native code in our process. Unbounded, a 3,000-link ``$ref`` chain overflowed
llguidance's stack (the process died), 50,000 chained EBNF rules took 29 s and 9.5 GB, and a
100,000-entry choice panicked inside llguidance. Each bound below was chosen by measuring compile
time and memory with both backends at several sizes: within them a compile takes seconds at most
and tens of MB.

The walks are iterative: a hostile schema cannot raise ``RecursionError`` here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pipeline.errors import GrammarError
from pipeline.types import GrammarSpec
from stages.grammar.schema_walk import SchemaWalk

__all__ = ["GrammarLimits", "check_limits", "check_size"]

# a rule definition: xgrammar's EBNF (``name ::=``) or Lark's (``name:`` / ``?name:`` at a line start)
_LARK_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(?:\{[^}\n]*\})?[ \t]*:(?!:)", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """What one constraint may hold; each bound is a 400 beyond it (``PipelineConfig.grammar_*``)."""

    # Past each bound, compile time grows faster than the input (measured with both backends at
    # several sizes); the figures here are the ones that do not depend on the machine's load.
    # Characters of the spec's canonical JSON; the largest dev-corpus schema has 145,131.
    max_bytes: int = 256 * 1024
    # Objects and arrays in a schema (properties, subschemas, values): 5,000 properties stay in it.
    max_schema_nodes: int = 10_000
    # Nesting levels of a schema, each $ref followed counting one more: llguidance refuses JSON
    # nested deeper than 128 anyway, and its compile used about 3.2 KB of native stack a $ref.
    max_schema_depth: int = 128
    # Entries of one enum or choice list: a 100,000-entry choice panicked inside llguidance.
    max_enum_values: int = 10_000
    # One const, enum value, choice or property name: xgrammar's grammar for a 16 KB const holds
    # 3.3 MB, for a 256 KB one 53 MB.
    max_literal_bytes: int = 16 * 1024
    # Rules of one EBNF or Lark grammar: chained rules peaked at 770 MB in xgrammar at 20,000, and
    # overflowed an 8 MB stack in llguidance at 3,000.
    max_grammar_rules: int = 1_000
    max_regex_bytes: int = 16 * 1024  # one regex or pattern
    # Groups nested in a grammar or regex: xgrammar refuses more than about 1,000 itself.
    max_nesting: int = 200

    def __post_init__(self) -> None:
        for name in self.__slots__:
            if getattr(self, name) <= 0:
                raise ValueError(f"GrammarLimits.{name} must be positive")


def _refuse(spec: GrammarSpec, what: str, limit: str, where: str = "") -> GrammarError:
    field = f"{spec.field}{where}" if where else spec.field
    return GrammarError(f"the {spec.kind.replace('_', ' ')} is too large: {what} (the limit is {limit})", field=field)


def check_size(spec: GrammarSpec, key: str, limits: GrammarLimits) -> None:
    """Refuse ``spec`` when its canonical JSON (``key``, its cache key) is over ``limits.max_bytes``
    characters: O(1), so the event loop can afford it before anything walks the spec.

    :raises GrammarError: (400) naming the field, the size and the limit.
    """
    size = len(key) - len(f"{spec.kind}:{int(spec.strict)}:")
    if size > limits.max_bytes:
        raise _refuse(spec, f"{size:,} characters of JSON", f"{limits.max_bytes:,}")


def check_limits(spec: GrammarSpec, limits: GrammarLimits) -> None:
    """Refuse ``spec`` when its contents exceed one of ``limits`` (a walk over the spec: run it off
    the event loop; ``check_size`` is the part the loop runs).

    :raises GrammarError: (400) naming the field, what was over and the limit.
    """
    if spec.kind == "json_schema":
        _check_schema(spec, spec.value, limits, "")
    elif spec.kind == "choice":
        _check_literals(spec, spec.value, limits, "", "choice")
    elif spec.kind == "regex":
        _check_regex(spec, spec.value, limits, "")
    elif spec.kind == "grammar":
        _check_grammar(spec, spec.value, limits, "")
    elif spec.kind == "structural_tag":
        _check_structural_tag(spec, spec.value, limits)


def _check_literals(spec: GrammarSpec, values: list[Any], limits: GrammarLimits, where: str, what: str) -> None:
    if len(values) > limits.max_enum_values:
        raise _refuse(spec, f"{len(values):,} {what} entries", f"{limits.max_enum_values:,}", where)
    for value in values:
        _check_literal(spec, value, limits, where, f"{what} entry")


def _check_literal(spec: GrammarSpec, value: Any, limits: GrammarLimits, where: str, what: str) -> None:
    size = len(value.encode()) if isinstance(value, str) else len(json.dumps(value, separators=(",", ":")))
    if size > limits.max_literal_bytes:
        raise _refuse(spec, f"a {what} of {size:,} bytes", f"{limits.max_literal_bytes:,} bytes", where)


def _check_regex(spec: GrammarSpec, pattern: str, limits: GrammarLimits, where: str) -> None:
    size = len(pattern.encode())
    if size > limits.max_regex_bytes:
        raise _refuse(spec, f"a regex of {size:,} bytes", f"{limits.max_regex_bytes:,} bytes", where)
    _check_nesting(spec, pattern, limits, where, dialect="regex")


def _check_grammar(spec: GrammarSpec, grammar: str, limits: GrammarLimits, where: str) -> None:
    ebnf_rules = grammar.count("::=")
    rules = ebnf_rules or len(_LARK_RULE.findall(grammar))
    if rules > limits.max_grammar_rules:
        raise _refuse(spec, f"{rules:,} rules", f"{limits.max_grammar_rules:,}", where)
    _check_nesting(spec, grammar, limits, where, dialect="ebnf" if ebnf_rules else "lark")


def _check_nesting(spec: GrammarSpec, text: str, limits: GrammarLimits, where: str, *, dialect: str) -> None:
    """Groups nested deeper than the limit. Escapes and literals hold none: a regex's and EBNF's
    ``[...]`` is a character class, Lark's an optional group; quotes (and Lark's ``/.../``) delimit
    a grammar's literals."""
    quotes = {"regex": "", "ebnf": "\"'", "lark": "\"'/"}[dialect]
    openers, closers = ("([", ")]") if dialect == "lark" else ("(", ")")
    depth = deepest = i = 0
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 1
        elif char == "[" and dialect != "lark":
            i = _closing(text, i + 1, "]")
        elif char in quotes:
            i = _closing(text, i + 1, char)
        elif char in openers:
            depth += 1
            deepest = max(deepest, depth)
        elif char in closers:
            depth = max(0, depth - 1)
        i += 1
    if deepest > limits.max_nesting:
        raise _refuse(spec, f"groups nested {deepest:,} deep", f"{limits.max_nesting:,}", where)


def _closing(text: str, i: int, end: str) -> int:
    """The index of the first unescaped ``end`` from ``i`` (the text's end if none)."""
    while i < len(text) and text[i] != end:
        i += 2 if text[i] == "\\" else 1
    return i


def _check_structural_tag(spec: GrammarSpec, tag: Any, limits: GrammarLimits) -> None:
    """Each schema, regex and grammar inside a structural tag, bounded as if it came alone."""
    for where, node in _formats(tag, ""):
        kind = node.get("type")
        if kind in ("json_schema", "qwen_xml_parameter"):
            _check_schema(spec, node.get("json_schema"), limits, f"{where}.json_schema")
        elif kind == "regex" and isinstance(node.get("pattern"), str):
            _check_regex(spec, node["pattern"], limits, f"{where}.pattern")
        elif kind == "grammar" and isinstance(node.get("grammar"), str):
            _check_grammar(spec, node["grammar"], limits, f"{where}.grammar")


def _formats(node: Any, where: str) -> Iterator[tuple[str, dict[str, Any]]]:
    stack = [(where, node)]
    while stack:
        at, item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("type"), str):
                yield at, item
            stack.extend((f"{at}.{key}", value) for key, value in item.items() if key != "json_schema")
        elif isinstance(item, list):
            stack.extend((f"{at}[{i}]", value) for i, value in enumerate(item))


def _check_schema(spec: GrammarSpec, schema: Any, limits: GrammarLimits, where: str) -> None:
    """Nodes, depth through ``$ref`` chains, enums and literals of one schema."""
    walk = SchemaWalk(schema)
    for node in walk.nodes(limits.max_schema_nodes):
        if isinstance(node, dict):
            _check_keywords(spec, node, limits, where)
    if walk.num_nodes > limits.max_schema_nodes:
        limit = f"{limits.max_schema_nodes:,}"
        raise _refuse(spec, f"more than {limit} objects and arrays", limit, where)
    depth = walk.depth(limits.max_schema_depth)
    if depth > limits.max_schema_depth:
        raise _refuse(
            spec,
            f"it nests more than {limits.max_schema_depth:,} levels deep (each $ref it follows counts as a level)",
            f"{limits.max_schema_depth:,} levels",
            where,
        )


def _check_keywords(spec: GrammarSpec, node: dict[str, Any], limits: GrammarLimits, where: str) -> None:
    enum = node.get("enum")
    if isinstance(enum, list):
        _check_literals(spec, enum, limits, where, "enum")
    if "const" in node:
        _check_literal(spec, node["const"], limits, where, "const")
    for key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
        names = node.get(key)
        if isinstance(names, dict):
            for name in names:
                _check_literal(spec, name, limits, where, "property name")
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        _check_regex(spec, pattern, limits, where)
    patterns = node.get("patternProperties")
    if isinstance(patterns, dict):
        for pattern in patterns:
            _check_regex(spec, pattern, limits, where)
