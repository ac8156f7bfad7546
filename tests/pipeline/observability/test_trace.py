from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline import PipelineConfig
from pipeline.core.pipeline import Pipeline
from pipeline.observability.trace import Tracer
from tests.images import data_url, encode, image_request, make_image


@pytest.mark.parametrize("engine_mode", ["thread", "process"])
async def test_trace_has_every_stage_span_of_a_request(tmp_path: Path, engine_mode: str) -> None:
    """Every stage's span on the request's track, the engine's steps on their own (in process mode
    they cross with the engine process's step outputs)."""
    tracer = Tracer()
    config = PipelineConfig(max_running_seqs=4, num_kv_blocks=256, max_model_len=2048, engine_mode=engine_mode)
    async with Pipeline(config, tracer=tracer) as pipe:
        body = image_request([data_url(encode(make_image(seed=2)))], regex="[ab]{4}", max_tokens=8)
        handle = await pipe.submit(body)
        await handle.result()
    path = tmp_path / "trace.json"
    tracer.write(path)
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M"}
    track = names[handle.request_id]
    mine = {e["name"] for e in events if e.get("tid") == track and e["ph"] in ("X", "i")}
    assert {"admitted", "fetch queue", "fetch", "decode", "template", "vision", "grammar compile"} <= mine
    assert "first token" in mine
    steps = [e for e in events if e.get("tid") == 0 and e["ph"] == "X"]
    assert {e["name"] for e in steps} == {"prefill", "decode"}
    assert all({"batch", "forward_ms"} <= e["args"].keys() for e in steps)
    # the steps fall inside the request's decode span: one clock for both processes
    decode = next(e for e in events if e.get("tid") == track and e.get("cat") == "engine")
    assert all(decode["ts"] <= e["ts"] <= decode["ts"] + decode["dur"] for e in steps), (decode, steps)
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in events if e["ph"] == "X")
