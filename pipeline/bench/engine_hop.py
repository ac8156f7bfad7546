"""engine-hop: what the hop to an engine process costs text-only requests, against the engine thread.

Each engine mode serves the same text-only requests, with ``--concurrency`` in flight at a time.
For each mode the bench reports requests/s, time to first token (p50, p99), time per output token,
and the CPU seconds per request of the serving process and of the engine process. The modes
alternate over ``--repeats`` rounds within one invocation, so a machine shared with other work
loads both alike.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import AsyncExitStack
from typing import Any

import anyio
from tqdm import tqdm

from pipeline.bench.common import (
    add_model_argument,
    children_cpu_seconds,
    load_average,
    machine,
    median,
    percentile,
    print_table,
    write_outputs,
)
from pipeline.config import PipelineConfig
from pipeline.core.pipeline import Pipeline
from pipeline.engine.client import ProcessEngine

__all__ = ["add_arguments", "run"]

MODES = ("thread", "process")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--requests", type=int, default=64, help="text-only requests per round")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16, help="tokens each request generates")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)


async def _round(pipe: Pipeline, args: argparse.Namespace, start: int) -> dict[str, Any]:
    """One round of requests; rate, first-token times, token gaps and CPU seconds."""
    ttfts: list[float] = []
    tpots: list[float] = []
    limiter = anyio.CapacityLimiter(args.concurrency)

    async def one(i: int) -> None:
        async with limiter:
            body = {
                "messages": [{"role": "user", "content": f"text request {start + i}: say something"}],
                "max_tokens": args.tokens,
                "ignore_eos": True,
            }
            submitted = time.perf_counter()
            handle = await pipe.submit(body)
            first = last = None
            async for _ in handle:
                last = time.perf_counter()
                first = first or last
            assert first is not None and last is not None
            ttfts.append(first - submitted)
            if args.tokens > 1:
                tpots.append((last - first) / (args.tokens - 1))

    engine = pipe.engine
    pids = [engine.pid] if isinstance(engine, ProcessEngine) and engine.pid is not None else []
    cpu_serving, cpu_engine = time.process_time(), children_cpu_seconds(pids)
    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(args.requests):
            tg.start_soon(one, i)
    elapsed = time.perf_counter() - started
    return {
        "rps": args.requests / elapsed,
        "ttfts": ttfts,
        "tpots": tpots,
        "serving_cpu": (time.process_time() - cpu_serving) / args.requests,
        "engine_cpu": (children_cpu_seconds(pids) - cpu_engine) / args.requests,
    }


async def _measure(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    async with AsyncExitStack() as stack:
        pipes = {}
        for mode in MODES:
            config = PipelineConfig(model=args.model, preparation_mode="thread", engine_mode=mode)
            pipes[mode] = await stack.enter_async_context(Pipeline(config))
        warm = argparse.Namespace(**{**vars(args), "requests": args.concurrency})
        for pipe in pipes.values():  # warm-up: model, template and the first steps
            await _round(pipe, warm, -1000)
        for r in tqdm(range(args.repeats), desc="engine-hop", file=sys.stderr):
            for mode, pipe in pipes.items():
                out[mode].append(await _round(pipe, args, r * args.requests))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    load_before = load_average()
    results = anyio.run(_measure, args)
    print(
        f"\nengine-hop: {args.requests} text-only requests of {args.tokens} tokens, {args.concurrency} at a time, "
        f"median of {args.repeats} rounds (modes alternate), {machine()}, pid {os.getpid()}, "
        f"load {load_before} -> {load_average()}"
    )
    rows, per_mode = [], {}
    for mode, rounds in results.items():
        ttfts = [t for r in rounds for t in r["ttfts"]]
        tpots = [t for r in rounds for t in r["tpots"]]
        per_mode[mode] = {
            "req_per_s": round(median([r["rps"] for r in rounds]), 2),
            "ttft_p50_ms": round(percentile(ttfts, 50) * 1000, 3),
            "ttft_p99_ms": round(percentile(ttfts, 99) * 1000, 3),
            "tpot_p50_ms": round(percentile(tpots, 50) * 1000, 3),
            "serving_cpu_ms_per_request": round(median([r["serving_cpu"] for r in rounds]) * 1000, 3),
            "engine_process_cpu_ms_per_request": round(median([r["engine_cpu"] for r in rounds]) * 1000, 3),
        }
        m = per_mode[mode]
        rows.append([mode, *m.values()])
    headers = ["engine", "req/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "serving CPU ms/req"]
    print_table([*headers, "engine proc CPU ms/req"], rows)
    thread, process = per_mode["thread"], per_mode["process"]
    ratios = {
        "req_per_s_ratio": round(process["req_per_s"] / thread["req_per_s"], 3),
        "ttft_p50_ratio": round(process["ttft_p50_ms"] / thread["ttft_p50_ms"], 3),
    }
    print(f"process / thread: req/s x{ratios['req_per_s_ratio']}, TTFT p50 x{ratios['ttft_p50_ratio']}")
    print("(target: both within 5% of thread mode)")
    figures = {"scenario": "engine-hop", **ratios, "modes": per_mode, "machine": machine()}
    write_outputs(args.out, "engine-hop", figures)
    return figures
