from __future__ import annotations

from typing import Any

import torch

from sampling.detokenizer import TokenBytes
from sampling.engine import LLMEngine
from sampling.inputs import EngineInput, SeqOutput
from sampling.model_runner import ModelRunner
from sampling.params import SamplingParams
from sampling.scheduler import DecodeStep, PrefillBatch, PrefillStep, Scheduler

# the schema of the ``json_grammar`` fixture (conftest.py)
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
SEEDED = {"temperature": 0.8, "top_p": 0.9, "top_k": 50}
IMAGE_TOKEN = 10
NUM_BLOCKS = 1024  # x 16 tokens; the tiny model's cache is 8 KiB a block
EOS = [2]


def make_engine(runner: ModelRunner, token_bytes: TokenBytes, **overrides: Any) -> LLMEngine:
    """A fresh engine over ``runner``: EOS ``[2]``, ``NUM_BLOCKS`` blocks, 16 running; ``overrides`` go to LLMEngine."""
    kwargs: dict[str, Any] = {"eos_token_ids": EOS, "num_blocks": NUM_BLOCKS, "max_running": 16, **overrides}
    return LLMEngine(runner, token_bytes, **kwargs)


def reference_logits(reference: Any, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits ``[T, vocab]`` of the whole sequence ``ids`` (the ``reference`` fixture's model)."""
    with torch.inference_mode():
        return reference(input_ids=ids[None]).logits[0]


def prompt(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(f"<s>[INST]{text}[/INST]", add_special_tokens=False)


def add(
    engine: LLMEngine, request_id: str, ids: list[int], grammar: Any = None, trigger: int | None = None, **params: Any
) -> None:
    engine.add(EngineInput(request_id, ids, IMAGE_TOKEN, None, SamplingParams(**params), grammar, trigger))


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
            if out.logprobs is not None:
                m.logprobs = (m.logprobs or []) + out.logprobs
            m.finish_reason, m.error, m.error_kind = out.finish_reason, out.error, out.error_kind
    raise AssertionError("the engine did not become idle")


def scheduler_steps(scheduler: Scheduler, num_steps: int) -> list[tuple[Any, ...]]:
    """Run ``num_steps`` of ``scheduler``'s steps as the engine would (K/V computed, a token sampled
    where one is): ("prefill", seq, start, end), ("prefills", (seq, start, end)...) for a batch of
    chunks, ("mixed", (decoding seqs...), (seq, start, end)...) for decodes in its forward, and
    ("decode", seqs...) in order."""
    ran: list[tuple[Any, ...]] = []
    for _ in range(num_steps):
        step = scheduler.schedule().step
        if isinstance(step, PrefillStep | PrefillBatch):
            chunks = [step] if isinstance(step, PrefillStep) else step.chunks
            if isinstance(step, PrefillStep):
                ran.append(("prefill", step.seq.seq_id, step.start, step.end))
            elif step.decodes:
                ran.append(
                    ("mixed", tuple(s.seq_id for s in step.decodes), *((c.seq.seq_id, c.start, c.end) for c in chunks))
                )
                for s in step.decodes:
                    s.num_computed = s.num_tokens
                    s.output_ids.append(1)
            else:
                ran.append(("prefills", *((c.seq.seq_id, c.start, c.end) for c in chunks)))
            for chunk in chunks:
                chunk.seq.num_computed = chunk.end
                if chunk.is_last_chunk:
                    chunk.seq.output_ids.append(1)
        else:
            assert isinstance(step, DecodeStep)
            ran.append(("decode", *(s.seq_id for s in step.seqs)))
            for s in step.seqs:
                s.num_computed = s.num_tokens
                s.output_ids.append(1)
    return ran


NUM_TIGHT_BLOCKS = 7  # x 16 tokens: the five requests of ``two_rounds_tokens`` (2-3 blocks each) cannot all fit


def two_rounds_tokens(engine: LLMEngine, tokenizer: Any, grammar: Any, *, n: int = 1) -> dict[str, list[int]]:
    """Two rounds of the same requests (guided greedy, guided seeded, plain greedy, free seeded with
    ``n`` choices) through ``engine``, built with ``NUM_TIGHT_BLOCKS`` (preemptions in the first round),
    the second round on the first one's cached prefixes; every sequence's tokens, by "request/index"."""
    tokens: dict[str, list[int]] = {}
    for round_ in range(2):
        for i in range(2):
            add(engine, f"g{i}-{round_}", prompt(tokenizer, f"guided {i} " * 6), grammar, max_tokens=16, temperature=0)
        add(engine, f"s{round_}", prompt(tokenizer, "seeded"), grammar, max_tokens=16, seed=5, **SEEDED)
        add(engine, f"p{round_}", prompt(tokenizer, "plain " * 8), max_tokens=16, temperature=0.0, ignore_eos=True)
        add(engine, f"q{round_}", prompt(tokenizer, "free"), max_tokens=16, seed=7, n=n, ignore_eos=True, **SEEDED)
        seqs = engine.requests.sequences()
        for (request_id, index), out in run_all(engine).items():
            assert out.finish_reason in ("stop", "length"), out
            tokens[f"{request_id}/{index}"] = out.token_ids
        if round_ == 0:
            assert sum(s.num_preemptions for s in seqs) > 0
    assert engine.scheduler.allocator.stats.hits > 0
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_blocks
    return tokens
