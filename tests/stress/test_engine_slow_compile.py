"""A grammar compile that takes seconds in a live engine process is not a hang: while it owes the
verdict the engine process says it is alive, so a hang deadline shorter than the compile neither fails
the request with ``engine_failed`` nor starts another engine process."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import anyio
import pytest

from pipeline import PipelineConfig
from pipeline.core.pipeline import Pipeline
from pipeline.engine.client import ProcessEngine
from pipeline.errors import GrammarError
from tests.released import assert_released

MARKER = "slow_compile_marker"
COMPILE_S = 4.0  # several hang deadlines
# under a second: an engine process that says it is alive only once a second misses it every time
STEP_TIMEOUT_S = 0.75

# Loaded at the engine process's start (it inherits PYTHONPATH): xgrammar's compile of a spec that
# names MARKER sleeps first, as a hard schema's native compile would (the sleep releases the GIL too).
_SITECUSTOMIZE = f"""
import os, time
if os.environ.get("SLOW_COMPILE_MARKER"):
    from stages.grammar.backends import XGrammarCompiler

    _real = XGrammarCompiler.compile

    def _slow(self, spec):
        if os.environ["SLOW_COMPILE_MARKER"] in spec.key:
            time.sleep({COMPILE_S})  # noqa: sleep-ok (a compile this slow is what the test is about)
        return _real(self, spec)

    XGrammarCompiler.compile = _slow
"""


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def pipe(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pipeline]:
    hook = tmp_path_factory.mktemp("slow_compile")
    (hook / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    with pytest.MonkeyPatch.context() as mp:  # the engine process's environment, not this process's code
        mp.setenv("PYTHONPATH", os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
        mp.setenv("SLOW_COMPILE_MARKER", MARKER)
        config = PipelineConfig(
            engine_mode="process",
            preparation_mode="thread",
            engine_step_timeout_s=STEP_TIMEOUT_S,
            grammar_backend="xgrammar",  # no llguidance stand-in: the verdict waits for the compile
            max_running_seqs=4,
            num_kv_blocks=256,
            max_model_len=1024,
        )
        async with Pipeline(config) as p:
            yield p


TEXT = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 16}


SCHEMA = {"type": "object", "properties": {MARKER: {"type": "integer"}}, "required": [MARKER]}
# refused by xgrammar only after the slow compile: the rule it names is not defined
BAD_GRAMMAR = f'root ::= "{MARKER}" undefined_rule'


@pytest.mark.parametrize("kind", ["compiles", "refused"])
async def test_a_slow_compile_on_a_live_engine_process_is_not_a_hang(pipe: Pipeline, kind: str) -> None:
    engine = pipe.engine
    assert isinstance(engine, ProcessEngine)
    pid, failures = engine.pid, engine.num_failures
    with anyio.fail_after(120):
        if kind == "compiles":
            schema = {**SCHEMA, "title": kind}  # a new spec each run: its compile is not cached
            body = {**TEXT, "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
            result = await (await pipe.submit(body)).result()
            assert result.finish_reason in ("stop", "length")
        else:
            with pytest.raises(GrammarError) as info:
                await (await pipe.submit({**TEXT, "grammar": BAD_GRAMMAR})).result()
            assert info.value.status == 400 and "undefined_rule" in info.value.message
        assert engine.pid == pid and engine.num_failures == failures and engine.status == "ok"
        await assert_released(pipe)
