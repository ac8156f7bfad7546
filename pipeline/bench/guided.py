"""guided: time per output token with a JSON-schema grammar ÷ without, batch 1, 8 and 32.

Drives the decode engine directly (no request pipeline) with the same prompts and the same output
lengths: the guided run goes first, under a schema whose shortest valid output is longer than
``--steps`` tokens (so every sequence runs to ``max_tokens``), then the plain run uses
``ignore_eos`` and ``max_tokens`` equal to the guided sequences' lengths. TPOT is the median time
of the decode steps that ran the whole batch: prefill and the ramp-up while the batch fills are
excluded. The step timeline shows what overlaps the forward pass (the bitmask fill) and what adds
to it (apply, sample, accept).
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
from pipeline.config import PipelineConfig, default_cache_dir
from pipeline.engine_factory import build_llm_engine
from sampling.engine import LLMEngine, StepTiming
from sampling.inputs import EngineInput
from sampling.params import SamplingParams
from vision.checkpoint import open_checkpoint

__all__ = ["add_arguments", "guided_schema", "run", "run_guided"]

PARTS = ("forward", "fill", "wait", "apply", "sample", "copy", "accept", "total")


def guided_schema(num_fields: int) -> dict[str, Any]:
    """Required string fields, each at least one token: no valid output is shorter than ``num_fields``."""
    names = [f"field_{i}" for i in range(num_fields)]
    return {
        "type": "object",
        "properties": {name: {"type": "string"} for name in names},
        "required": names,
        "additionalProperties": False,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=64, help="tokens generated per sequence")
    parser.add_argument("--repeats", type=int, default=3, help="runs per batch size; the median is reported")
    parser.add_argument("--torch-threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    parser.add_argument("--out", default=None, help="folder for guided.json and guided.png")


def _run_once(
    engine: LLMEngine, prompts: list[list[int]], grammar: Any, lengths: list[int], tag: str
) -> tuple[list[StepTiming], list[int]]:
    """Full-batch decode steps of one run, and each sequence's number of generated tokens."""
    engine.timeline.clear()
    for i, (prompt, length) in enumerate(zip(prompts, lengths, strict=True)):
        params = SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=grammar is None)
        engine.add(EngineInput(f"{tag}-{i}", prompt, 10, None, params, grammar))
    generated = [0] * len(prompts)
    while engine.has_work():
        for out in engine.step():
            if out.finish_reason not in (None, "length"):
                raise RuntimeError(f"{out.request_id} ended with {out.finish_reason}: the lengths would differ")
            generated[int(out.request_id.rsplit("-", 1)[1])] += len(out.token_ids)
    return [t for t in engine.timeline if t.kind == "decode" and t.batch == len(prompts)], generated


def _means(steps: list[StepTiming]) -> dict[str, float]:
    return {p: statistics.fmean(getattr(t, p) for t in steps) * 1000 if steps else 0.0 for p in PARTS}


def run_guided(args: argparse.Namespace) -> dict[str, Any]:
    """Run the scenario; print its tables and return ``{"scenario": "guided", "results": [...]}``."""
    import xgrammar as xgr

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    checkpoint = open_checkpoint(None, default_cache_dir())
    tokenizer = checkpoint.tokenizer
    batches = [int(b) for b in args.batches.split(",")]
    config = PipelineConfig(
        max_running_seqs=max(batches),
        max_model_len=1024,
        kv_block_size=16,
        num_kv_blocks=max(batches) * (-(-(args.steps + 64) // 16)),  # prompt (< 64 tokens) + steps, each sequence
    )
    engine = build_llm_engine(checkpoint, config, device=device, record_timeline=True)
    grammar = xgr.GrammarCompiler(checkpoint.tokenizer_info).compile_json_schema(
        json.dumps(guided_schema(args.steps + 1)), any_whitespace=False, strict_mode=True
    )
    results, timelines = [], {}
    with tqdm(total=len(batches) * args.repeats * 2, desc="guided", file=sys.stderr) as progress:
        for batch in batches:
            prompts = [
                tokenizer.encode(f"[INST]Write note {i} about the sea.[/INST]", add_special_tokens=False)
                for i in range(batch)
            ]
            _run_once(engine, prompts, grammar, [4] * batch, "warm")
            plain_tpot, guided_tpot, plain_steps, guided_steps = [], [], [], []
            for r in range(args.repeats):
                guided, lengths = _run_once(engine, prompts, grammar, [args.steps] * batch, f"g{batch}-{r}")
                plain, plain_lengths = _run_once(engine, prompts, None, lengths, f"p{batch}-{r}")
                assert plain_lengths == lengths == [args.steps] * batch, (lengths, plain_lengths)
                guided_tpot.append(median([t.total for t in guided]))
                plain_tpot.append(median([t.total for t in plain]))
                guided_steps += guided
                plain_steps += plain
                progress.update(2)
            tp, tg = median(plain_tpot), median(guided_tpot)
            timelines[f"{batch} guided"], timelines[f"{batch} plain"] = _means(guided_steps), _means(plain_steps)
            results.append(
                {
                    "batch": batch,
                    "tpot_ms_plain": round(tp * 1000, 3),
                    "tpot_ms_guided": round(tg * 1000, 3),
                    "ratio": round(tg / tp, 3),
                    "fill_ms": round(timelines[f"{batch} guided"]["fill"], 3),
                    "wait_ms": round(timelines[f"{batch} guided"]["wait"], 3),
                    "full_batch_steps": len(guided_steps) // args.repeats,
                }
            )
    threads = torch.get_num_threads()
    print(
        f"\nguided: {args.steps} tokens per sequence, greedy, median of {args.repeats} runs, "
        f"{device}, torch threads {threads}, {machine()}"
    )
    print_table(
        ["batch", "TPOT plain ms", "TPOT guided ms", "ratio", "fill ms", "wait ms", "full-batch steps"],
        [[r["batch"], r["tpot_ms_plain"], r["tpot_ms_guided"], r["ratio"], r["fill_ms"], r["wait_ms"],
          r["full_batch_steps"]] for r in results],
    )  # fmt: skip
    print("\nstep timeline (mean ms of full-batch decode steps; fill runs while the forward pass runs)")
    print_table(["run", *PARTS], [[name, *(t[p] for p in PARTS)] for name, t in timelines.items()])
    figures = {"scenario": "guided", "results": results}

    def plot(ax: Any) -> None:
        xs = [str(r["batch"]) for r in results]
        ax.bar([x + " plain" for x in xs], [r["tpot_ms_plain"] for r in results])
        ax.bar([x + " guided" for x in xs], [r["tpot_ms_guided"] for r in results])
        ax.set_ylabel("time per output token (ms)")

    extra = {"timeline_ms": timelines, "machine": machine(), "torch_threads": threads, "device": device}
    write_outputs(args.out, "guided", {**figures, **extra}, plot)
    return figures


run = run_guided  # the name ``python -m pipeline bench`` calls
