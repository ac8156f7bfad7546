from __future__ import annotations

import json
import os
import threading
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from anyio.abc import TaskGroup

from pipeline.errors import DeadlineExceeded, GrammarError, InvalidRequest, UnsupportedSchemaError
from pipeline.observability.metrics import Metrics
from pipeline.observability.prometheus import MetricsExporter
from pipeline.types import GrammarSpec
from stages.grammar import CompiledConstraint, GrammarStage
from stages.grammar.backends import LLGuidanceCompiler, XGrammarCompiler, clean_message
from stages.grammar.types import FIRST_USE
from tests.conftest import CorpusEntry
from tests.grammars import GatedCompiler, accepts


def make_stage(compilers: tuple[Any, Any], **kwargs: Any) -> GrammarStage:
    xgrammar, llguidance = compilers
    return GrammarStage(xgrammar, llguidance, **{"timeout_s": 10, **kwargs})


@pytest.fixture
def stage(grammar_compilers: tuple[XGrammarCompiler, LLGuidanceCompiler]) -> GrammarStage:
    return make_stage(grammar_compilers)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("spec", "backend", "good", "bad"),
    [
        (GrammarSpec("json_schema", SCHEMA), "xgrammar", '{"a": 1}', '{"a": "x"}'),
        (GrammarSpec("json_object", None), "xgrammar", '{"k": [1, 2]}', "[1]"),
        (GrammarSpec("json_schema", True), "xgrammar", '{"k": 1}', "nope"),
        (GrammarSpec("regex", r"\d{3}-[a-z]{2}", field="regex"), "xgrammar", "123-ab", "12-ab"),
        (GrammarSpec("grammar", 'root ::= "yes" | "no"', field="grammar"), "xgrammar", "no", "maybe"),
        (GrammarSpec("choice", ["red", 'say "hi"', "ünï"], field="choice"), "xgrammar", 'say "hi"', "blue"),
        (GrammarSpec("json_schema", {"type": "string", "maxLength": 3}), "llguidance", '"abc"', '"abcd"'),
    ],
)
async def test_each_kind_compiles_and_constrains(
    stage: GrammarStage, hf_tokenizer: Any, spec: GrammarSpec, backend: str, good: str, bad: str
) -> None:
    constraint = await stage.compile(spec)
    assert constraint.backend == backend and constraint.kind == spec.kind
    assert accepts(constraint.grammar, good, hf_tokenizer) and constraint.check.check(good) is None
    assert not accepts(constraint.grammar, bad, hf_tokenizer) and constraint.check.check(bad) is not None


async def test_json_has_no_free_whitespace_by_default(stage: GrammarStage) -> None:
    grammar = (await stage.compile(GrammarSpec("json_schema", SCHEMA))).grammar
    assert accepts(grammar, '{"a": 1}')
    assert not accepts(grammar, '{ "a": 1}')
    assert not accepts(grammar, '{"a": 1}  ')


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (GrammarSpec("regex", "(?=a)b", field="regex"), "regex"),
        (GrammarSpec("regex", "a(b", field="regex"), "regex"),
        (GrammarSpec("grammar", "root ::= ", field="grammar"), "grammar"),
        (GrammarSpec("grammar", 'start ::= "a"', field="grammar"), "grammar"),
        (GrammarSpec("json_schema", {"type": "array", "minItems": 3, "maxItems": 1}), "response_format"),
        (GrammarSpec("json_schema", {"$ref": "https://example.com/remote.json#/a"}), "response_format"),
        (GrammarSpec("json_schema", False), "response_format"),
    ],
)
async def test_uncompilable_specs_are_400_naming_the_field(stage: GrammarStage, spec: GrammarSpec, field: str) -> None:
    with pytest.raises(GrammarError) as info:
        await stage.compile(spec, request_id="r1")
    assert info.value.status == 400 and info.value.field == field
    assert info.value.stage == "grammar" and info.value.request_id == "r1"
    assert ".cc:" not in info.value.message and ".rs:" not in info.value.message  # our words, not a library's


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec("json_schema", {"$ref": "#"}),  # a bare cycle: compiled by xgrammar, then "token 0 rejected"
        GrammarSpec("grammar", "root ::= root", field="grammar"),
    ],
)
async def test_a_grammar_that_admits_nothing_is_a_400_at_compile(stage: GrammarStage, spec: GrammarSpec) -> None:
    with pytest.raises(GrammarError) as info:
        await stage.compile(spec)
    assert info.value.status == 400 and info.value.field == spec.field


@pytest.mark.parametrize(
    "schema",
    [
        {"not": {}},
        {"type": "object", "not": {"description": "anything"}},
        {"type": "object", "properties": {"a": {"enum": []}}, "required": ["a"]},
        {"anyOf": [{"not": True}, False]},
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    ],
)
@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
async def test_a_schema_that_admits_no_value_is_a_400(
    grammar_compilers: tuple[Any, Any], schema: dict[str, Any], backend: str
) -> None:
    # {"not": {}} was compiled (xgrammar ignores "not") and generated text
    stage = make_stage(grammar_compilers, backend=backend)
    with pytest.raises(GrammarError, match="admits no value") as info:
        await stage.compile(GrammarSpec("json_schema", schema, field="response_format.json_schema.schema"))
    assert info.value.status == 400 and info.value.field == "response_format.json_schema.schema"


def test_library_messages_are_cleaned() -> None:
    raw = "[22:11:03] /workspace/cpp/json_schema_converter.cc:712: Unsupported type: foo\nstack trace\n  at x"
    assert clean_message(raw) == "at x"
    assert clean_message("[22:11:03] /workspace/cpp/grammar_parser.cc:91: Expect rule") == "Expect rule"
    assert clean_message("src/api.rs:12:4: bad regex") == "bad regex"


async def test_keywords_no_grammar_enforces_are_held_by_the_answer_check(stage: GrammarStage) -> None:
    """A strict schema is no longer refused for keywords the grammar ignores: the answer check holds them."""
    schema = {"type": "array", "items": {"type": "integer", "not": {"const": 3}}, "uniqueItems": True}
    constraint = await stage.compile(GrammarSpec("json_schema", schema))
    assert accepts(constraint.grammar, "[1, 1]")  # the grammar lets it through...
    violation = constraint.check.check("[1, 1]")  # ...the check does not
    assert violation is not None and violation.reason == "uniqueItems"
    assert constraint.check.check("[1, 3]") is not None and constraint.check.check("[1, 2]") is None


async def test_cache_hit_returns_the_same_constraint_without_compiling(stage: GrammarStage) -> None:
    spec = GrammarSpec("json_schema", {"type": "object", "properties": {"q": {"type": "boolean"}}})
    first = await stage.compile(spec)
    again = await stage.compile(GrammarSpec("json_schema", json.loads(json.dumps(spec.value))))
    assert again is first
    assert (stage.stats.hits, stage.stats.misses) == (1, 1)
    bad = GrammarSpec("regex", "(?=x)", field="regex")
    with pytest.raises(GrammarError) as first_error:
        await stage.compile(bad)
    assert first_error.type is GrammarError and first_error.value.field == "regex"
    errors = stage.stats.errors
    with pytest.raises(GrammarError) as cached:  # a cached failure fails the same way, without compiling
        await stage.compile(bad)
    assert (cached.type, cached.value.field, cached.value.message) == (GrammarError, "regex", first_error.value.message)
    assert stage.stats.errors == errors and stage.stats.hits == 2


async def test_cache_is_bounded_by_bytes(grammar_compilers: tuple[Any, Any]) -> None:
    stage = make_stage(grammar_compilers, cache_bytes=4 * 1024 * 1024)
    specs = [GrammarSpec("regex", f"[a-z]{{{i}}}x", field="regex") for i in range(1, 40)]
    for spec in specs:
        await stage.compile(spec)
    assert 0 < stage.cached_bytes <= stage.cache_bytes
    assert stage.lookup(specs[-1]) is not None and stage.lookup(specs[0]) is None  # least recent out


async def test_the_cache_exports_its_bound_and_evictions(grammar_compilers: tuple[Any, Any]) -> None:
    stage = make_stage(grammar_compilers, cache_bytes=4 * 1024 * 1024)
    for i in range(1, 40):
        await stage.compile(GrammarSpec("regex", f"[a-z]{{{i}}}x", field="regex"))
    metrics = Metrics()
    metrics.register_cache("grammar", stage.cache_counters)
    exposition = MetricsExporter(metrics).render().decode()
    samples = {
        name: float(value)
        for name, _, value in (line.partition(" ") for line in exposition.splitlines())
        if name.endswith('{cache="grammar"}')
    }
    assert samples['pipeline_cache_bytes_bound{cache="grammar"}'] == 4 * 1024 * 1024
    assert samples['pipeline_cache_evictions_total{cache="grammar"}'] == stage.cache_counters()["evictions"] > 0
    assert samples['pipeline_cache_bytes{cache="grammar"}'] == stage.cached_bytes


async def test_concurrent_identical_compiles_share_one_job(grammar_compilers: tuple[Any, Any]) -> None:
    gate = threading.Event()
    xgrammar, llguidance = GatedCompiler(grammar_compilers[0]), GatedCompiler(grammar_compilers[1], gate)
    stage = make_stage((xgrammar, llguidance))
    spec = GrammarSpec("regex", "[a-c]+", field="regex")
    results: list[CompiledConstraint] = []
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            stage.attach(tg)

            async def waiter() -> None:
                results.append(await stage.compile(spec))

            with anyio.CancelScope() as first_caller:
                tg.start_soon(waiter)  # becomes the job's first waiter
                await anyio.wait_all_tasks_blocked()
            for _ in range(4):
                tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            first_caller.cancel()  # the first requester goes away; the shared job must go on
            gate.set()
    assert llguidance.calls[spec.key] == 1 and xgrammar.calls[spec.key] == 0  # the spec's first use
    assert len(results) == 5 and all(r is results[0] for r in results)
    assert stage.fast_limiter.borrowed_tokens == 0 and stage.num_compiling == 0


async def test_a_one_off_spec_is_served_by_llguidance_and_leaves_no_compile_running(
    grammar_compilers: tuple[Any, Any], hf_tokenizer: Any
) -> None:
    """A spec's first use starts no xgrammar compile: a spec sent once never pays for one."""
    gate = threading.Event()
    xgrammar = GatedCompiler(grammar_compilers[0], gate)
    stage = make_stage((xgrammar, grammar_compilers[1]))
    spec = GrammarSpec("regex", "[x-z]+", field="regex")
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            stage.attach(tg)
            served = await stage.compile(spec)
            assert (served.backend, served.reason, served.is_stand_in) == ("llguidance", FIRST_USE, True)
            await anyio.wait_all_tasks_blocked()
            assert stage.num_compiling == 0 and stage.limiter.borrowed_tokens == 0
            assert stage.fast_limiter.borrowed_tokens == 0
            assert stage.lookup(spec) is served  # cached as a stand-in: a second use starts xgrammar
            gate.set()
    assert xgrammar.calls[spec.key] == 0 and accepts(served.grammar, "xyz", hf_tokenizer)
    assert stage.stats.backends == Counter({f"llguidance: {FIRST_USE}": 1})


async def test_busy_xgrammar_slots_do_not_starve_cheap_specs(grammar_compilers: tuple[Any, Any]) -> None:
    """Two slow compiles hold both xgrammar slots; a cheap schema and a refusal still answer at once."""
    gate = threading.Event()
    xgrammar = GatedCompiler(grammar_compilers[0], gate)
    stage = make_stage((xgrammar, grammar_compilers[1]), max_concurrent=2)
    slow = [
        GrammarSpec("json_schema", {"type": "object", "properties": {f"p{i}": {"type": "integer"}}}) for i in (1, 2)
    ]
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            stage.attach(tg)
            await hold_both_slots(stage, slow)
            cheap = await stage.compile(GrammarSpec("json_schema", SCHEMA))
            assert cheap.backend == "llguidance" and cheap.reason == "xgrammar compile slots busy"
            empty = {"type": "array", "minItems": 3, "maxItems": 1}
            impossible = GrammarSpec("json_schema", empty, field="guided_json")
            with pytest.raises(GrammarError) as info:
                await stage.compile(impossible)
            assert info.type is GrammarError and info.value.field == "guided_json"
            gate.set()
    assert sum(xgrammar.calls.values()) == 2


async def test_deadline_fails_the_request_and_the_compile_is_kept(grammar_compilers: tuple[Any, Any]) -> None:
    """A grammar only xgrammar compiles (look-ahead) has no fallback: past the deadline the request gets a 504."""
    gate = threading.Event()
    xgrammar = GatedCompiler(grammar_compilers[0], gate)
    stage = make_stage((xgrammar, grammar_compilers[1]), timeout_s=0.05)
    spec = GrammarSpec("grammar", LOOK_AHEAD, field="grammar")
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            stage.attach(tg)
            with pytest.raises(DeadlineExceeded) as info:
                await stage.compile(spec)
            assert info.value.status == 504 and info.value.field == "grammar"
            assert stage.limiter.borrowed_tokens == 1  # the thread still runs, holding its token
            gate.set()
            await stage.wait_idle()
    assert stage.limiter.borrowed_tokens == 0
    assert stage.lookup(spec) is not None  # finished in the background and cached
    assert accepts((await stage.compile(spec)).grammar, "xy")


LOOK_AHEAD = 'root ::= a "y"\na ::= "x" (= "y")'  # xgrammar's look-ahead: no llguidance translation
TAG = {
    "type": "structural_tag",
    "format": {
        "type": "triggered_tags",
        "triggers": ["<f"],
        "tags": [
            {
                "type": "tag",
                "begin": "<f>",
                "content": {"type": "json_schema", "json_schema": {"type": "integer"}},
                "end": "</f>",
            }
        ],
        "at_least_one": False,
        "stop_after_first": False,
    },
}


async def hold_both_slots(stage: GrammarStage, specs: list[GrammarSpec]) -> None:
    """Use each of two specs twice: each second use starts an xgrammar compile, which holds a slot
    while the stage's xgrammar compiler waits for its gate."""
    for spec in specs:
        for _ in range(2):
            assert (await stage.compile(spec)).backend == "llguidance"
    await anyio.wait_all_tasks_blocked()
    assert stage.limiter.borrowed_tokens == 2


@asynccontextmanager
async def xgrammar_busy(
    grammar_compilers: tuple[Any, Any], timeout_s: float
) -> AsyncIterator[tuple[GrammarStage, TaskGroup, threading.Event]]:
    """A stage whose two xgrammar compile slots are held by gated compiles until ``gate`` is set
    (at the latest when the block ends)."""
    gate = threading.Event()
    stage = make_stage((GatedCompiler(grammar_compilers[0], gate), grammar_compilers[1]), timeout_s=timeout_s)
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            stage.attach(tg)
            await hold_both_slots(
                stage, [GrammarSpec("json_schema", {"type": "object", "properties": {f"q{i}": {}}}) for i in (1, 2)]
            )
            try:
                yield stage, tg, gate
            finally:
                gate.set()


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec("grammar", "root ::= ", field="grammar"),
        GrammarSpec("grammar", 'root ::= "a" | missing', field="grammar"),
        GrammarSpec(
            "structural_tag", {"type": "structural_tag", "format": {"type": "grammar", "grammar": "root ::= "}}
        ),
    ],
)
async def test_a_malformed_grammar_is_refused_at_once_while_xgrammar_is_busy(
    grammar_compilers: tuple[Any, Any], spec: GrammarSpec
) -> None:
    # it waited for a compile slot: a 504 after the deadline instead of a 400
    async with xgrammar_busy(grammar_compilers, timeout_s=2) as (stage, _, _):
        with pytest.raises(GrammarError) as info:
            await stage.compile(spec)
        assert info.value.status == 400 and info.value.field == spec.field


@pytest.mark.parametrize(
    ("spec", "good", "bad"),
    [
        (GrammarSpec("grammar", 'root ::= "yes" | "no" [0-9]*', field="grammar"), "no42", "maybe"),
        (GrammarSpec("grammar", 'start: "yes" | "no" DIGITS?\nDIGITS: /[0-9]+/', field="grammar"), "no42", "no4x"),
        (GrammarSpec("structural_tag", TAG), "so <f>12</f> and <f>3</f> done", "so <f>x</f>"),
    ],
    ids=["ebnf", "lark", "structural tag"],
)
async def test_grammars_and_tags_are_served_by_llguidance_while_xgrammar_is_busy(
    grammar_compilers: tuple[Any, Any], hf_tokenizer: Any, spec: GrammarSpec, good: str, bad: str
) -> None:
    async with xgrammar_busy(grammar_compilers, timeout_s=5) as (stage, _, _):
        served = await stage.compile(spec)
        assert served.backend == "llguidance" and served.reason == "xgrammar compile slots busy"
    assert accepts(served.grammar, good, hf_tokenizer) and served.check.check(good) is None
    assert not accepts(served.grammar, bad, hf_tokenizer) and served.check.check(bad) is not None


async def test_what_llguidance_cannot_compile_waits_for_xgrammar(grammar_compilers: tuple[Any, Any]) -> None:
    async with xgrammar_busy(grammar_compilers, timeout_s=10) as (stage, tg, gate):
        done = anyio.Event()
        result: list[CompiledConstraint] = []

        async def compile_look_ahead() -> None:
            result.append(await stage.compile(GrammarSpec("grammar", LOOK_AHEAD, field="grammar")))
            done.set()

        tg.start_soon(compile_look_ahead)
        await anyio.wait_all_tasks_blocked()
        assert not done.is_set()
        gate.set()
        await done.wait()
    assert result[0].backend == "xgrammar" and result[0].check.check("xy") is None


async def test_a_lark_grammar_is_honoured(stage: GrammarStage, hf_tokenizer: Any) -> None:
    # vLLM's guided_grammar takes Lark; it was refused ("Unexpected character: ':'")
    constraint = await stage.compile(GrammarSpec("grammar", 'start: "(" NUM ")"\nNUM: /[0-9]{1,3}/', field="grammar"))
    assert accepts(constraint.grammar, "(12)", hf_tokenizer) and constraint.check.check("(12)") is None
    assert constraint.check.check("(1234)") is not None


@pytest.mark.slow
def test_schema_corpus_compiles_or_is_refused_with_400(schema_corpus: list[CorpusEntry], hf_tokenizer: Any) -> None:
    """Every JSONSchemaBench schema either compiles with its dispatched backend or is refused with a
    400; the valid instances of the ones that compile are accepted by their grammar (serialised as the
    grammar writes JSON) and all pass the answer check."""
    refused: Counter[str] = Counter()
    by_backend: Counter[str] = Counter()
    accepted = rejected = 0
    for entry in schema_corpus:
        if entry.constraint is None:
            assert isinstance(entry.error, InvalidRequest) and entry.error.status == 400, entry.name
            refused[entry.error.message[:60]] += 1
            continue
        by_backend[entry.constraint.backend] += 1
        for valid, data in entry.instances:
            text = json.dumps(data, ensure_ascii=False)
            if valid:
                ok = accepts(entry.grammar, text, hf_tokenizer)
                accepted, rejected = accepted + ok, rejected + (not ok)
            assert (entry.constraint.check.check(text) is None) == valid, (entry.name, text[:100])
    compiled = sum(by_backend.values())
    print(
        f"\nschema corpus: {compiled} compiled {dict(by_backend)}, {len(schema_corpus) - compiled} refused "
        f"{dict(refused)}; valid instances accepted by the grammar {accepted}, rejected {rejected}"
    )
    assert len(schema_corpus) == 220
    assert compiled >= 210
    # a valid instance the grammar rejects is over-restriction (key order, strict mode's closed
    # objects, number formatting); it never makes an output invalid, but it should stay the exception
    assert accepted > 3 * rejected


async def test_huge_schemas_do_not_hold_the_xgrammar_slots(stage: GrammarStage) -> None:
    """Two distinct 5,000-property schemas: xgrammar took minutes and 0.6-0.9 GB each; they go to
    llguidance (about 0.35 s each here) and leave both xgrammar slots free for everyone else."""
    big = [{"type": "object", "properties": {f"{tag}{j}": {"type": "string"} for j in range(5000)}} for tag in "ab"]
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            stage.attach(tg)
            results: list[CompiledConstraint] = []

            async def compile_big(schema: dict[str, Any]) -> None:
                results.append(await stage.compile(GrammarSpec("json_schema", schema)))

            for schema in big:
                tg.start_soon(compile_big, schema)
            await anyio.wait_all_tasks_blocked()
            assert stage.limiter.borrowed_tokens == 0
    assert [r.backend for r in results] == ["llguidance"] * 2
    assert all(r.reason.startswith("large schema") for r in results)


# -- llguidance stands in at a spec's first use; its second starts xgrammar's compile -------------


def gated_stage(
    grammar_compilers: tuple[Any, Any],
) -> tuple[GrammarStage, GatedCompiler, GatedCompiler, threading.Event]:
    """A stage whose xgrammar compiles wait for the returned gate."""
    gate = threading.Event()
    xgrammar, llguidance = GatedCompiler(grammar_compilers[0], gate), GatedCompiler(grammar_compilers[1])
    return make_stage((xgrammar, llguidance)), xgrammar, llguidance, gate


async def test_the_second_use_starts_xgrammar_and_the_third_gets_it(
    grammar_compilers: tuple[Any, Any], hf_tokenizer: Any
) -> None:
    """No request waits for xgrammar's compile: llguidance serves the first use and starts none; the
    second use (a hit of the stand-in, still served by it) starts xgrammar's at the lowest priority;
    the third gets xgrammar."""
    stage, xgrammar, llguidance, gate = gated_stage(grammar_compilers)
    spec = GrammarSpec("json_schema", SCHEMA)
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            stage.attach(tg)
            first = await stage.compile(spec)
            assert (first.backend, first.reason, first.is_stand_in) == ("llguidance", FIRST_USE, True)
            await anyio.wait_all_tasks_blocked()
            assert stage.num_compiling == 0 and stage.limiter.borrowed_tokens == 0 and xgrammar.calls[spec.key] == 0
            second = await stage.compile(spec)
            assert second is first  # llguidance still serves the second use...
            await anyio.wait_all_tasks_blocked()
            assert stage.num_compiling == 1 and stage.limiter.borrowed_tokens == 1  # ...while xgrammar compiles
            assert await stage.compile(spec) is first  # until it lands, hits are served by the stand-in
            assert stage.num_compiling == 1  # and start no other compile
            gate.set()
            await stage.wait_idle()
    assert stage.limiter.borrowed_tokens == 0 and stage.fast_limiter.borrowed_tokens == 0 and stage.num_compiling == 0
    third = await stage.compile(spec)
    assert (third.backend, third.reason, third.is_stand_in) == ("xgrammar", "replaces the llguidance stand-in", False)
    assert xgrammar.calls[spec.key] == 1 and llguidance.calls[spec.key] == 1
    # a compile nobody waits for runs at the lowest priority
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert xgrammar.nice[spec.key] == min(19, base + 19)
    assert llguidance.nice[spec.key] == base
    for constraint in (first, third):  # both backends constrain, and the answer check holds
        assert accepts(constraint.grammar, '{"a": 1}', hf_tokenizer) and constraint.check.check('{"a": 1}') is None
        assert not accepts(constraint.grammar, '{"a": "x"}', hf_tokenizer)
        assert constraint.check.check('{"a": "x"}') is not None


class RefusingCompiler(GatedCompiler):
    """llguidance refusing a schema with the error it gives for keywords it will not approximate even
    leniently (the stage then tries xgrammar). None of the schemas the dispatch table leaves to
    xgrammar that were tried here is refused by this llguidance version: the refusal is made here."""

    def compile(self, spec: GrammarSpec) -> Any:
        self.calls[spec.key] += 1
        raise UnsupportedSchemaError("llguidance cannot approximate: dependencies", field=spec.field)


async def test_a_spec_llguidance_refuses_gets_xgrammar_at_its_first_use(grammar_compilers: tuple[Any, Any]) -> None:
    xgrammar, llguidance = GatedCompiler(grammar_compilers[0]), RefusingCompiler(grammar_compilers[1])
    stage = make_stage((xgrammar, llguidance))
    spec = GrammarSpec("json_schema", SCHEMA)
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            stage.attach(tg)
            served = await stage.compile(spec)
            assert (served.backend, served.reason, served.is_stand_in) == (
                "xgrammar",
                "llguidance could not compile it",
                False,
            )
            assert xgrammar.calls[spec.key] == 1 and llguidance.calls[spec.key] == 1
            base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            assert xgrammar.nice[spec.key] == base  # waited for: at normal priority
            assert await stage.compile(spec) is served and stage.num_compiling == 0  # a hit compiles nothing
    assert xgrammar.calls[spec.key] == 1 and llguidance.calls[spec.key] == 1


async def test_a_cancelled_request_leaves_its_compile_to_finish_into_the_cache(
    grammar_compilers: tuple[Any, Any],
) -> None:
    stage, xgrammar, _, x_gate = gated_stage(grammar_compilers)
    l_gate = threading.Event()
    stage.compilers["llguidance"] = llguidance = GatedCompiler(grammar_compilers[1], l_gate)
    spec = GrammarSpec("json_schema", SCHEMA)
    ended = anyio.Event()
    scopes: list[anyio.CancelScope] = []
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            stage.attach(tg)

            async def request() -> None:
                with anyio.CancelScope() as scope:
                    scopes.append(scope)
                    await stage.compile(spec)
                ended.set()

            tg.start_soon(request)
            await anyio.wait_all_tasks_blocked()
            assert stage.limiter.borrowed_tokens == 0 and stage.fast_limiter.borrowed_tokens == 1
            scopes[0].cancel()
            await ended.wait()
            assert scopes[0].cancelled_caught and stage.num_compiling == 1  # the job goes on without it
            l_gate.set()
            await stage.wait_idle()
            stand_in = stage.lookup(spec)
            assert isinstance(stand_in, CompiledConstraint) and stand_in.is_stand_in
            assert await stage.compile(spec) is stand_in  # the second use: xgrammar's compile starts
            x_gate.set()
            await stage.wait_idle()
    assert stage.limiter.borrowed_tokens == 0 and stage.fast_limiter.borrowed_tokens == 0 and stage.num_compiling == 0
    assert xgrammar.calls[spec.key] == 1 and llguidance.calls[spec.key] == 1
    cached = stage.lookup(spec)
    assert isinstance(cached, CompiledConstraint) and cached.backend == "xgrammar"


async def test_a_bad_spec_is_a_400_at_once_and_starts_no_xgrammar_compile(grammar_compilers: tuple[Any, Any]) -> None:
    stage, xgrammar, _, gate = gated_stage(grammar_compilers)
    spec = GrammarSpec("regex", "(ab", field="regex")
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            stage.attach(tg)
            for _ in range(2):  # the second: the cached refusal
                with pytest.raises(GrammarError) as info:
                    await stage.compile(spec)
                assert info.value.status == 400 and info.value.field == "regex"
                await anyio.wait_all_tasks_blocked()
                assert stage.num_compiling == 0
            gate.set()
    assert xgrammar.calls[spec.key] == 0 and stage.limiter.borrowed_tokens == 0


async def test_a_stand_in_xgrammar_cannot_compile_stays_and_no_hit_compiles_it_again(
    grammar_compilers: tuple[Any, Any], hf_tokenizer: Any
) -> None:
    stage, xgrammar, _, gate = gated_stage(grammar_compilers)
    spec = GrammarSpec("regex", r"\p{L}+", field="regex")  # xgrammar 0.2.8 has no Unicode classes
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            stage.attach(tg)
            served = await stage.compile(spec)
            assert served.backend == "llguidance" and served.is_stand_in
            assert await stage.compile(spec) is served and stage.num_compiling == 1  # the second use
            gate.set()
            await stage.wait_idle()
            for _ in range(3):
                again = await stage.compile(spec)
                assert again.backend == "llguidance" and not again.is_stand_in
                await anyio.wait_all_tasks_blocked()
                assert stage.num_compiling == 0
    assert xgrammar.calls[spec.key] == 1 and accepts(again.grammar, "héllo", hf_tokenizer)


async def test_a_stand_in_served_while_slots_were_busy_is_replaced_after_a_later_hit(
    grammar_compilers: tuple[Any, Any],
) -> None:
    spec = GrammarSpec("json_schema", SCHEMA)
    async with xgrammar_busy(grammar_compilers, timeout_s=5) as (stage, _, gate):
        xgrammar = stage.compilers["xgrammar"]
        assert isinstance(xgrammar, GatedCompiler)
        served = await stage.compile(spec)
        assert (served.backend, served.reason, served.is_stand_in) == (
            "llguidance",
            "xgrammar compile slots busy",
            True,
        )
        assert await stage.compile(spec) is served and stage.num_compiling == 2  # no slot: no compile queued
        gate.set()
        await stage.wait_idle()
        assert await stage.compile(spec) is served  # this hit finds a slot free and starts xgrammar
        assert stage.num_compiling == 1
        await stage.wait_idle()
        later = await stage.compile(spec)
        assert later.backend == "xgrammar" and later.reason == "replaces the llguidance stand-in"
    assert xgrammar.calls[spec.key] == 1 and stage.limiter.borrowed_tokens == 0 and stage.num_compiling == 0
