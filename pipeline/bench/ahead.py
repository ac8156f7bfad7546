"""ahead: time per output token of the one-step-ahead decode loop ÷ the synchronous loop, batch 1, 8 and 32.

Drives two engines over one model (the same weights and KV cache), one per loop, with the same
prompts and output lengths: plain runs use ``ignore_eos``, guided runs a JSON schema (xgrammar) whose
shortest valid output is longer than ``--steps`` tokens, so every sequence runs to ``max_tokens``. Runs
come in interleaved pairs, the synchronous run and the one-step-ahead run one after the other (their
order alternating between pairs), so drift of a shared machine cancels within a pair; a pair's ratio
is ahead TPOT ÷ synchronous TPOT and the median over pairs is reported with its min and max.

TPOT is wall-clock: the median interval between consecutive ``step()`` calls that each delivered a
token to every sequence of the full batch (prefill and the ramp-up excluded), scheduling included.
The step timeline (means of those steps) shows what overlaps: one step ahead, the host's parts
(prepare, fill, accept, commit) run while the device thread runs the next forward, and ``idle`` is
the device thread waiting for the host.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from typing import Any

import torch
from tqdm import tqdm

from pipeline.bench.common import (
    add_model_argument,
    add_torch_arguments,
    load_average,
    machine,
    median,
    print_table,
    torch_device,
    tracer_for,
    write_outputs,
)
from pipeline.bench.guided import guided_schema
from pipeline.config import PipelineConfig, default_cache_dir
from pipeline.engine.factory import build_llm_engine
from sampling.engine import LLMEngine, StepTiming
from sampling.inputs import EngineInput
from sampling.params import SamplingParams
from vision.checkpoint import open_checkpoint

__all__ = ["add_arguments", "run", "run_ahead"]

DEVICE_PARTS = ("forward", "apply", "sample", "idle")
HOST_PARTS = ("prepare", "fill", "accept", "commit", "wait")
PARTS = (*DEVICE_PARTS, *HOST_PARTS, "total")
LOOPS = ("sync", "ahead")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=64, help="tokens generated per sequence")
    parser.add_argument("--pairs", type=int, default=5, help="interleaved (sync, ahead) pairs per batch and kind")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above 0 every token is sampled")
    add_torch_arguments(parser)
    parser.add_argument("--out", default=None, help="folder for ahead.json and ahead.png")


class ForwardGaps:
    """On CUDA: events around every decode forward, for the device's gap between consecutive forwards
    (the sampling kernels and the time the device waits for the host)."""

    def __init__(self, runner: Any) -> None:
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        forward = runner.decode

        def decode(*args: Any) -> torch.Tensor:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            logits = forward(*args)
            end.record()
            self.events.append((start, end))
            return logits

        runner.decode = decode

    def take(self) -> list[float]:
        """Gaps (s) between the forwards recorded since the last call."""
        torch.cuda.synchronize()
        events, self.events = self.events, []
        return [end.elapsed_time(start) / 1000 for (_, end), (start, _) in zip(events, events[1:], strict=False)]


def _run_once(
    engine: LLMEngine, prompts: list[list[int]], grammar: Any, steps: int, tag: str, temperature: float = 0.0
) -> tuple[float, list[StepTiming]]:
    """TPOT of one run (wall-clock, full-batch steps) and the timeline of its full-batch decode steps."""
    engine.timeline.clear()
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=steps, temperature=temperature, ignore_eos=grammar is None)
        engine.add(EngineInput(f"{tag}-{i}", prompt, 10, None, params, grammar))
    gaps: list[float] = []
    last_full: float | None = None  # when the call before returned, if it gave every sequence a token
    while engine.has_work():
        outputs = engine.step()
        now = time.perf_counter()
        if any(o.finish_reason not in (None, "length") for o in outputs):
            raise RuntimeError(f"a sequence ended early ({outputs}): the loops would not be compared")
        is_full = len(outputs) == len(prompts)
        if is_full and last_full is not None:
            gaps.append(now - last_full)
        last_full = now if is_full else None
    full = [t for t in engine.timeline if t.kind == "decode" and t.batch == len(prompts)]
    return median(gaps), full


def _means(steps: list[StepTiming]) -> dict[str, float]:
    return {p: statistics.fmean(getattr(t, p) for t in steps) * 1000 if steps else 0.0 for p in PARTS}


def _measure_batch(
    engines: dict[str, LLMEngine],
    prompts: list[list[int]],
    grammar: Any,
    args: argparse.Namespace,
    gaps: ForwardGaps | None,
    progress: Any,
) -> tuple[dict[str, Any], dict[str, dict[str, float]]]:
    """One batch size: its result row and the step timeline of each (kind, loop)."""
    batch = len(prompts)
    for engine in engines.values():
        for g in (None, grammar):
            _run_once(engine, prompts, g, 4, "warm")
    gap_log: dict[str, list[float]] = {}
    if gaps is not None:
        gaps.take()
    kinds = {"plain": None, "guided": grammar}
    ratios: dict[str, list[float]] = {kind: [] for kind in kinds}
    tpots: dict[str, list[float]] = {f"{kind} {loop}": [] for kind in kinds for loop in LOOPS}
    logs: dict[str, list[StepTiming]] = {name: [] for name in tpots}
    for pair in range(args.pairs):
        for kind, g in kinds.items():
            order = LOOPS if pair % 2 == 0 else LOOPS[::-1]
            tpot: dict[str, float] = {}
            for loop in order:
                tpot[loop], steps = _run_once(
                    engines[loop], prompts, g, args.steps, f"{kind}{batch}{loop}{pair}", args.temperature
                )
                if not tpot[loop]:
                    # prefills are admitted one a step, so every sequence decodes at once only from the
                    # last prefill until the first sequence ends: steps must outlast the batch's admission
                    raise RuntimeError(f"no two full-batch steps in a row at batch {batch}: raise --steps")
                tpots[f"{kind} {loop}"].append(tpot[loop])
                if gaps is not None:
                    gap_log.setdefault(f"{kind}_{loop}", []).append(median(gaps.take()))
                logs[f"{kind} {loop}"] += steps
                progress.update(1)
            ratios[kind].append(tpot["ahead"] / tpot["sync"])
    row: dict[str, Any] = {"batch": batch}
    for kind in kinds:
        row[f"{kind}_ratio"] = round(median(ratios[kind]), 3)
    for kind in kinds:
        row[f"{kind}_ratio_min"] = round(min(ratios[kind]), 3)
        row[f"{kind}_ratio_max"] = round(max(ratios[kind]), 3)
        for loop in LOOPS:
            row[f"tpot_ms_{kind}_{loop}"] = round(median(tpots[f"{kind} {loop}"]) * 1000, 3)
    for name, values in gap_log.items():
        row[f"gpu_gap_ms_{name}"] = round(median(values) * 1000, 3)
    return row, {f"{batch} {name}": _means(log) for name, log in logs.items()}


def _print_results(results: list[dict[str, Any]], timelines: dict[str, dict[str, float]]) -> None:
    rows = []
    for r in results:
        cells: list[Any] = [r["batch"]]
        for kind in ("plain", "guided"):
            span = f"{r[f'{kind}_ratio_min']:.3f}-{r[f'{kind}_ratio_max']:.3f}"
            cells += [r[f"tpot_ms_{kind}_sync"], r[f"tpot_ms_{kind}_ahead"], r[f"{kind}_ratio"], span]
        cells.append(round(r["guided_ratio"] / r["plain_ratio"], 3))
        rows.append(cells)
    header = ["batch", "plain sync ms", "plain ahead ms", "ratio", "min-max"]
    header += ["guided sync ms", "guided ahead ms", "ratio", "min-max", "guided ÷ plain ratio"]
    print_table(header, rows)
    print("(ratio: median over pairs of one-step-ahead TPOT ÷ synchronous TPOT of the same pair, target ≤ 0.9")
    print(" at batch 8 and 32; TPOT columns: medians of wall-clock TPOT over the pairs)")
    print("\nstep timeline, mean ms of full-batch decode steps")
    print("  sync: every part in turn but fill (on the fill thread, beside the forward)")
    print("  ahead: device thread = forward, apply, sample, idle; host thread = prepare, fill, accept, commit,")
    print("         wait (for the step's tokens), all while the device thread runs the next forward")
    print_table(["run", *PARTS], [[name, *(round(t[p], 3) for p in PARTS)] for name, t in timelines.items()])
    contention = []
    for r in results:
        for kind in ("plain", "guided"):
            sync, ahead = timelines[f"{r['batch']} {kind} sync"], timelines[f"{r['batch']} {kind} ahead"]
            host = sum(ahead[p] for p in HOST_PARTS if p != "wait")
            contention.append([r["batch"], kind, sync["forward"], ahead["forward"], host, ahead["idle"]])
    print("\nCPU contention: the forward alone (sync) and beside the host's work (ahead), in ms")
    print_table(["batch", "kind", "forward sync", "forward ahead", "host work beside it", "device idle"], contention)
    if "gpu_gap_ms_plain_sync" in results[0]:
        gap_rows = []
        for r in results:
            for kind in ("plain", "guided"):
                gap_cells: list[Any] = [r["batch"], kind]
                for loop in LOOPS:
                    gap = r[f"gpu_gap_ms_{kind}_{loop}"]
                    gap_cells += [gap, f"{100 * gap / r[f'tpot_ms_{kind}_{loop}']:.1f}%"]
                gap_rows.append(gap_cells)
        print("\nGPU gap between consecutive forwards (CUDA events: sampling kernels + idle), median ms, % of TPOT")
        print_table(["batch", "kind", "sync", "of TPOT", "ahead", "of TPOT"], gap_rows)


def run_ahead(args: argparse.Namespace) -> dict[str, Any]:
    """Run the scenario; print its tables and return ``{"scenario": "ahead", "results": [...]}``."""
    import xgrammar as xgr

    load = [load_average()]
    device = torch_device(args)
    checkpoint = open_checkpoint(args.model, default_cache_dir())
    batches = [int(b) for b in args.batches.split(",")]
    config = PipelineConfig(
        max_running_seqs=max(batches),
        max_model_len=1024,
        kv_block_size=16,
        num_kv_blocks=max(batches) * (-(-(args.steps + 64) // 16)),  # prompt (< 64 tokens) + steps, each sequence
    )
    tracer = tracer_for(args)  # --trace: every step of both loops, one after the other on the engine's track
    sync = build_llm_engine(checkpoint, config, device=device, record_timeline=True, tracer=tracer)
    ahead_config = dataclasses.replace(config, engine_one_step_ahead=True)
    ahead = build_llm_engine(
        checkpoint, ahead_config, device=device, record_timeline=True, tracer=tracer, runner=sync.runner
    )
    engines = {"sync": sync, "ahead": ahead}
    gaps = ForwardGaps(sync.runner) if device.startswith("cuda") else None
    grammar = xgr.GrammarCompiler(checkpoint.tokenizer_info).compile_json_schema(
        json.dumps(guided_schema(args.steps + 1)), any_whitespace=False, strict_mode=True
    )
    results, timelines = [], {}
    with tqdm(total=len(batches) * args.pairs * 4, desc="ahead", file=sys.stderr) as progress:
        for batch in batches:
            prompts = [
                checkpoint.tokenizer.encode(f"[INST]Write note {i} about the sea.[/INST]", add_special_tokens=False)
                for i in range(batch)
            ]
            row, timeline = _measure_batch(engines, prompts, grammar, args, gaps, progress)
            results.append(row)
            timelines.update(timeline)
    threads = torch.get_num_threads()
    load.append(load_average())
    sampling = f"temperature {args.temperature:g}" if args.temperature else "greedy"
    print(
        f"\nahead: {args.steps} tokens per sequence, {sampling}, {args.pairs} interleaved pairs per batch and kind, "
        f"{device}, torch threads {threads}, {machine()}, load {load[0]} -> {load[1]}"
    )
    _print_results(results, timelines)
    figures = {
        "scenario": "ahead",
        "temperature": args.temperature,
        "results": [{k: r[k] for k in ("batch", "plain_ratio", "guided_ratio")} for r in results],
    }

    def plot(ax: Any) -> None:
        xs = [str(r["batch"]) for r in results]
        ax.plot(xs, [r["plain_ratio"] for r in results], marker="o", label="plain")
        ax.plot(xs, [r["guided_ratio"] for r in results], marker="o", label="guided")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xlabel("batch")
        ax.set_ylabel("TPOT one step ahead ÷ synchronous")
        ax.legend()

    extra = {"details": results, "timeline_ms": timelines, "machine": machine(), "load": load, "device": device}
    write_outputs(args.out, "ahead", {**figures, **extra, "torch_threads": threads}, plot)
    return figures


run = run_ahead  # the name ``python -m pipeline bench`` calls
