"""decode-buffers: the decode step with its inputs in buffers allocated once, batches padded to buckets
(``PipelineConfig.decode_buffers``) ÷ the step built at its own size, on the embedded model and the
8-layer one of compile-model.

The price of a capturable step where nothing is captured: what padding costs (a batch of 5 runs as 8,
of 12 as 16, every key length as a power-of-two count of blocks) and what building the inputs in place
saves. Per model and batch size: two engines over one runner, with and without buffers, in interleaved
pairs whose order alternates (bench impl's method); a pair's ratio is buffered ÷ today's TPOT, the
median over pairs is reported with its min and max. ``--compile``: both engines' forward compiled.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

import torch
from tqdm import tqdm

from pipeline.bench.common import add_torch_arguments, load_average, machine, print_table, torch_device
from pipeline.bench.compile_model import deep_checkpoint
from pipeline.bench.impl import figures_per_batch, id_prompts, pairs_config
from pipeline.config import default_cache_dir
from pipeline.engine.factory import build_llm_engine
from vision.checkpoint import Checkpoint, open_checkpoint

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", default="1,5,8,12,32", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=64, help="tokens generated per sequence")
    parser.add_argument("--pairs", type=int, default=5, help="interleaved (today, buffered) pairs per batch")
    parser.add_argument("--compile", action="store_true", help="both engines' decode forward compiled")
    parser.add_argument("--models", default="embedded,deep", help="comma-separated: embedded, deep")
    add_torch_arguments(parser)


def _tpots(checkpoint: Checkpoint, args: argparse.Namespace, device: str, progress: Any) -> list[dict[str, Any]]:
    batches = [int(b) for b in args.batches.split(",")]
    config = pairs_config(batches, args.steps, compile_model="on" if args.compile else "off")
    today = build_llm_engine(checkpoint, config, device=device)
    buffered = build_llm_engine(
        checkpoint, dataclasses.replace(config, decode_buffers=True), device=device, runner=today.runner
    )
    engines = {"today": today, "buffered": buffered}
    return figures_per_batch(engines, batches, id_prompts, args, progress, "buffered", "today")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the scenario; print its table and return ``{"scenario": "decode-buffers", ...}``."""
    load = [load_average()]
    device = torch_device(args)
    cache = default_cache_dir()
    paths = {"embedded": None, "deep": str(deep_checkpoint(cache))}
    names = args.models.split(",")
    num_runs = len(names) * len(args.batches.split(",")) * args.pairs * 2
    figures: dict[str, Any] = {"scenario": "decode-buffers", "compiled": args.compile, "models": {}}
    with tqdm(total=num_runs, desc="decode-buffers", file=sys.stderr) as progress:
        for name in names:
            checkpoint = open_checkpoint(paths[name], cache)
            figures["models"][name] = _tpots(checkpoint, args, device, progress)
    load.append(load_average())
    print(
        f"\ndecode-buffers: {'compiled' if args.compile else 'eager'} forward, {args.steps} tokens per sequence, "
        f"greedy, {args.pairs} interleaved pairs per batch, {device}, torch threads {torch.get_num_threads()}, "
        f"{machine()}, load {load[0]} -> {load[1]}"
    )
    rows = [
        [name, r["batch"], r["tpot_ms_today"], r["tpot_ms_buffered"], r["ratio"], f"{r['ratio_min']}-{r['ratio_max']}"]
        + [r["cpu_ratio"], f"{r['cpu_ratio_min']}-{r['cpu_ratio_max']}"]
        for name, results in figures["models"].items()
        for r in results
    ]
    print_table(["model", "batch", "today ms", "buffered ms", "ratio", "min-max", "cpu ratio", "min-max"], rows)
    print("(ratio: median over pairs of buffered TPOT ÷ today's TPOT in the same pair)")
    return figures
