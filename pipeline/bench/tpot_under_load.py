"""tpot-under-load: time per output token of running decodes while an image burst is prepared ÷ idle.

The decode loop runs on a thread of the serving process (engine thread) or in its own process (engine
process). Image preparation runs in worker processes at low priority (process mode) or in worker
threads of the same interpreter (thread mode). Every pair of modes runs in one invocation, so their
ratios compare like with like. On this machine everything shares two cores.

Two bursts per mode: every request with an image of its own (``distinct``: each is decoded,
processed and encoded) and every request with one image (``repeated``: encoder-cache hits after the
first, so what remains is the serving process's own work per request). The burst's requests are
only prepared; ``--burst-tokens N`` serves each to N tokens, so their prefills share the engine's steps,
and the table adds the burst's time to first token (from each request's submit, p50 and p99 over
the repeats). ``--decode-steps-per-prefill K`` sets the scheduler's prefill cadence beside decodes,
``--prefill-seqs-per-step`` how many sequences' chunks one prefill step may run, ``--mixed-chunk-tokens``
how short chunks must be for the running decodes to join their forward (and the tokens such a mixed
step prefills), and ``--engine-nice`` the engine process's niceness. The load generator is this
process: the burst's requests are submitted to the pipeline in-process, no HTTP client runs beside it.

``--timeline``: the engine records every step, and a second table splits the decodes' time per token,
idle and during the burst, into decode steps, prefill steps and time outside steps
(pipeline/bench/step_timeline.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import anyio
from tqdm import tqdm

from pipeline.bench.common import (
    DistinctImages,
    add_model_argument,
    jpeg_data_url,
    load_average,
    median,
    tracer_for,
)
from pipeline.bench.step_timeline import WindowSteps
from pipeline.bench.tpot_report import report
from pipeline.config import PipelineConfig
from pipeline.core.pipeline import Pipeline

__all__ = ["add_arguments", "run"]

IMAGES = ("distinct", "repeated")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--decodes", type=int, default=4, help="running decode requests")
    parser.add_argument("--tokens", type=int, default=256, help="tokens each decode generates")
    parser.add_argument("--burst", type=int, default=64, help="image requests prepared meanwhile")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="process,thread", help="preparation modes, comma-separated")
    parser.add_argument("--engine-modes", default="process,thread", help="engine modes, comma-separated")
    parser.add_argument("--images", default=",".join(IMAGES), help="distinct, repeated or both, comma-separated")
    parser.add_argument(
        "--burst-tokens", type=int, default=0, help="serve each burst request to this many tokens (0: prepare only)"
    )
    parser.add_argument(
        "--chunk-with-decodes",
        type=int,
        default=PipelineConfig().prefill_chunk_tokens_with_decodes,
        help="prefill_chunk_tokens_with_decodes: a prefill chunk's tokens while sequences decode",
    )
    parser.add_argument(
        "--decode-steps-per-prefill",
        type=int,
        default=PipelineConfig().decode_steps_per_prefill,
        help="decode_steps_per_prefill: decode steps between two prefill chunks while sequences decode",
    )
    parser.add_argument(
        "--prefill-seqs-per-step",
        type=int,
        default=PipelineConfig().prefill_seqs_per_step,
        help="prefill_seqs_per_step: sequences whose prefill chunks share one step (1: one a step)",
    )
    parser.add_argument(
        "--mixed-chunk-tokens",
        type=int,
        default=PipelineConfig().mixed_chunk_tokens,
        help="mixed_chunk_tokens: decodes join a prefill step whose chunks are this short (0: never)",
    )
    parser.add_argument(
        "--engine-nice",
        type=int,
        default=PipelineConfig().engine_process_nice,
        help="engine_process_nice: the engine process's niceness (below 0 needs CAP_SYS_NICE)",
    )
    parser.add_argument(
        "--vision-encoder-placement",
        choices=("auto", "preparation", "engine"),
        default=PipelineConfig().vision_encoder_placement,
        help="vision_encoder_placement of the engine-process runs (the engine-thread runs keep it in preparation)",
    )
    parser.add_argument("--timeline", action="store_true", help="record engine steps; print what the decodes wait for")
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
    end = window[1] if len(window) > 1 else float("inf")  # the burst may outlast the decodes
    return [(t, g) for t, g in gaps if not window or window[0] <= t <= end]


def _image_body(data_url: str) -> dict[str, Any]:
    content = [{"type": "text", "text": "Describe."}, {"type": "image_url", "image_url": {"url": data_url}}]
    return {"messages": [{"role": "user", "content": content}]}


async def _served(pipe: Pipeline, body: dict[str, Any], ttfts: list[float]) -> None:
    """Serve ``body`` to the end; its time to first token goes to ``ttfts``."""
    start = time.perf_counter()
    first = None
    async for _ in await pipe.submit(body):
        if first is None:
            first = time.perf_counter()
            ttfts.append(first - start)


async def _burst(
    pipe: Pipeline,
    data_urls: list[str],
    window: list[float],
    ready: anyio.Event,
    max_tokens: int = 0,
    ttfts: list[float] | None = None,
) -> None:
    """Prepare every image request (``max_tokens`` > 0: serve it too, so its prefill joins the
    engine's steps, and its time to first token goes to ``ttfts``)."""
    await ready.wait()
    window.append(time.perf_counter())
    async with anyio.create_task_group() as tg:
        for data_url in data_urls:
            if max_tokens:
                body = _image_body(data_url) | {"max_tokens": max_tokens, "ignore_eos": True}
                tg.start_soon(_served, pipe, body, [] if ttfts is None else ttfts)
            else:
                tg.start_soon(pipe.prepare, _image_body(data_url))
    window.append(time.perf_counter())


async def _loaded_run(
    pipe: Pipeline, args: argparse.Namespace, data_urls: list[str]
) -> tuple[list[tuple[float, float]], list[float], list[float]]:
    """The same decodes, with the image burst started once they are all producing tokens; the
    gaps inside the burst, the burst's start and end, and its served requests' TTFTs."""
    window: list[float] = []
    ttfts: list[float] = []
    decoding = anyio.Event()
    loaded: list[tuple[float, float]] = []

    async def decodes() -> None:
        loaded.extend(await _decode_gaps(pipe, args.decodes, args.tokens, window, decoding))

    async with anyio.create_task_group() as tg:
        tg.start_soon(decodes)
        tg.start_soon(_burst, pipe, data_urls, window, decoding, args.burst_tokens, ttfts)
    return loaded, window, ttfts


async def warm_up(pipe: Pipeline, data_url: str) -> None:
    """Model loaded and every preparation worker started, before any clock starts."""
    async with anyio.create_task_group() as tg:
        for _ in range(pipe.config.num_prep_workers()):
            tg.start_soon(pipe.prepare, _image_body(data_url))


async def _steps(pipe: Pipeline, start: float, end: float) -> WindowSteps:
    """The engine steps that began between ``start`` and ``end``."""
    steps = await pipe.engine.step_timeline(start)
    return WindowSteps(start, end, [s for s in steps if s.start <= end])


async def _measure(
    mode: str, engine_mode: str, args: argparse.Namespace, bursts: dict[str, list[list[str]]], warm_url: str
) -> tuple[dict[str, dict[str, list[float]]], dict[str, dict[str, list[WindowSteps]]]]:
    """Per image kind: idle and loaded TPOT medians and gaps, and the burst's requests/s; and with
    ``--timeline`` the engine's steps in each idle run and each burst."""
    out: dict[str, dict[str, list[float]]] = {
        kind: {"idle": [], "load": [], "idle_gaps": [], "load_gaps": [], "burst_rps": [], "ttft": []} for kind in bursts
    }
    timelines: dict[str, dict[str, list[WindowSteps]]] = {kind: {"idle": [], "burst": []} for kind in bursts}
    config = PipelineConfig(
        model=args.model,
        max_pending_requests=1024,
        stage_queue_size=1024,
        preparation_mode=mode,
        engine_mode=engine_mode,
        record_step_timeline=args.timeline,
        prefill_chunk_tokens_with_decodes=args.chunk_with_decodes,
        decode_steps_per_prefill=args.decode_steps_per_prefill,
        prefill_seqs_per_step=args.prefill_seqs_per_step,
        engine_process_nice=args.engine_nice,
        mixed_chunk_tokens=args.mixed_chunk_tokens,
        vision_encoder_placement=args.vision_encoder_placement if engine_mode == "process" else "preparation",
    )
    async with Pipeline(config, tracer=tracer_for(args)) as pipe:
        await warm_up(pipe, warm_url)
        desc = f"tpot-under-load {mode}, engine {engine_mode}"
        for r in tqdm(range(args.repeats), desc=desc, file=sys.stderr):
            for kind, runs in bursts.items():
                res = out[kind]
                idle = await _decode_gaps(pipe, args.decodes, args.tokens, [])
                if args.timeline and idle:
                    timelines[kind]["idle"].append(await _steps(pipe, idle[0][0], idle[-1][0]))
                loaded, window, ttfts = await _loaded_run(pipe, args, runs[r])
                if args.timeline and loaded:  # the burst while the decodes ran
                    timelines[kind]["burst"].append(await _steps(pipe, window[0], loaded[-1][0]))
                res["idle"].append(median([g for _, g in idle]))
                res["load"].append(median([g for _, g in loaded]) if loaded else float("nan"))
                res["idle_gaps"] += [g for _, g in idle]
                res["load_gaps"] += [g for _, g in loaded]
                res["burst_rps"].append(args.burst / (window[1] - window[0]))
                res["ttft"] += ttfts
    return out, timelines


def _bursts(args: argparse.Namespace, kinds: list[str]) -> tuple[dict[str, list[list[str]]], str]:
    """Each repeat's data URLs per image kind (distinct images never repeat within a pipeline's
    life, whose encoder cache would hit them), and the warm-up's image (the repeated one)."""
    images = DistinctImages()
    urls = [jpeg_data_url(j) for j in images.jpegs(0, 1 + args.burst * args.repeats)]
    every = {
        "distinct": [urls[1 + r * args.burst : 1 + (r + 1) * args.burst] for r in range(args.repeats)],
        "repeated": [[urls[0]] * args.burst for _ in range(args.repeats)],
    }
    return {kind: every[kind] for kind in kinds}, urls[0]


def run(args: argparse.Namespace) -> dict[str, Any]:
    kinds = [k.strip() for k in args.images.split(",") if k.strip()]
    if not kinds or any(k not in IMAGES for k in kinds):
        raise SystemExit(f"--images: choose from {', '.join(IMAGES)}")
    bursts, warm_url = _bursts(args, kinds)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    engine_modes = [m.strip() for m in args.engine_modes.split(",") if m.strip()]
    load_before = load_average()
    # keys "process/engine thread": preparation mode / engine mode
    measured = {
        f"{mode}/engine {engine}": anyio.run(_measure, mode, engine, args, bursts, warm_url)
        for engine in engine_modes
        for mode in modes
    }
    return report(args, kinds, measured, load_before)
