"""cadence: running decodes' TPOT ÷ idle and a prompt burst's TTFT per ``decode_steps_per_prefill``.

Drives the synchronous engine core directly (no serving process, no preparation), so every prompt of
the burst is queued at the engine at once: the case the scheduler's prefill cadence is for. Each
round runs the decodes alone (idle), then for every value of k the same decodes with ``--burst``
distinct text prompts of ``--prompt-tokens`` tokens (one output token each) added once the decodes
run; the values alternate within a round, so drift of a shared machine spreads over all of them.
TPOT is the interval between a decode's consecutive tokens (pooled over its streams, median and
p99), TTFT the time from a prompt's ``add()`` to the step that gives its token; figures are medians
over rounds. ``--burst 1`` measures what the cadence costs a lone prompt that arrives beside decodes.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

from tqdm import tqdm

from pipeline.bench.common import (
    add_torch_arguments,
    load_average,
    machine,
    median,
    percentile,
    print_table,
    torch_device,
    write_outputs,
)
from pipeline.config import PipelineConfig, default_cache_dir
from pipeline.engine.factory import build_llm_engine
from sampling.engine import LLMEngine
from sampling.inputs import EngineInput
from sampling.params import SamplingParams
from vision.checkpoint import open_checkpoint

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--values", default="1,2,4,16,64", help="decode_steps_per_prefill values, comma-separated")
    parser.add_argument("--decodes", type=int, default=4, help="running decode requests")
    parser.add_argument("--tokens", type=int, default=256, help="tokens each decode generates")
    parser.add_argument("--burst", type=int, default=64, help="prompts added at once while the decodes run")
    parser.add_argument("--prompt-tokens", type=int, default=740, help="tokens of each burst prompt")
    parser.add_argument("--rounds", type=int, default=3)
    add_torch_arguments(parser)
    parser.add_argument("--out", default=None)


def _once(engine: LLMEngine, args: argparse.Namespace, burst: int, salt: int) -> tuple[list[float], list[float]]:
    """The decodes' token intervals and the burst's TTFTs of one run (``burst`` 0: the decodes alone)."""
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    for i in range(args.decodes):
        engine.add(EngineInput(f"d{i}", [1, 100 + i, 200, 300], 0, None, params))
    added: dict[str, float] = {}
    ttfts: list[float] = []
    last: dict[str, float] = {}
    gaps: list[float] = []
    steps = 0
    while engine.has_work():
        outputs = engine.step()
        now = time.perf_counter()
        steps += 1
        if steps == args.decodes + 1:  # the decodes are prefilled (with k = 1; later ones are held)
            for j in range(burst):  # distinct prompts: no prefix-cache hits
                ids = [1] + [(salt * 7919 + j * 131 + t) % 30000 + 20 for t in range(args.prompt_tokens - 1)]
                engine.add(EngineInput(f"b{j}", ids, 0, None, SamplingParams(max_tokens=1, ignore_eos=True)))
                added[f"b{j}"] = time.perf_counter()
        for out in outputs:
            if out.request_id in added:
                ttfts.append(now - added.pop(out.request_id))
            elif out.token_ids:
                if out.request_id in last:
                    gaps.append(now - last[out.request_id])
                last[out.request_id] = now
    return gaps, ttfts


def run(args: argparse.Namespace) -> dict[str, Any]:
    values = [int(v) for v in args.values.split(",") if v.strip()]
    device = torch_device(args)
    checkpoint = open_checkpoint(None, default_cache_dir())
    config = PipelineConfig(record_step_timeline=False)
    base = build_llm_engine(checkpoint, config, device=device)
    load_before = load_average()
    idle: dict[str, list[float]] = {"p50": [], "p99": []}
    per_k: dict[int, dict[str, list[float]]] = {k: {"p50": [], "p99": [], "t50": [], "t99": []} for k in values}
    with tqdm(total=args.rounds * (1 + len(values)), desc="cadence", file=sys.stderr) as progress:
        for r in range(args.rounds):
            gaps, _ = _once(base, args, 0, r)
            idle["p50"].append(median(gaps))
            idle["p99"].append(percentile(gaps, 99))
            progress.update()
            for k in values:
                with_k = dataclasses.replace(config, decode_steps_per_prefill=k)
                engine = build_llm_engine(checkpoint, with_k, device=device, runner=base.runner)
                gaps, ttfts = _once(engine, args, args.burst, r * 1000 + k)
                res = per_k[k]
                res["p50"].append(median(gaps))
                res["p99"].append(percentile(gaps, 99))
                res["t50"].append(percentile(ttfts, 50))
                res["t99"].append(percentile(ttfts, 99))
                progress.update()
    i50, i99 = median(idle["p50"]), median(idle["p99"])
    print(
        f"\ncadence: {args.decodes} decodes of {args.tokens} tokens,"
        f" {args.burst} prompts of {args.prompt_tokens} tokens at once, median of {args.rounds} rounds,"
        f" {machine()}, load {load_before} -> {load_average()};"
        f" idle TPOT p50 {i50 * 1e3:.2f} ms, p99 {i99 * 1e3:.2f} ms"
    )
    figures: dict[str, Any] = {"scenario": "cadence", "machine": machine(), "idle_p50_ms": round(i50 * 1e3, 3)}
    rows = []
    for k in values:
        m = {name: median(v) for name, v in per_k[k].items()}
        figures[f"k{k}"] = {
            "p50_ratio": round(m["p50"] / i50, 3),
            "p99_ratio": round(m["p99"] / i99, 3),
            "ttft_ms_p50": round(m["t50"] * 1e3, 1),
            "ttft_ms_p99": round(m["t99"] * 1e3, 1),
        }
        f = figures[f"k{k}"]
        ratios = [f["p50_ratio"], f["p99_ratio"], f["ttft_ms_p50"], f["ttft_ms_p99"]]
        rows.append([k, m["p50"] * 1e3, m["p99"] * 1e3, *ratios])
    headers = ["k", "TPOT p50 ms", "p99 ms", "p50 ratio", "p99 ratio", "burst TTFT p50 ms", "p99 ms"]
    print_table(headers, rows)
    write_outputs(args.out, "cadence", figures, None)
    return figures
