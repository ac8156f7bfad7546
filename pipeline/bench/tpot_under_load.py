"""tpot-under-load: time per output token of running decodes while an image burst is prepared ÷ idle.

The decode loop runs on its own thread; preparation work runs in worker threads under limits.
Both share the interpreter (and, on this machine, the two cores), so the ratio shows how much the
preparation burst slows decoding.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import anyio
from tqdm import tqdm

from pipeline.bench.common import (
    jpeg_bytes,
    jpeg_data_url,
    machine,
    median,
    percentile,
    print_table,
    tracer_for,
    write_outputs,
)
from pipeline.config import PipelineConfig
from pipeline.pipeline import Pipeline

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--decodes", type=int, default=4, help="running decode requests")
    parser.add_argument("--tokens", type=int, default=256, help="tokens each decode generates")
    parser.add_argument("--burst", type=int, default=64, help="image requests prepared meanwhile")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)


async def _decode_gaps(
    pipe: Pipeline, n: int, tokens: int, window: list[float], decoding: anyio.Event | None = None
) -> list[tuple[float, float]]:
    """(time, gap) between consecutive tokens of ``n`` concurrent decodes; sets ``decoding`` at the first."""
    gaps: list[tuple[float, float]] = []

    async def one(i: int) -> None:
        body = {"messages": [{"role": "user", "content": f"count {i}"}], "max_tokens": tokens, "ignore_eos": True}
        handle = await pipe.submit(body)
        last = None
        async for _ in handle:
            now = time.perf_counter()
            if last is not None:
                gaps.append((now, now - last))
            elif decoding is not None:
                decoding.set()
            last = now

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
    return [(t, g) for t, g in gaps if not window or window[0] <= t <= window[1]]


async def _burst(pipe: Pipeline, data_url: str, n: int, window: list[float], ready: anyio.Event) -> None:
    await ready.wait()
    window.append(time.perf_counter())
    content = [{"type": "text", "text": "Describe."}, {"type": "image_url", "image_url": {"url": data_url}}]
    async with anyio.create_task_group() as tg:
        for _ in range(n):
            tg.start_soon(pipe.prepare, {"messages": [{"role": "user", "content": content}]})
    window.append(time.perf_counter())


async def _loaded_run(pipe: Pipeline, args: argparse.Namespace, data_url: str) -> list[tuple[float, float]]:
    """The same decodes, with the image burst started once they are all producing tokens."""
    window: list[float] = []
    decoding = anyio.Event()
    loaded: list[tuple[float, float]] = []

    async def decodes() -> None:
        loaded.extend(await _decode_gaps(pipe, args.decodes, args.tokens, window, decoding))

    async with anyio.create_task_group() as tg:
        tg.start_soon(decodes)
        tg.start_soon(_burst, pipe, data_url, args.burst, window, decoding)
    return loaded


def run(args: argparse.Namespace) -> dict[str, Any]:
    data_url = jpeg_data_url(jpeg_bytes())

    async def main() -> dict[str, list[float]]:
        out: dict[str, list[float]] = {"idle": [], "load": [], "idle_gaps": [], "load_gaps": []}
        config = PipelineConfig(max_pending_requests=1024, stage_queue_size=1024)
        async with Pipeline(config, tracer=tracer_for(args)) as pipe:
            await pipe.prepare(
                {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url}}]}]}
            )
            for _ in tqdm(range(args.repeats), desc="tpot-under-load", file=sys.stderr):
                idle = await _decode_gaps(pipe, args.decodes, args.tokens, [])
                loaded = await _loaded_run(pipe, args, data_url)
                out["idle"].append(median([g for _, g in idle]))
                out["load"].append(median([g for _, g in loaded]) if loaded else float("nan"))
                out["idle_gaps"] += [g for _, g in idle]
                out["load_gaps"] += [g for _, g in loaded]
        return out

    res = anyio.run(main)
    idle, load = median(res["idle"]), median(res["load"])
    print(
        f"\ntpot-under-load: {args.decodes} decodes of {args.tokens} tokens, burst of {args.burst} image "
        f"requests, median of {args.repeats}, {machine()}"
    )
    print_table(
        ["case", "TPOT p50 ms", "TPOT p99 ms"],
        [
            ["idle", idle * 1000, percentile(res["idle_gaps"], 99) * 1000],
            ["during burst", load * 1000, percentile(res["load_gaps"], 99) * 1000],
        ],
    )
    figures = {
        "scenario": "tpot-under-load",
        "tpot_ms_idle": round(idle * 1000, 3),
        "tpot_ms_load": round(load * 1000, 3),
        "ratio": round(load / idle, 3),
        "machine": machine(),
    }
    print(f"ratio: {figures['ratio']}")

    def plot(ax: Any) -> None:
        ax.hist([g * 1000 for g in res["idle_gaps"]], bins=50, alpha=0.6, label="idle")
        ax.hist([g * 1000 for g in res["load_gaps"]], bins=50, alpha=0.6, label="during burst")
        ax.set_xlabel("time per output token (ms)")
        ax.legend()

    write_outputs(args.out, "tpot-under-load", figures, plot)
    return figures
