"""Bounds on what reaches the native grammar compilers: each is a 400 naming the field and the limit,
before a compiler runs; real schemas stay within them; what the bounds leave (a deep native
recursion) runs on a stack that holds it."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

from pipeline.errors import GrammarError
from pipeline.types import GrammarSpec
from sampling.guided.llguidance.matcher import INTERNAL_FAILURE
from stages.grammar import GrammarStage
from stages.grammar.backends import Compiled, clean_message
from stages.grammar.limits import GrammarLimits, check_limits, check_size
from tests.conftest import CORPUS_DIR
from tests.stages.test_grammar import GatedCompiler, make_stage

SMALL = GrammarLimits(
    max_bytes=4096,
    max_schema_nodes=50,
    max_schema_depth=12,
    max_enum_values=20,
    max_literal_bytes=64,
    max_grammar_rules=10,
    max_regex_bytes=128,
    max_nesting=8,
)


def ref_chain(n: int) -> dict[str, Any]:
    """``{"$ref": d0}``, ``d_i`` a ``$ref`` to ``d_i+1``, ``d_n`` an integer."""
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def nested_arrays(n: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(n):
        schema = {"type": "array", "items": schema}
    return schema


def chained_rules(n: int) -> str:
    return "\n".join(["root ::= r0", *(f"r{i} ::= r{i + 1}" for i in range(n)), f'r{n} ::= "x"'])


def refusal(spec: GrammarSpec, limits: GrammarLimits = SMALL) -> GrammarError:
    with pytest.raises(GrammarError) as info:
        check_size(spec, spec.key, limits)
        check_limits(spec, limits)
    return info.value


OVER = [
    ("size", GrammarSpec("json_schema", {"description": "x" * 5000}), "4,096"),
    ("nodes", GrammarSpec("json_schema", {"properties": {f"p{i}": {} for i in range(60)}}), "50"),
    ("depth", GrammarSpec("json_schema", nested_arrays(13)), "12 levels"),
    ("ref chain", GrammarSpec("json_schema", ref_chain(12)), "12 levels"),
    ("enum", GrammarSpec("json_schema", {"enum": list(range(21))}), "20"),
    ("const", GrammarSpec("json_schema", {"const": "x" * 65}), "64 bytes"),
    ("enum value", GrammarSpec("json_schema", {"enum": [{"k": "x" * 60}]}), "64 bytes"),
    ("property name", GrammarSpec("json_schema", {"properties": {"x" * 65: {}}}), "64 bytes"),
    ("pattern", GrammarSpec("json_schema", {"type": "string", "pattern": "a" * 129}), "128 bytes"),
    ("choices", GrammarSpec("choice", [f"c{i}" for i in range(21)], field="choice"), "20"),
    ("choice entry", GrammarSpec("choice", ["a", "b" * 65], field="choice"), "64 bytes"),
    ("regex", GrammarSpec("regex", "a" * 129, field="regex"), "128 bytes"),
    ("regex groups", GrammarSpec("regex", "(" * 9 + "a" + ")" * 9, field="regex"), "8"),
    ("rules", GrammarSpec("grammar", chained_rules(10), field="grammar"), "10"),
    ("lark rules", GrammarSpec("grammar", "\n".join(f"r{i}: r{i + 1}" for i in range(11)), field="grammar"), "10"),
    ("grammar groups", GrammarSpec("grammar", "root ::= " + "(" * 9 + '"a"' + ")" * 9, field="grammar"), "8"),
    (
        "schema in a structural tag",
        GrammarSpec(
            "structural_tag",
            {
                "type": "structural_tag",
                "format": {
                    "type": "tag",
                    "begin": "<a>",
                    "end": "</a>",
                    "content": {"type": "json_schema", "json_schema": ref_chain(12)},
                },
            },
            field="structural_tag",
        ),
        "12 levels",
    ),
]


@pytest.mark.parametrize(("what", "spec", "limit"), OVER, ids=[o[0] for o in OVER])
def test_each_bound_is_a_400_naming_the_field_and_the_limit(what: str, spec: GrammarSpec, limit: str) -> None:
    error = refusal(spec)
    assert error.status == 400 and error.code == "invalid_constraint"
    assert error.field is not None and error.field.startswith(spec.field)
    assert "too large" in error.message and f"the limit is {limit}" in error.message


UNDER = [
    GrammarSpec("json_schema", True),
    GrammarSpec("json_schema", False),
    GrammarSpec("json_schema", ref_chain(9)),
    GrammarSpec("json_schema", nested_arrays(10)),
    GrammarSpec("json_schema", {"enum": list(range(20)), "const": 3}),
    # a $ref back to a schema on the path is a rule, not another level: a recursive tree passes
    GrammarSpec("json_schema", {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}),
    GrammarSpec("choice", [f"c{i}" for i in range(20)], field="choice"),
    GrammarSpec("regex", r"\(" * 10 + "[(]" * 10 + "(a)" * 10, field="regex"),
    # parentheses in literals and character classes are no groups
    GrammarSpec("grammar", "\n".join(f'r{i} ::= "(" [(]' for i in range(10)), field="grammar"),
]


@pytest.mark.parametrize("spec", UNDER, ids=[f"{s.kind}-{i}" for i, s in enumerate(UNDER)])
def test_specs_within_the_bounds_pass(spec: GrammarSpec) -> None:
    check_size(spec, spec.key, SMALL)
    check_limits(spec, SMALL)


def test_the_walk_is_iterative() -> None:
    """A schema nested far deeper than Python's recursion limit is a 400, never a RecursionError."""
    with pytest.raises(GrammarError) as info:
        check_limits(GrammarSpec("json_schema", nested_arrays(20_000)), GrammarLimits(max_schema_nodes=10**6))
    assert "128 levels" in info.value.message


def test_every_corpus_schema_is_within_the_default_bounds() -> None:
    """The defaults refuse no real schema (the 220 JSONSchemaBench schemas of the dev corpus)."""
    for path in sorted(CORPUS_DIR.glob("*.json")):
        spec = GrammarSpec("json_schema", json.loads(path.read_text())["schema"])
        check_size(spec, spec.key, GrammarLimits())
        check_limits(spec, GrammarLimits())


async def test_a_3000_ref_chain_is_a_400_before_any_compile(grammar_compilers: tuple[Any, Any]) -> None:
    """It used to reach llguidance, whose compile overflowed its thread's stack: the process died."""
    counted = GatedCompiler(grammar_compilers[0]), GatedCompiler(grammar_compilers[1])
    stage = make_stage(counted)
    spec = GrammarSpec("json_schema", ref_chain(3000), field="response_format.json_schema.schema")
    with pytest.raises(GrammarError) as info:
        await stage.compile(spec)
    assert info.value.field == spec.field and "128 levels" in info.value.message
    assert not counted[0].calls and not counted[1].calls


async def test_a_deep_native_recursion_runs_on_a_stack_that_holds_it(grammar_compilers: tuple[Any, Any]) -> None:
    """With the bounds lifted, llguidance compiles the 3,000-link chain that overflowed the 8 MB
    stack of a default thread (about 3 KB of native stack a link)."""
    unbounded = GrammarLimits(max_bytes=10**7, max_schema_nodes=10**6, max_schema_depth=10**6)
    stage = make_stage(grammar_compilers, backend="llguidance", limits=unbounded)
    constraint = await stage.compile(GrammarSpec("json_schema", ref_chain(3000)))
    assert constraint.backend == "llguidance" and constraint.check.check("42") is None


async def test_a_50000_rule_grammar_and_a_1mb_const_are_refused_at_once(grammar_compilers: tuple[Any, Any]) -> None:
    """50,000 chained rules took 29 s and left the process 9.5 GB larger; a 1 MB const 9-14 s."""
    counted = GatedCompiler(grammar_compilers[0]), GatedCompiler(grammar_compilers[1])
    stage = make_stage(counted)
    for spec, limit in [
        (GrammarSpec("grammar", chained_rules(50_000), field="grammar"), "characters of JSON"),
        (GrammarSpec("grammar", chained_rules(1_000), field="grammar"), "1,002 rules"),
        (GrammarSpec("json_schema", {"const": "x" * 1_000_000}, field="guided_json"), "characters of JSON"),
        (GrammarSpec("json_schema", {"const": "x" * 100_000}, field="guided_json"), "a const of 100,000 bytes"),
    ]:
        with pytest.raises(GrammarError) as info:
            await stage.compile(spec)
        assert info.value.field == spec.field and limit in info.value.message
    assert not counted[0].calls and not counted[1].calls


async def test_a_100000_entry_choice_is_refused_without_a_backtrace(stage_with_defaults: GrammarStage) -> None:
    spec = GrammarSpec("choice", [f"option {i}" for i in range(100_000)], field="guided_choice")
    with pytest.raises(GrammarError) as info:
        await stage_with_defaults.compile(spec)
    message = info.value.message
    assert info.value.field == "guided_choice" and "the limit is" in message
    assert "panicked" not in message and ".rs" not in message and "/" not in message


@pytest.fixture
def stage_with_defaults(grammar_compilers: tuple[Any, Any]) -> GrammarStage:
    return make_stage(grammar_compilers)


def test_a_library_panic_reaches_the_client_without_its_backtrace() -> None:
    raw = (
        "panicked at /home/runner/.cargo/registry/src/index/llguidance-1.9/src/earley/lexer.rs:412:9:\n"
        "capacity overflow\nstack backtrace:\n   0: llguidance::earley::lexer::Lexer::new\n"
        "             at /rustc/59807616e1fa/library/core/src/panicking.rs:75:14"
    )
    assert clean_message(raw) == INTERNAL_FAILURE
    assert clean_message("grammar error at /home/runner/work/x/parser.y line 3") == "grammar error at line 3"


class PanicException(BaseException):
    """What pyo3 raises when Rust code panics under a Python call (a BaseException)."""


class PanickingCompiler:
    name = "llguidance"

    def compile(self, spec: GrammarSpec) -> Compiled:
        raise PanicException("assertion failed: n < 1 << 20\nstack backtrace:\n  0: /rustc/abc/panicking.rs:75")


async def test_a_panic_under_a_compile_fails_that_spec_only(grammar_compilers: tuple[Any, Any]) -> None:
    stage = make_stage((grammar_compilers[0], PanickingCompiler()), backend="llguidance")
    spec = GrammarSpec("regex", "[a-z]+", field="regex")
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            stage.attach(tg)
            with pytest.raises(GrammarError) as info:
                await stage.compile(spec)
    assert info.value.field == "regex" and INTERNAL_FAILURE in info.value.message
