"""The engine with a prefill cadence: the decode steps between prefills that the scheduler promises,
and the same outputs as without it (it changes when a prefill runs, never what is computed)."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.config import PipelineConfig
from pipeline.engine.factory import build_llm_engine
from tests.sampling.conftest import NewEngine
from tests.sampling.helpers import add, prompt, run_all
from vision.checkpoint import Checkpoint


def _add_burst(engine: Any, tokenizer: Any) -> None:
    """Two long decodes first, then five prompts of growing length (one n=2, one sampled) that prefill beside them."""
    add(engine, "d0", prompt(tokenizer, "decode zero"), max_tokens=100, temperature=0.0, ignore_eos=True)
    add(engine, "d1", prompt(tokenizer, "decode one"), max_tokens=100, temperature=0.0, ignore_eos=True)
    for i in range(5):
        params: dict[str, Any] = {"max_tokens": 3, "temperature": 0.8 * (i % 2), "seed": i, "ignore_eos": True}
        if i == 2:
            params["n"] = 2
        add(engine, f"b{i}", prompt(tokenizer, "x " * (i * 40 + 1)), **params)


@pytest.mark.parametrize("one_step_ahead", [False, True], ids=["sync", "ahead"])
def test_prefills_keep_the_cadence_and_outputs_do_not_change(
    new_engine: NewEngine, hf_tokenizer: Any, one_step_ahead: bool
) -> None:
    base = new_engine(chunk_tokens=64, chunk_tokens_with_decodes=16, one_step_ahead=one_step_ahead)
    _add_burst(base, hf_tokenizer)
    expected = run_all(base)
    engine = new_engine(
        chunk_tokens=64, chunk_tokens_with_decodes=16, one_step_ahead=one_step_ahead, decode_steps_per_prefill=3
    )
    _add_burst(engine, hf_tokenizer)
    outputs = run_all(engine)
    assert {k: o.token_ids for k, o in outputs.items()} == {k: o.token_ids for k, o in expected.items()}
    assert len(outputs) == 8 and all(o.finish_reason == "length" for o in outputs.values())
    assert _gaps(engine) == {3}  # every prefill after the first waits exactly 3 decode steps
    assert _gaps(base) == {1}  # without the cadence, prefill and decode steps alternate


def _gaps(engine: Any) -> set[int]:
    """The decode steps between consecutive prefill steps, after the first prefill (from then on
    the first request always decodes)."""
    prefills = [i for i, t in enumerate(engine.timeline) if t.kind == "prefill"]
    assert len(prefills) >= 8  # the second decode's and the burst's chunks
    return {b - a - 1 for a, b in zip(prefills, prefills[1:], strict=False)}


def test_the_pipeline_config_reaches_the_scheduler(checkpoint: Checkpoint) -> None:
    config = PipelineConfig(decode_steps_per_prefill=3, max_running_seqs=2, num_kv_blocks=64)
    assert build_llm_engine(checkpoint, config, device="cpu").scheduler.decode_steps_per_prefill == 3
    with pytest.raises(ValueError, match="decode_steps_per_prefill"):
        PipelineConfig(decode_steps_per_prefill=0)
