"""Property-based fuzzing of the server from its own OpenAPI document.

Bodies come from ``/openapi.json`` (``tests.openapi_strategies`` draws instances of the request
schema, so they pass the declared types and reach the deeper checks; with a user message and no
drawn model name they reach the stages and the engine), and from arbitrary JSON under the
request's own field names (wrong types, odd nesting). The property: no
500, no hang, no broken stream, no 503 (the server is running and one request at a time never fills
it); every 4xx is OpenAI's error shape naming the field; every 200 decodes as the declared response
type. Bounded (a fixed number of examples, derandomized) so it runs in ``make test`` in seconds.

Each test counts what its examples reached (status and field), and checks after its last example
that it reached what its name promises: a fuzzer whose bodies all die at the first check would
pass the property while testing nothing behind it.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import PipelineConfig
from pipeline.api.openapi import openapi_document
from pipeline.api.server import create_app
from pipeline.core.pipeline import Pipeline
from pipeline.protocol.response_bodies import ChatCompletion, ChatCompletionChunk, Completion, ErrorResponse
from tests.openapi_strategies import ANY_JSON, from_schema
from tests.released import assert_released
from tests.servers import serving

# FUZZ_EXAMPLES=2000 FUZZ_SEED=... for a longer hunt; by default a fixed set, the same every run
FUZZ = settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "60")),
    deadline=None,
    derandomize="FUZZ_SEED" not in os.environ,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much],
)
DOCUMENT = openapi_document()
COMPONENTS = DOCUMENT["components"]["schemas"]
_CHAT = from_schema(COMPONENTS["ChatCompletionRequest"], COMPONENTS)


@dataclass
class Target:
    pipe: Pipeline
    base: str
    session: aiohttp.ClientSession


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def target() -> AsyncIterator[Target]:
    # small enough that any drawn request decodes in well under a second: max_tokens and the prompt
    # share 48 positions; random URLs fail fast (no network here, and short timeouts anyway)
    config = PipelineConfig(
        max_model_len=48,
        default_max_tokens=4,
        max_running_seqs=16,
        num_kv_blocks=64,
        fetch_connect_timeout_s=0.5,
        fetch_total_timeout_s=1.0,
        grammar_compile_timeout_s=5.0,
        preparation_mode="thread",  # drawn images never decode: workers would start for nothing
        engine_mode="thread",
    )
    async with (
        Pipeline(config) as pipe,
        serving(create_app(pipe), handler_cancellation=True) as base,
        aiohttp.ClientSession() as session,
    ):
        yield Target(pipe, base, session)
        await assert_released(pipe)


Reached = Counter[tuple[int, str | None, str]]  # (status, the field an error names, its code or the content type)
_PROMISES: dict[str, Callable[[Reached], None]] = {}


def reaches(check: Callable[[Reached], None]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """What a fuzz test's examples must have reached once they have all run (``check`` asserts it)."""

    def register(test: Callable[..., Any]) -> Callable[..., Any]:
        _PROMISES[test.__name__] = check
        return test

    return register


@pytest.fixture
def reached(request: pytest.FixtureRequest) -> Iterator[Reached]:
    """One fuzz test's counts, over all its examples (hypothesis runs them in one fixture scope)."""
    counts: Reached = Counter()
    yield counts
    print(f"{request.function.__name__} reached {sorted(counts.items(), key=str)}")
    _PROMISES[request.function.__name__](counts)


def answered(counts: Reached, content_type: str | None = None) -> float:
    """The share of the examples answered 200 (with ``content_type``, if given)."""
    hits = sum(n for (status, _, kind), n in counts.items() if status == 200 and content_type in (None, kind))
    return hits / max(1, counts.total())


def fields_refused(counts: Reached) -> set[str | None]:
    return {field for (status, field, _) in counts if 400 <= status < 500}


async def _check(target: Target, reached: Reached, body: bytes, path: str = "/v1/chat/completions") -> None:
    headers = {"Content-Type": "application/json"}
    whole, chunk = (ChatCompletion, ChatCompletionChunk) if path == "/v1/chat/completions" else (Completion, Completion)
    with anyio.fail_after(30):  # a hang is a finding too
        async with target.session.post(f"{target.base}{path}", data=body, headers=headers) as resp:
            raw = await resp.read()
            status, content_type = resp.status, resp.content_type
    # a running server that is not overloaded answers no 503; a 504 is a fetch of a drawn URL timing out
    assert status < 500 or status == 504, (status, raw[:500], body[:500])
    if status != 200:
        error = msgspec.json.decode(raw, type=ErrorResponse).error
        reached[status, error.param, error.code] += 1
        if status == 504:
            assert error.code == "deadline_exceeded", (status, error, body[:500])
        if 400 <= status < 500:
            assert error.param, (status, error, body[:500])  # every 4xx names the field
        return
    reached[200, None, content_type] += 1
    if content_type == "text/event-stream":
        events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", raw[-500:]
        for event in events[:-1]:
            decoded = json.loads(event)
            if "error" in decoded:  # in-band, after the headers: only an answer that failed its check
                assert decoded["error"]["code"] == "invalid_answer", decoded
            else:
                msgspec.convert(decoded, chunk)
    else:
        msgspec.json.decode(raw, type=whole)


def _refused_deep(counts: Reached) -> None:
    # past the declared types: the request's own checks refuse many different fields
    assert len(fields_refused(counts)) >= 8, counts


@reaches(_refused_deep)
@FUZZ
@given(body=_CHAT)
async def test_bodies_drawn_from_the_openapi_schema(target: Target, reached: Reached, body: dict[str, Any]) -> None:
    await _check(target, reached, json.dumps(body).encode())


# Left out of the plausible bodies: drawn keys are almost never token ids, and the 400 naming them
# would hide everything behind it.
_NOT_YET = ("logit_bias",)
_CONTENT = from_schema(COMPONENTS["ChatMessage"]["properties"]["content"]["anyOf"][0], COMPONENTS) | st.lists(
    from_schema(COMPONENTS["TextContent"], COMPONENTS), min_size=1, max_size=2
)


def _plausible(body: dict[str, Any], content: Any, stream: bool) -> dict[str, Any]:
    # a drawn model name is a 404 (covered by the test above); without one, the served model answers
    body = {k: v for k, v in body.items() if k not in (*_NOT_YET, "model")}
    return {**body, "messages": [{"role": "user", "content": content}], "stream": stream}


def _answered_both_ways(counts: Reached) -> None:
    assert answered(counts) >= 0.2, counts
    assert answered(counts, "application/json") > 0 and answered(counts, "text/event-stream") > 0, counts


@reaches(_answered_both_ways)
@FUZZ
@given(
    body=st.builds(_plausible, from_schema(COMPONENTS["ChatCompletionRequest"], COMPONENTS), _CONTENT, st.booleans())
)
async def test_plausible_bodies_reach_the_engine(target: Target, reached: Reached, body: dict[str, Any]) -> None:
    await _check(target, reached, json.dumps(body).encode())


def _completions_answered(counts: Reached) -> None:
    assert answered(counts) >= 0.1, counts


@reaches(_completions_answered)
@FUZZ
@given(body=from_schema(COMPONENTS["CompletionRequest"], COMPONENTS))
async def test_completion_bodies_drawn_from_the_openapi_schema(
    target: Target, reached: Reached, body: dict[str, Any]
) -> None:
    body.pop("logit_bias", None)  # as above: drawn keys (and model names, a 404) would hide the rest
    body.pop("model", None)
    await _check(target, reached, json.dumps(body).encode(), "/v1/completions")


_JSON = ANY_JSON
_ROLES = st.sampled_from(["user", "system", "assistant", "tool", "x"])
_FIELDS = sorted(set(COMPONENTS["ChatCompletionRequest"]["properties"]) - {"messages"})
_MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"])}, optional={"content": _JSON}
    )
    | _JSON,
    max_size=3,
)


def _each_wrong_value_named(counts: Reached) -> None:
    # the refusals name many different fields, the unknown one among them
    assert len(fields_refused(counts)) >= 8 and "extra" in fields_refused(counts), counts


@reaches(_each_wrong_value_named)
@FUZZ
@given(
    body=st.fixed_dictionaries({"messages": _MESSAGES}, optional=dict.fromkeys(_FIELDS, _JSON))
    | _JSON.map(lambda value: {"messages": [{"role": "user", "content": "x"}], "extra": value})
)
async def test_wrong_values_under_the_declared_names(target: Target, reached: Reached, body: dict[str, Any]) -> None:
    await _check(target, reached, json.dumps(body).encode())
