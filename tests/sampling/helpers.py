from __future__ import annotations

from typing import Any

from sampling.engine import LLMEngine
from sampling.inputs import EngineInput, SeqOutput
from sampling.params import SamplingParams

IMAGE_TOKEN = 10


def prompt(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(f"<s>[INST]{text}[/INST]", add_special_tokens=False)


def add(engine: LLMEngine, request_id: str, ids: list[int], grammar: Any = None, **params: Any) -> None:
    engine.add(EngineInput(request_id, ids, IMAGE_TOKEN, None, SamplingParams(**params), grammar))


def run_all(engine: LLMEngine, max_steps: int = 5000) -> dict[tuple[str, int], SeqOutput]:
    """Step until idle; the merged output (all text and tokens, last finish reason) per sequence."""
    merged: dict[tuple[str, int], SeqOutput] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return merged
        for out in engine.step():
            key = (out.request_id, out.index)
            if key not in merged:
                merged[key] = SeqOutput(out.request_id, out.index, [], "", num_prompt_tokens=out.num_prompt_tokens)
            m = merged[key]
            m.token_ids += out.token_ids
            m.text += out.text
            m.finish_reason, m.error = out.finish_reason, out.error
    raise AssertionError("the engine did not become idle")
