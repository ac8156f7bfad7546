"""guided: time per output token with a JSON-schema grammar ÷ without, per backend, batch 1, 8 and 32;
and our guided TPOT ÷ transformers' ``generate`` with xgrammar's logits processor.

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
import statistics
import sys
import time
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
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="interleaved plain-guided pairs per backend and batch size; the median ratio is reported",
    )
    parser.add_argument("--torch-threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers generate() comparison")
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


def _hf_tpot(model: Any, prompts: list[list[int]], grammar: Any, steps: int) -> float:
    """transformers' ``generate`` with xgrammar's logits processor: seconds per output token (the
    time of ``steps`` tokens less that of 2, so prefill is excluded)."""
    from xgrammar.contrib.hf import LogitsProcessor

    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    seconds = {}
    for n in (2, steps):
        with torch.inference_mode():
            started = time.perf_counter()
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                logits_processor=[LogitsProcessor([grammar] * len(prompts))],
                pad_token_id=0,
            )
            seconds[n] = time.perf_counter() - started
    return (seconds[steps] - seconds[2]) / (steps - 2)


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def run_guided(args: argparse.Namespace) -> dict[str, Any]:
    """Run the scenario; print its tables and return ``{"scenario": "guided", "results": [...]}``."""
    import transformers

    from pipeline.preparation import build_grammar_stage
    from pipeline.types import GrammarSpec

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
    spec = GrammarSpec("json_schema", guided_schema(args.steps + 1))
    compilers = build_grammar_stage(config, checkpoint).compilers
    grammars = {name: compiler.compile(spec).grammar for name, compiler in compilers.items()}
    hf_model: Any = None
    if not args.no_hf:
        hf_model = transformers.AutoModelForImageTextToText.from_pretrained(checkpoint.path, dtype=torch.float32)
        hf_model = hf_model.to(device).eval()
    results: list[dict[str, Any]] = []
    timelines: dict[str, dict[str, float]] = {}
    steps_per_repeat = 2 * len(grammars)
    with tqdm(total=len(batches) * args.repeats * steps_per_repeat, desc="guided", file=sys.stderr) as progress:
        for batch in batches:
            prompts = [
                tokenizer.encode(f"[INST]Write note {i} about the sea.[/INST]", add_special_tokens=False)
                for i in range(batch)
            ]
            for grammar in grammars.values():
                _run_once(engine, prompts, grammar, [4] * batch, "warm")
            ratios: dict[str, list[float]] = {name: [] for name in grammars}
            tpots: dict[str, list[float]] = {name: [] for name in (*grammars, "plain")}
            step_log: dict[str, list[StepTiming]] = {name: [] for name in (*grammars, "plain")}
            for r in range(args.repeats):
                # interleaved pairs: each guided run is divided by the plain run just before it, so
                # drift of the machine (other load, thermal) cancels within a pair
                for name, grammar in grammars.items():
                    plain, plain_lengths = _run_once(engine, prompts, None, [args.steps] * batch, f"p{name}{batch}-{r}")
                    guided, lengths = _run_once(engine, prompts, grammar, [args.steps] * batch, f"g{name}{batch}-{r}")
                    assert plain_lengths == lengths == [args.steps] * batch, (name, lengths, plain_lengths)
                    tp, tg = median([t.total for t in plain]), median([t.total for t in guided])
                    ratios[name].append(tg / tp)
                    tpots["plain"].append(tp)
                    tpots[name].append(tg)
                    step_log["plain"] += plain
                    step_log[name] += guided
                    progress.update(2)
            for name, log in step_log.items():
                timelines[f"{batch} {name}"] = _means(log)
            hf = _hf_tpot(hf_model, prompts, grammars["xgrammar"], args.steps) if hf_model is not None else None
            row: dict[str, Any] = {"batch": batch, "tpot_ms_plain": round(median(tpots["plain"]) * 1000, 3)}
            for name in grammars:
                row[f"tpot_ms_{name}"] = round(median(tpots[name]) * 1000, 3)
                row[f"ratio_{name}"] = round(median(ratios[name]), 3)
                row[f"ratio_{name}_spread"] = _spread(ratios[name])
            if hf is not None:
                row["tpot_ms_hf_generate_xgrammar"] = round(hf * 1000, 3)
                row["ours_over_hf"] = round(median(tpots["xgrammar"]) / hf, 3)
            results.append(row)
    threads = torch.get_num_threads()
    print(
        f"\nguided: {args.steps} tokens per sequence, greedy, {args.repeats} interleaved pairs per backend, "
        f"{device}, torch threads {threads}, {machine()}"
    )
    names = list(grammars)
    header = ["batch", "TPOT plain ms"]
    for name in names:
        header += [f"{name} ms", f"{name} ratio", "spread"]
    header += ["HF generate+xgrammar ms", "ours ÷ HF"]
    rows = []
    for result in results:
        cells = [result["batch"], result["tpot_ms_plain"]]
        for name in names:
            cells += [result[f"tpot_ms_{name}"], result[f"ratio_{name}"], result[f"ratio_{name}_spread"]]
        cells += [result.get("tpot_ms_hf_generate_xgrammar", "-"), result.get("ours_over_hf", "-")]
        rows.append(cells)
    print_table(header, rows)
    print("(ratio: median over pairs of guided TPOT ÷ the plain TPOT measured just before it; ours ÷ HF: xgrammar)")
    print("\nstep timeline (mean ms of full-batch decode steps; fill runs while the forward pass runs)")
    print_table(["run", *PARTS], [[name, *(t[p] for p in PARTS)] for name, t in timelines.items()])
    figures = {"scenario": "guided", "results": results}

    def plot(ax: Any) -> None:
        xs = [str(r["batch"]) for r in results]
        ax.bar([x + " plain" for x in xs], [r["tpot_ms_plain"] for r in results])
        for name in names:
            ax.bar([x + f" {name}" for x in xs], [r[f"tpot_ms_{name}"] for r in results])
        ax.set_ylabel("time per output token (ms)")

    extra = {"timeline_ms": timelines, "machine": machine(), "torch_threads": threads, "device": device}
    write_outputs(args.out, "guided", {**figures, **extra}, plot)
    return figures


run = run_guided  # the name ``python -m pipeline bench`` calls
