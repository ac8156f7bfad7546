"""guided: time per output token with a JSON-schema grammar ÷ without, batch 1, 8 and 32.

Drives the decode engine directly (no request pipeline): same prompts, same number of steps.
TPOT is the median time of decode steps that ran the full batch (prefill excluded); the plain run
uses ignore_eos so every sequence runs to max_tokens. The step timeline shows which parts of a step
overlap the forward pass (the bitmask fill) and which add to it (apply, sample, accept).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

import torch
from tqdm import tqdm

from pipeline.bench.common import machine, median, print_table, write_outputs
from pipeline.config import default_cache_dir
from sampling.detokenizer import TokenBytes
from sampling.engine import LLMEngine, StepTiming
from sampling.inputs import EngineInput
from sampling.model_runner import ModelRunner
from sampling.params import SamplingParams
from vision.checkpoint import open_checkpoint

__all__ = ["add_arguments", "run"]

# Twelve required string fields: the shortest valid output is longer than --steps tokens, so no
# sequence can finish early and every measured step runs the full batch, as in the plain run.
SCHEMA = {
    "type": "object",
    "properties": {f"field_{i}": {"type": "string"} for i in range(12)},
    "required": [f"field_{i}" for i in range(12)],
    "additionalProperties": False,
}
PARTS = ("forward", "fill", "wait", "apply", "sample", "copy", "accept", "total")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=48, help="tokens generated per sequence")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)


def _run_once(engine: LLMEngine, prompts: list[list[int]], grammar: Any, steps: int, tag: str) -> list[StepTiming]:
    engine.timeline.clear()
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=grammar is None)
        engine.add(EngineInput(f"{tag}-{i}", prompt, 10, None, params, grammar))
    while engine.has_work():
        engine.step()
    return [t for t in engine.timeline if t.kind == "decode" and t.batch == len(prompts)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import xgrammar as xgr

    checkpoint = open_checkpoint(None, default_cache_dir())
    tokenizer = checkpoint.tokenizer
    batches = [int(b) for b in args.batches.split(",")]
    num_blocks = max(batches) * 16
    runner = ModelRunner(
        checkpoint,
        device="cuda" if torch.cuda.is_available() else "cpu",
        max_model_len=1024,
        num_blocks=num_blocks,
        block_size=16,
    )
    engine = LLMEngine(
        runner,
        TokenBytes.from_tokenizer(checkpoint.tokenizer_info, tokenizer),
        eos_token_ids=[2],
        num_blocks=num_blocks,
        max_running=max(batches),
        record_timeline=True,
    )
    grammar = xgr.GrammarCompiler(checkpoint.tokenizer_info).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False
    )
    results, timelines = [], {}
    with tqdm(total=len(batches) * args.repeats * 2, desc="guided", file=sys.stderr) as progress:
        for batch in batches:
            prompts = [
                tokenizer.encode(f"[INST]Write note {i} about the sea.[/INST]", add_special_tokens=False)
                for i in range(batch)
            ]
            _run_once(engine, prompts, grammar, 4, "warm")
            plain_runs, guided_runs, guided_steps, plain_steps = [], [], [], []
            for r in range(args.repeats):
                plain = _run_once(engine, prompts, None, args.steps, f"p{batch}-{r}")
                guided = _run_once(engine, prompts, grammar, args.steps, f"g{batch}-{r}")
                plain_runs.append(median([t.total for t in plain]))
                guided_runs.append(median([t.total for t in guided]) if guided else float("nan"))
                guided_steps += guided
                plain_steps += plain
                progress.update(2)
            tp, tg = median(plain_runs), median(guided_runs)
            timelines[f"{batch} guided"] = {
                p: statistics.fmean(getattr(t, p) for t in guided_steps) * 1000 for p in PARTS
            }
            timelines[f"{batch} plain"] = {
                p: statistics.fmean(getattr(t, p) for t in plain_steps) * 1000 for p in PARTS
            }
            results.append(
                {
                    "batch": batch,
                    "tpot_ms_plain": round(tp * 1000, 3),
                    "tpot_ms_guided": round(tg * 1000, 3),
                    "ratio": round(tg / tp, 3),
                    "full_batch_steps": len(guided_steps) // args.repeats,
                }
            )
    print(f"\nguided: {args.steps} tokens per sequence, greedy, median of {args.repeats} runs, {machine()}")
    print_table(
        ["batch", "TPOT plain ms", "TPOT guided ms", "ratio", "full-batch steps"],
        [[r["batch"], r["tpot_ms_plain"], r["tpot_ms_guided"], r["ratio"], r["full_batch_steps"]] for r in results],
    )
    print("\nstep timeline (mean ms; fill runs while the forward pass runs, wait = forward left after it)")
    print_table(["batch", *PARTS], [[b, *(t[p] for p in PARTS)] for b, t in timelines.items()])
    figures = {"scenario": "guided", "results": results}

    def plot(ax: Any) -> None:
        xs = [str(r["batch"]) for r in results]
        ax.bar([x + " plain" for x in xs], [r["tpot_ms_plain"] for r in results])
        ax.bar([x + " guided" for x in xs], [r["tpot_ms_guided"] for r in results])
        ax.set_ylabel("time per output token (ms)")

    write_outputs(args.out, "guided", {**figures, "timeline_ms": timelines, "machine": machine()}, plot)
    return figures
