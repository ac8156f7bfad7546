"""A size ladder per constraint kind over HTTP: each step below a bound is a 200, each step past one a
400 naming the field and the limit, none hangs; after the ladder the server is alive, holds
nothing, and its memory is bounded.

Steps sit around each bound of ``stages.grammar.limits`` (not giant inputs: the inputs that once
crashed the process or kept gigabytes are refused by size before they reach a compiler).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anyio
import pytest

from pipeline import PipelineConfig
from pipeline.api.server import create_app
from pipeline.core.pipeline import Pipeline
from tests.released import assert_released
from tests.servers import serving

SCHEMA = "response_format.json_schema.schema"
# memory the process may keep after the whole ladder (the largest accepted compiles peak at tens of
# MB each; before the bounds one request kept 9.5 GB)
RSS_GROWTH_BOUND = 1024 * 1024 * 1024


def schema_body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


def properties(n: int) -> dict[str, Any]:
    # untyped properties past the bound: over its node count while still under its byte count
    value: dict[str, Any] = {"type": "integer"} if n <= 1000 else {}
    return schema_body({"type": "object", "properties": {f"p{i}": dict(value) for i in range(n)}})


def ref_chain(n: int) -> dict[str, Any]:
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return schema_body({"$ref": "#/$defs/d0", "$defs": defs})


def enum(n: int) -> dict[str, Any]:
    return schema_body({"enum": list(range(n))})


def const(n: int) -> dict[str, Any]:
    return schema_body({"const": "x" * n})


def choice(n: int) -> dict[str, Any]:
    return {"guided_choice": [f"c{i}" for i in range(n)]}


def rules(n: int) -> dict[str, Any]:
    lines = ["root ::= r0", *(f"r{i} ::= r{i + 1}" for i in range(n)), f'r{n} ::= "x"']
    return {"guided_grammar": "\n".join(lines)}


def regex(n: int) -> dict[str, Any]:
    return {"guided_regex": "(" + "|".join(f"w{i}" for i in range(n)) + ")"}


# (kind, size, body, the field a refusal names or None for a 200)
LADDER: list[tuple[str, int, dict[str, Any], str | None]] = [
    *(("properties", n, properties(n), None) for n in (10, 300)),
    ("properties", 12_000, properties(12_000), SCHEMA),
    *(("$ref depth", n, ref_chain(n), None) for n in (10, 100)),
    *(("$ref depth", n, ref_chain(n), SCHEMA) for n in (200, 3000)),
    *(("enum", n, enum(n), None) for n in (10, 1000)),
    ("enum", 20_000, enum(20_000), SCHEMA),
    ("const", 1000, const(1000), None),
    ("const", 100_000, const(100_000), SCHEMA),
    *(("choice", n, choice(n), None) for n in (10, 3000)),
    ("choice", 20_000, choice(20_000), "guided_choice"),
    *(("grammar rules", n, rules(n), None) for n in (10, 500)),
    ("grammar rules", 2000, rules(2000), "guided_grammar"),
    *(("regex", n, regex(n), None) for n in (10, 1000)),
    ("regex", 5000, regex(5000), "guided_regex"),
]


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def served() -> AsyncIterator[tuple[str, Pipeline]]:
    config = PipelineConfig(
        max_prompt_tokens=256,
        max_running_seqs=4,
        num_kv_blocks=64,
        max_model_len=512,
        preparation_mode="thread",
        grammar_compile_timeout_s=120,
        engine_mode="thread",
    )
    async with Pipeline(config) as pipe, serving(create_app(pipe)) as base:
        yield base, pipe


async def test_each_step_is_a_200_or_a_400_naming_the_limit(served: tuple[str, Pipeline]) -> None:
    base, pipe = served
    async with aiohttp.ClientSession() as session:
        warm = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **choice(2)}
        async with session.post(f"{base}/v1/chat/completions", json=warm) as resp:
            assert resp.status == 200
        start_rss = rss_bytes()
        for kind, size, constraint, field in LADDER:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **constraint}
            started = time.perf_counter()
            with anyio.fail_after(120):  # a hang guard, not a timing
                async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
                    payload = await resp.json()
            where = f"{kind} {size:,}"
            # figures for the record (never asserted): run with -s to see them
            print(f"{where}: {resp.status} in {time.perf_counter() - started:.2f} s, RSS {rss_bytes() / 2**20:.0f} MB")
            if field is None:
                assert resp.status == 200, (where, payload)
                assert payload["choices"][0]["finish_reason"] in ("stop", "length"), where
                continue
            assert resp.status == 400, (where, payload)
            error = payload["error"]
            assert error["param"] == field and error["code"] == "invalid_constraint", (where, error)
            assert "the limit is" in error["message"], (where, error)
        async with session.get(f"{base}/health") as health:
            assert health.status == 200 and (await health.json())["status"] == "ok"
        growth = rss_bytes() - start_rss
    assert growth < RSS_GROWTH_BOUND, f"the ladder left the process {growth / 2**20:.0f} MB larger"
    await assert_released(pipe)
