"""overload: ten times the pipeline's capacity submitted at once; every request is accounted for.

accepted + refused = submitted; every accepted request ends completed, failed or cancelled
(``lost`` counts those that did not); peak RSS shows memory stays bounded.
"""

from __future__ import annotations

import argparse
import resource
import sys
from typing import Any

import anyio
from tqdm import tqdm

from pipeline.answer.handle import RequestHandle
from pipeline.bench.common import jpeg_bytes, jpeg_data_url, machine, print_table, tracer_for, write_outputs
from pipeline.config import PipelineConfig
from pipeline.core.pipeline import Pipeline
from pipeline.errors import Overloaded, PipelineError, RequestCancelled

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--capacity", type=int, default=32, help="max_pending_requests of the pipeline")
    parser.add_argument("--factor", type=int, default=10)
    parser.add_argument(
        "--engine-mode",
        choices=("process", "thread"),
        default=PipelineConfig().engine_mode,
        help="the engine in its own process or on a thread (default: %(default)s)",
    )
    parser.add_argument(
        "--engine-queue-size",
        type=int,
        default=PipelineConfig().engine_queue_size,
        help="commands in flight to the engine; below the capacity, prepared requests wait for room",
    )
    parser.add_argument("--out", default=None)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def run(args: argparse.Namespace) -> dict[str, Any]:
    data_url = jpeg_data_url(jpeg_bytes())
    submitted = args.capacity * args.factor
    counts = {"accepted": 0, "refused": 0, "completed": 0, "failed": 0, "cancelled": 0}
    rss: dict[str, float] = {}

    async def main() -> None:
        config = PipelineConfig(
            max_pending_requests=args.capacity,
            stage_queue_size=args.capacity,
            engine_mode=args.engine_mode,
            engine_queue_size=args.engine_queue_size,
        )
        async with Pipeline(config, tracer=tracer_for(args)) as pipe:
            rss["start_mb"] = _rss_mb()
            handles: list[RequestHandle] = []
            for i in range(submitted):
                content: list[dict[str, Any]] = [{"type": "text", "text": f"request {i}"}]
                if i % 2 == 0:
                    content.append({"type": "image_url", "image_url": {"url": data_url}})
                body = {"messages": [{"role": "user", "content": content}], "max_tokens": 16, "ignore_eos": True}
                try:
                    handles.append(await pipe.submit(body))
                    counts["accepted"] += 1
                except Overloaded:
                    counts["refused"] += 1
            for handle in handles[9::10]:
                handle.cancel()  # some clients give up at once
            for handle in tqdm(handles, desc="overload", file=sys.stderr):
                try:
                    await handle.result()
                    counts["completed"] += 1
                except RequestCancelled:
                    counts["cancelled"] += 1
                except PipelineError:
                    counts["failed"] += 1
            rss["peak_mb"] = _rss_mb()
            await pipe.wait_idle()

    anyio.run(main)
    lost = counts["accepted"] - counts["completed"] - counts["failed"] - counts["cancelled"]
    print(
        f"\noverload: {submitted} requests (half with a 1024x768 image) at capacity {args.capacity}, "
        f"engine {args.engine_mode} (queue {args.engine_queue_size}), {machine()}"
    )
    print_table(list(counts) + ["lost", "peak RSS MB"], [[*counts.values(), lost, rss["peak_mb"]]])
    figures = {
        "scenario": "overload",
        "submitted": submitted,
        "engine_mode": args.engine_mode,
        "engine_queue_size": args.engine_queue_size,
        **counts,
        "lost": lost,
        "rss_start_mb": round(rss["start_mb"], 1),
        "peak_rss_mb": round(rss["peak_mb"], 1),
        "machine": machine(),
    }

    def plot(ax: Any) -> None:
        names = ["accepted", "refused", "completed", "failed", "cancelled"]
        ax.bar(names + ["lost"], [counts[n] for n in names] + [lost])
        ax.set_ylabel("requests")

    write_outputs(args.out, "overload", figures, plot)
    return figures
