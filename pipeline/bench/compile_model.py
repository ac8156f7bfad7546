"""compile-model: the decode step eager ÷ compiled (torch.compile), batch 1, 8 and 32, on the embedded
model (2 layers) and a deeper one of the same family (8 layers, seeded random weights, written once).

Per model: decode TPOT of two engines over the same checkpoint, one eager and one compiled
(``PipelineConfig.compile_model``), in interleaved pairs whose order alternates (a pair's ratio is
compiled ÷ eager, the median over pairs is reported with its min and max); operators launched per
decode step at B = 8 for both implementations (pipeline/bench/compile_probe.py), and per layer as
the difference between the two models ÷ their difference in layers; compile seconds of a new
process with an empty and with a warm inductor cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from pipeline.bench.common import add_torch_arguments, load_average, machine, print_table, torch_device
from pipeline.bench.compile_probe import count_step_ops, time_start
from pipeline.bench.impl import figures_per_batch, id_prompts, pairs_config
from pipeline.config import default_cache_dir
from pipeline.engine.factory import build_llm_engine
from sampling.families import build_runner
from vision.checkpoint import Checkpoint, open_checkpoint
from vision.default_checkpoint import EMBEDDED_SHAPE, write_pixtral_checkpoint
from vision.written_once import written_once

__all__ = ["add_arguments", "run"]

DEEP_LAYERS = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument(
        "--steps", type=int, default=64, help="tokens generated per sequence (must outlast the batch's admission)"
    )
    parser.add_argument("--pairs", type=int, default=5, help="interleaved (eager, compiled) pairs per batch")
    parser.add_argument("--impl", default="native", choices=["native", "transformers"], help="runner timed")
    parser.add_argument("--no-start", action="store_true", help="skip the cold/warm start measurement")
    add_torch_arguments(parser)


def deep_checkpoint(cache_dir: Path) -> Path:
    """The embedded model's shape with ``DEEP_LAYERS`` layers, written once under ``cache_dir``."""
    shape = dataclasses.replace(EMBEDDED_SHAPE, layers=DEEP_LAYERS)
    target = cache_dir / f"bench-pixtral-deep{DEEP_LAYERS}-v1"

    def write(folder: Path) -> None:
        write_pixtral_checkpoint(folder, shape, seed=7)
        (folder / "BENCH_DEEP").write_text("seed=7\n")

    return written_once(target, "BENCH_DEEP", write)


def _ops(checkpoint: Checkpoint) -> dict[str, int]:
    """Operators per decode step at B = 8: ``{impl}_{eager|compiled}``, counted on the CPU (the count
    is the same on any device; a GPU's Triton launches are not the calls counted here)."""
    ops = {}
    for impl in ("native", "transformers"):
        runner = build_runner(checkpoint, impl=impl, device="cpu", max_model_len=1024, num_blocks=64, block_size=16)
        ops[f"{impl}_eager"] = count_step_ops(runner, 8)
        runner.compile_decode()
        ops[f"{impl}_compiled"] = count_step_ops(runner, 8)
    return ops


def _tpots(checkpoint: Checkpoint, args: argparse.Namespace, device: str, progress: Any) -> list[dict[str, Any]]:
    batches = [int(b) for b in args.batches.split(",")]
    engines = {
        mode: build_llm_engine(
            checkpoint, pairs_config(batches, args.steps, model_impl=args.impl, compile_model=on), device=device
        )
        for mode, on in (("eager", "off"), ("compiled", "on"))
    }
    return figures_per_batch(engines, batches, id_prompts, args, progress, "compiled", "eager")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the scenario; print its tables and return ``{"scenario": "compile-model", ...}``."""
    load = [load_average()]
    device = torch_device(args)
    cache = default_cache_dir()
    models = {"embedded": open_checkpoint(None, cache), "deep": open_checkpoint(str(deep_checkpoint(cache)), cache)}
    layers = {"embedded": EMBEDDED_SHAPE.layers, "deep": DEEP_LAYERS}
    num_runs = len(models) * len(args.batches.split(",")) * args.pairs * 2
    figures: dict[str, Any] = {"scenario": "compile-model", "models": {}}
    with tqdm(total=num_runs, desc="compile-model", file=sys.stderr) as progress:
        for name, checkpoint in models.items():
            figures["models"][name] = {
                "layers": layers[name],
                "ops_per_step_b8": _ops(checkpoint),
                "tpot": _tpots(checkpoint, args, device, progress),
            }
    if not args.no_start:
        for name, checkpoint in models.items():
            with tempfile.TemporaryDirectory() as folder:
                cold = time_start(checkpoint.path, Path(folder))
                warm = time_start(checkpoint.path, Path(folder))
            figures["models"][name]["start"] = {"cold_s": cold["compile_s"], "warm_s": warm["compile_s"]}
    load.append(load_average())
    _report(figures, args, device, load)
    return figures


def _report(figures: dict[str, Any], args: argparse.Namespace, device: str, load: list[float]) -> None:
    models = figures["models"]
    print(
        f"\ncompile-model: {args.impl} runner, {args.steps} tokens per sequence, greedy, {args.pairs} interleaved "
        f"pairs per batch, {device}, torch threads {torch.get_num_threads()}, {machine()}, load {load[0]} -> {load[1]}"
    )
    rows = [
        [name, r["batch"], r["tpot_ms_eager"], r["tpot_ms_compiled"], r["ratio"], f"{r['ratio_min']}-{r['ratio_max']}"]
        + [r["cpu_ratio"], f"{r['cpu_ratio_min']}-{r['cpu_ratio_max']}"]
        for name, m in models.items()
        for r in m["tpot"]
    ]
    print_table(["model", "batch", "eager ms", "compiled ms", "ratio", "min-max", "cpu ratio", "min-max"], rows)
    print("(ratio: median over pairs of compiled TPOT ÷ eager TPOT in the same pair; cpu: the process's CPU time")
    print(" per full-batch step, same pairs, less sensitive to other work on a shared machine)")
    deep, small = models["deep"], models["embedded"]
    per_layer = {
        key: (deep["ops_per_step_b8"][key] - small["ops_per_step_b8"][key]) / (deep["layers"] - small["layers"])
        for key in small["ops_per_step_b8"]
    }
    figures["ops_per_layer"] = per_layer
    rows = [
        [key, small["ops_per_step_b8"][key], deep["ops_per_step_b8"][key], round(value, 1)]
        for key, value in per_layer.items()
    ]
    print_table(["runner", "ops/step (2 layers)", f"ops/step ({DEEP_LAYERS} layers)", "ops/layer"], rows)
    if "start" in small:
        rows = [[name, m["start"]["cold_s"], m["start"]["warm_s"]] for name, m in models.items()]
        print_table(["model", "compile s, empty cache", "compile s, warm cache"], rows)
