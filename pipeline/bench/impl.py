"""impl: decode time per output token of the adapter (transformers' model over our paged attention)
÷ the hand-written decoder, batch 1, 8 and 32, on the embedded default model.

Two engines over the same checkpoint, one per implementation (``PipelineConfig.model_impl``), with
the same prompts and output lengths (``ignore_eos``, greedy). Runs come in interleaved pairs, the two
implementations one after the other (their order alternating between pairs), so drift of a shared
machine cancels within a pair; a pair's ratio is adapter TPOT ÷ native TPOT and the median over
pairs is reported with its min and max. TPOT is wall-clock: the median interval between consecutive
``step()`` calls that each delivered a token to every sequence of the full batch.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm import tqdm

from pipeline.bench.common import add_torch_arguments, load_average, machine, median, print_table, torch_device
from pipeline.config import PipelineConfig, default_cache_dir
from pipeline.engine.factory import build_llm_engine
from sampling.engine import LLMEngine
from sampling.inputs import EngineInput
from sampling.params import SamplingParams
from vision.checkpoint import open_checkpoint

__all__ = [
    "add_arguments",
    "decode_tpot",
    "figures_per_batch",
    "id_prompts",
    "interleaved_pairs",
    "pair_figures",
    "pairs_config",
    "run",
]

IMPLS = ("native", "transformers")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=64, help="tokens generated per sequence")
    parser.add_argument("--pairs", type=int, default=5, help="interleaved (native, transformers) pairs per batch")
    add_torch_arguments(parser)


def decode_tpot(engine: LLMEngine, prompts: list[list[int]], steps: int, tag: str) -> tuple[float, float]:
    """Median wall-clock interval between full-batch decode steps of one run, and the median
    process CPU time of those intervals (less sensitive to a loaded machine than the wall clock)."""
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
        engine.add(EngineInput(f"{tag}-{i}", prompt, 10, None, params))
    gaps: list[float] = []
    cpu_gaps: list[float] = []
    last_full: tuple[float, float] | None = None
    while engine.has_work():
        outputs = engine.step()
        now = (time.perf_counter(), time.process_time())
        is_full = len(outputs) == len(prompts)
        if is_full and last_full is not None:
            gaps.append(now[0] - last_full[0])
            cpu_gaps.append(now[1] - last_full[1])
        last_full = now if is_full else None
    return median(gaps), median(cpu_gaps)


def interleaved_pairs(
    engines: dict[str, LLMEngine], prompts: list[list[int]], steps: int, pairs: int, progress: Any
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """``pairs`` runs of each of two engines, alternating which goes first, after a warm-up run each:
    the decode TPOT and CPU seconds per token of every run, per engine name."""
    names = list(engines)
    for engine in engines.values():  # warm: first-step costs (a compiled engine compiles its graphs here)
        decode_tpot(engine, prompts, 4, "warm")
    tpots: dict[str, list[float]] = {name: [] for name in names}
    cpus: dict[str, list[float]] = {name: [] for name in names}
    for pair in range(pairs):
        for name in names if pair % 2 == 0 else names[::-1]:
            wall, cpu = decode_tpot(engines[name], prompts, steps, f"{name}{len(prompts)}-{pair}")
            tpots[name].append(wall)
            cpus[name].append(cpu)
            progress.update(1)
    return tpots, cpus


def pair_figures(
    tpots: dict[str, list[float]], cpus: dict[str, list[float]], top: str, bottom: str
) -> dict[str, float]:
    """One batch's figures from ``interleaved_pairs``: each engine's median TPOT and CPU time per step
    (``tpot_ms_NAME``, ``cpu_ms_NAME``), and over the pairs the median, min and max of ``top`` ÷
    ``bottom`` in the same pair, wall clock (``ratio``) and CPU time (``cpu_ratio``)."""
    figures: dict[str, float] = {}
    for kind, times in (("tpot", tpots), ("cpu", cpus)):
        for name in (bottom, top):
            figures[f"{kind}_ms_{name}"] = round(median(times[name]) * 1000, 3)
        ratios = [t / b for t, b in zip(times[top], times[bottom], strict=True)]
        prefix = "" if kind == "tpot" else "cpu_"
        figures[f"{prefix}ratio"] = round(median(ratios), 3)
        figures[f"{prefix}ratio_min"] = round(min(ratios), 3)
        figures[f"{prefix}ratio_max"] = round(max(ratios), 3)
    return figures


def pairs_config(batches: list[int], steps: int, **fields: Any) -> PipelineConfig:
    """An engine's config with room for the largest of ``batches`` sequences of ``steps`` tokens after
    prompts of up to 64 (``fields``: the rest of the config)."""
    return PipelineConfig(
        max_running_seqs=max(batches),
        max_model_len=1024,
        num_kv_blocks=max(batches) * (-(-(steps + 64) // 16)),
        **fields,
    )


def id_prompts(batch: int) -> list[list[int]]:
    """``batch`` distinct 11-token prompts of plain token ids."""
    return [[1, *range(1000 + 7 * i, 1010 + 7 * i)] for i in range(batch)]


def figures_per_batch(
    engines: dict[str, LLMEngine],
    batches: list[int],
    prompts: Callable[[int], list[list[int]]],
    args: argparse.Namespace,
    progress: Any,
    top: str,
    bottom: str,
) -> list[dict[str, Any]]:
    """For each batch size, ``interleaved_pairs`` of the two engines over ``prompts(batch)`` (``args``:
    ``steps`` and ``pairs``) reduced by ``pair_figures`` (``top`` ÷ ``bottom``), with the batch size."""
    results = []
    for batch in batches:
        tpots, cpus = interleaved_pairs(engines, prompts(batch), args.steps, args.pairs, progress)
        results.append({"batch": batch, **pair_figures(tpots, cpus, top, bottom)})
    return results


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the scenario; print its table and return ``{"scenario": "impl", "results": [...]}``."""
    load = [load_average()]
    device = torch_device(args)
    checkpoint = open_checkpoint(None, default_cache_dir())
    batches = [int(b) for b in args.batches.split(",")]
    engines = {
        impl: build_llm_engine(checkpoint, pairs_config(batches, args.steps, model_impl=impl), device=device)
        for impl in IMPLS
    }

    def prompts(batch: int) -> list[list[int]]:
        text = "[INST]Write note {} about the sea.[/INST]"
        return [checkpoint.tokenizer.encode(text.format(i), add_special_tokens=False) for i in range(batch)]

    with tqdm(total=len(batches) * args.pairs * 2, desc="impl", file=sys.stderr) as progress:
        results = figures_per_batch(engines, batches, prompts, args, progress, "transformers", "native")
    load.append(load_average())
    print(
        f"\nimpl: {args.steps} tokens per sequence, greedy, {args.pairs} interleaved pairs per batch, {device}, "
        f"torch threads {torch.get_num_threads()}, {machine()}, load {load[0]} -> {load[1]}"
    )
    rows = [
        [r["batch"], r["tpot_ms_native"], r["tpot_ms_transformers"], r["ratio"], f"{r['ratio_min']}-{r['ratio_max']}"]
        + [r["cpu_ms_native"], r["cpu_ms_transformers"], r["cpu_ratio"], f"{r['cpu_ratio_min']}-{r['cpu_ratio_max']}"]
        for r in results
    ]
    header = ["batch", "native ms", "transformers ms", "ratio", "min-max"]
    print_table([*header, "native cpu ms", "transformers cpu ms", "cpu ratio", "min-max"], rows)
    print("(ratio: median over pairs of the adapter's TPOT ÷ the hand-written decoder's in the same pair; ≤ 1.05")
    print(" retires the hand-written decoder; cpu: the process's CPU time per full-batch step, same pairs)")
    return {"scenario": "impl", "results": [{k: r[k] for k in ("batch", "ratio", "cpu_ratio")} for r in results]}
