"""prep: prepared requests/s through Pipeline.prepare(), CPU-seconds per request per stage.

Efficiency = achieved req/s ÷ (cores ÷ CPU-seconds per request): 1.0 means every core was busy
with preparation work. CPU counts the serving process and, in process mode, its preparation
workers. The load runs with preparation in worker processes, in threads, and in threads with
(practically) unlimited concurrency, in one invocation.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

import anyio
from tqdm import tqdm

from pipeline.bench.common import (
    DistinctImages,
    ImageServer,
    add_model_argument,
    children_cpu_seconds,
    jpeg_data_url,
    load_average,
    machine,
    median,
    print_table,
    tracer_for,
    write_outputs,
)
from pipeline.config import PipelineConfig
from pipeline.core.pipeline import Pipeline

__all__ = ["add_arguments", "run"]

KINDS = ("text", "base64", "http")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--requests", type=int, default=64, help="requests per kind and run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vision-threads", type=int, default=None, help="vision_encode_threads (default: config)")
    parser.add_argument("--out", default=None)


@dataclass(frozen=True)
class _Images:
    """Every image of a run as base64 and as an http URL: image ``i`` goes to request ``i`` alone, so
    none is an encoder-cache hit and each request's preparation runs whole."""

    data_urls: list[str]
    http_urls: list[str]


def _body(kind: str, i: int, images: _Images) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": f"Describe picture number {i} in detail."}]
    if kind != "text":
        url = images.data_urls[i] if kind == "base64" else images.http_urls[i]
        content.append({"type": "image_url", "image_url": {"url": url}})
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 1}


def _stage_cpu(pipe: Pipeline) -> dict[str, float]:
    assert pipe.preparation.vision is not None
    return {
        "decode": pipe.preparation.decode.cpu_seconds,  # process mode: the workers' (encoder included)
        "template": pipe.preparation.template.offload.cpu_seconds,
        "vision": pipe.preparation.vision.offload.cpu_seconds,
    }


def _cpu(pipe: Pipeline) -> float:
    """CPU seconds of this process and of the preparation workers."""
    pool = pipe.preparation.pool
    return time.process_time() + (children_cpu_seconds(pool.pids()) if pool is not None else 0.0)


async def _one_run(pipe: Pipeline, kind: str, n: int, images: _Images, first: int) -> dict[str, float]:
    cpu_before, stages_before = _cpu(pipe), _stage_cpu(pipe)
    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(pipe.prepare, _body(kind, first + i, images))
    wall = time.perf_counter() - started
    cpu = _cpu(pipe) - cpu_before
    stages = {k: (v - stages_before[k]) / n for k, v in _stage_cpu(pipe).items()}
    per_request = cpu / n
    cores = os.cpu_count() or 1
    return {
        "req_per_s": n / wall,
        "cpu_s_per_request": per_request,
        "efficiency": (n / wall) / (cores / per_request),
        **{f"cpu_{k}": v for k, v in stages.items()},
        "cpu_loop_and_other": per_request - sum(stages.values()),
    }


async def _measure(config: PipelineConfig, args: argparse.Namespace, images: _Images, progress: Any) -> dict:
    out: dict[str, dict[str, float]] = {}
    async with Pipeline(config, with_engine=False, tracer=tracer_for(args)) as pipe:
        workers = config.num_prep_workers()
        async with anyio.create_task_group() as tg:  # warm-up: every worker started
            for i in range(workers):
                tg.start_soon(pipe.prepare, _body("base64", i, images))
        first = workers  # images are never reused within one pipeline (its encoder cache would hit)
        for kind in KINDS:
            runs = []
            for _ in range(args.repeats):
                runs.append(await _one_run(pipe, kind, args.requests, images, first))
                first += args.requests
                progress.update()
            out[kind] = {key: median([r[key] for r in runs]) for key in runs[0]}
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    base = PipelineConfig(
        model=args.model, allow_private_networks=True, max_pending_requests=4096, stage_queue_size=4096
    )
    if args.vision_threads is not None:
        base = replace(base, vision_encode_threads=args.vision_threads)
    unlimited = replace(base, decode_threads=64, template_threads=64, fetch_concurrency=1024)
    setups = {
        "process": replace(base, preparation_mode="process"),
        "thread": replace(base, preparation_mode="thread"),
        "thread, unlimited": replace(unlimited, preparation_mode="thread"),
    }
    load_before = load_average()

    num_images = max(c.num_prep_workers() for c in setups.values()) + len(KINDS) * args.repeats * args.requests
    jpegs = DistinctImages().jpegs(0, num_images)

    async def main() -> dict[str, Any]:
        async with ImageServer(jpegs) as server:
            images = _Images([jpeg_data_url(j) for j in jpegs], [server.url_for(i) for i in range(num_images)])
            with tqdm(total=len(setups) * len(KINDS) * args.repeats, desc="prep", file=sys.stderr) as progress:
                return {name: await _measure(config, args, images, progress) for name, config in setups.items()}

    result = anyio.run(main)
    print(
        f"\nprep: {args.requests} concurrent requests per kind (each image distinct), median of {args.repeats} runs, "
        f"vision_encode_threads={base.vision_encode_threads}, {machine()}, load {load_before} -> {load_average()}"
    )
    headers = ["kind", "setup", "req/s", "CPU ms/req", "decode", "template", "vision", "loop+other", "efficiency"]
    rows = []
    for kind in KINDS:
        for name in setups:
            r = result[name][kind]
            rows.append(
                [
                    kind,
                    name,
                    r["req_per_s"],
                    r["cpu_s_per_request"] * 1000,
                    r["cpu_decode"] * 1000,
                    r["cpu_template"] * 1000,
                    r["cpu_vision"] * 1000,
                    r["cpu_loop_and_other"] * 1000,
                    r["efficiency"],
                ]
            )
    print_table(headers, rows)
    print(
        "(stage columns: thread CPU ms per request; in process mode decode is the workers' job time, vision "
        "encoder included; torch's own worker threads count under loop+other)"
    )
    default = base.preparation_mode
    figures: dict[str, Any] = {
        "scenario": "prep",
        "machine": machine(),
        "mode": default,
        "requests": args.requests,
        "vision_encode_threads": base.vision_encode_threads,
    }
    for kind in KINDS:
        b, u = result[default][kind], result["thread, unlimited"][kind]
        figures[kind] = {
            "req_per_s": round(b["req_per_s"], 2),
            "efficiency": round(b["efficiency"], 3),
            "cpu_s_per_request": round(b["cpu_s_per_request"], 5),
            "cpu_s_per_request_by_stage": {
                k[4:]: round(v, 5) for k, v in b.items() if k.startswith("cpu_") and k != "cpu_s_per_request"
            },
            "unlimited_req_per_s": round(u["req_per_s"], 2),
            "ratio_vs_unlimited": round(b["req_per_s"] / u["req_per_s"], 3),
            "by_setup": {
                name: {"req_per_s": round(r[kind]["req_per_s"], 2), "efficiency": round(r[kind]["efficiency"], 3)}
                for name, r in result.items()
            },
        }

    def plot(ax: Any) -> None:
        stages = ("decode", "template", "vision", "loop_and_other")
        bottom = [0.0] * len(KINDS)
        for stage in stages:
            values = [result[default][k][f"cpu_{stage}"] * 1000 for k in KINDS]
            ax.bar(KINDS, values, bottom=bottom, label=stage)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set_ylabel(f"CPU ms per request ({default} mode)")
        ax.legend()

    write_outputs(args.out, "prep", figures, plot)
    return figures
