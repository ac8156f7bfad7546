"""cache: TTFT of repeated images and shared prefixes ÷ first seen; half-repeat throughput, caches on ÷ off.

Three measurements, each a ratio within one invocation:
- repeated image: a request with a never-seen image, then a request with the same image and another
  question (the encoder cache skips decode, processor and encoder; the KV prefix cache the blocks
  before the question). Ratio per repeat: second TTFT ÷ first, then the median.
- shared prefix: a request with a new system prompt and a new image (over 1,000 tokens together),
  then one with the same system prompt and image and another question. Ratio as above.
- half repeat: rounds of concurrent requests where half the images appeared earlier in the round,
  on a pipeline with both caches and on one with both off, rounds alternating between them; the
  ratio of requests/s (median of the per-round pair ratios).
Images are new in every repeat and round (seeded content), so only the repeats meant to hit do. The
requests are submitted in this process (as in the compile scenario): TTFT is measured from before
``submit()`` to the first streamed delta.
"""

from __future__ import annotations

import argparse
import io
import random
import sys
import time
from typing import Any

import anyio
from tqdm import tqdm

from pipeline.bench.common import (
    add_model_argument,
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

SYSTEM = "You are a meticulous visual analyst. Describe layout, colours, objects and text, in order. "


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--repeats", type=int, default=12, help="pairs per TTFT measurement")
    parser.add_argument("--rounds", type=int, default=4, help="half-repeat rounds per pipeline")
    parser.add_argument("--burst", type=int, default=16, help="requests per half-repeat round")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per half-repeat request")
    parser.add_argument("--encoder-cache-mb", type=float, default=256, help="the encoder cache's bound")
    parser.add_argument("--out", default=None)


def image_url(seed: int, width: int = 1024, height: int = 768) -> str:
    """A JPEG whose content is fixed by ``seed`` and differs from every other seed's."""
    from PIL import Image

    rng = random.Random(seed)
    image = Image.new("RGB", (width, height), tuple(rng.randrange(256) for _ in range(3)))
    for _ in range(40):
        x, y = rng.randrange(width), rng.randrange(height)
        image.paste(
            tuple(rng.randrange(256) for _ in range(3)), (x, y, x + rng.randrange(20, 200), y + rng.randrange(20, 200))
        )
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return jpeg_data_url(buf.getvalue())


def body(url: str, question: str, *, system: str | None = None, max_tokens: int = 1) -> dict[str, Any]:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": content}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0}


async def ttft(pipe: Pipeline, request: dict[str, Any]) -> tuple[float, int]:
    """Seconds from before ``submit`` to the first delta, and the prompt's length in tokens."""
    started = time.perf_counter()
    handle = await pipe.submit(request)
    first = 0.0
    async for _ in handle:
        first = first or time.perf_counter() - started
    result = await handle.result()
    return first, result.prompt_tokens


async def _ttft_pairs(pipe: Pipeline, repeats: int, seed: int, system_words: int) -> dict[str, Any]:
    firsts, seconds, lengths = [], [], []
    for i in tqdm(range(repeats), desc=f"ttft {'prefix' if system_words else 'image'}", file=sys.stderr):
        url = image_url(seed + i)
        system = f"[{seed + i}] " + SYSTEM * system_words if system_words else None
        first, length = await ttft(pipe, body(url, "What is in the picture?", system=system))
        second, _ = await ttft(pipe, body(url, "Which colour covers most of it?", system=system))
        firsts.append(first)
        seconds.append(second)
        lengths.append(length)
    ratios = [s / f for f, s in zip(firsts, seconds, strict=True)]
    return {
        "first_ms": round(median(firsts) * 1000, 1),
        "repeat_ms": round(median(seconds) * 1000, 1),
        "ratio": round(median(ratios), 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
        "prompt_tokens": int(median(lengths)),
    }


async def _half_repeat_round(pipe: Pipeline, seed: int, burst: int, max_tokens: int) -> float:
    """Requests/s of ``burst`` concurrent requests whose images are ``burst / 2`` new ones, each twice."""
    urls = [image_url(seed + i) for i in range(burst // 2)]
    order = urls + urls
    random.Random(seed).shuffle(order)
    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i, url in enumerate(order):
            tg.start_soon(ttft, pipe, body(url, f"Question {i}: what stands out?", max_tokens=max_tokens))
    return len(order) / (time.perf_counter() - started)


def _memory(pipe: Pipeline) -> dict[str, Any]:
    return {
        name: {"bytes": s.bytes_held, "bound": s.bytes_bound, "entries": s.entries, "evictions": s.evictions}
        for name, s in pipe.cache_stats().items()
    }


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    on_cfg = PipelineConfig(model=args.model, encoder_cache_bytes=int(args.encoder_cache_mb * 2**20))
    off_cfg = PipelineConfig(model=args.model, encoder_cache_bytes=0, prefix_caching=False)
    async with Pipeline(on_cfg, tracer=tracer_for(args)) as on, Pipeline(off_cfg) as off:
        for pipe in (on, off):  # warm-up: every preparation worker, first image, first prefill
            async with anyio.create_task_group() as tg:
                for i in range(pipe.config.num_prep_workers()):
                    tg.start_soon(ttft, pipe, body(image_url(1000 + i), "warm up"))
        image = await _ttft_pairs(on, args.repeats, 10_000, 0)
        prefix = await _ttft_pairs(on, args.repeats, 20_000, 12)
        rates: dict[str, list[float]] = {"on": [], "off": []}
        for r in tqdm(range(args.rounds), desc="half repeat", file=sys.stderr):
            pairs = [("on", on), ("off", off)] if r % 2 == 0 else [("off", off), ("on", on)]
            for name, pipe in pairs:
                rates[name].append(await _half_repeat_round(pipe, 30_000 + 1000 * r, args.burst, args.max_tokens))
        return {"image": image, "prefix": prefix, "rates": rates, "memory": _memory(on)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    load = [load_average()]
    m = anyio.run(_measure, args)
    load.append(load_average())
    rates = m["rates"]
    pair_ratios = [a / b for a, b in zip(rates["on"], rates["off"], strict=True)]
    print(
        f"\ncache: {args.repeats} pairs per TTFT row, {args.rounds} rounds of {args.burst}, {machine()}, "
        f"load {load[0]} -> {load[1]}"
    )
    rows = [
        [
            label,
            m[key]["prompt_tokens"],
            m[key]["first_ms"],
            m[key]["repeat_ms"],
            m[key]["ratio"],
            f"{m[key]['ratio_min']:.2f}-{m[key]['ratio_max']:.2f}",
        ]
        for label, key in (("repeated image", "image"), ("shared prefix", "prefix"))
    ]
    print_table(["TTFT", "prompt tokens", "first ms", "repeat ms", "ratio", "min-max"], rows)
    print_table(
        ["half repeat", "off req/s", "on req/s", "ratio", "min-max"],
        [
            [
                "both caches",
                round(median(rates["off"]), 2),
                round(median(rates["on"]), 2),
                round(median(pair_ratios), 3),
                f"{min(pair_ratios):.2f}-{max(pair_ratios):.2f}",
            ]
        ],
    )
    for name, mem in m["memory"].items():
        print(
            f"{name} cache: {mem['bytes'] / 2**20:.1f} MiB held of {mem['bound'] / 2**20:.1f} MiB bound, "
            f"{mem['entries']} entries, {mem['evictions']} evictions"
        )
    print("(targets: repeated image ≤ 0.3, shared prefix ≤ 0.3, half repeat ≥ 1.6, memory within its bound)")
    figures = {
        "scenario": "cache",
        "machine": machine(),
        "load": load,
        "repeat_image": m["image"],
        "shared_prefix": m["prefix"],
        "half_repeat_rates": rates,
        "memory": m["memory"],
        "repeat_image_ttft_ratio": m["image"]["ratio"],
        "shared_prefix_ttft_ratio": m["prefix"]["ratio"],
        "half_repeat_throughput_ratio": round(median(pair_ratios), 3),
    }
    write_outputs(args.out, "cache", figures)
    return figures
