"""compile: time to first token with a never-seen schema ÷ with no schema, per grammar backend; cache hit.

The grammar compile starts at admission and overlaps fetch, decode and encode, so with an image in
the request a new schema should cost little extra time to first token.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import anyio
from tqdm import tqdm

from pipeline.bench.common import jpeg_bytes, jpeg_data_url, machine, median, print_table, tracer_for, write_outputs
from pipeline.config import PipelineConfig
from pipeline.pipeline import Pipeline
from pipeline.types import GrammarSpec

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None)


def schema(i: int, *, bounded_strings: bool = False) -> dict[str, Any]:
    """A realistic schema, new for every ``i`` (property names differ), so it is never a cache hit.

    ``bounded_strings`` adds ``maxLength`` to its strings: xgrammar expands a bounded repetition
    over the whole vocabulary, which makes this compile about 40x slower (0.63 s vs 16 ms here).
    """
    bound: dict[str, Any] = {"maxLength": 40} if bounded_strings else {}
    return {
        "type": "object",
        "properties": {
            f"title_{i}": {"type": "string", **bound},
            f"tags_{i}": {"type": "array", "items": {"type": "string", **bound}, "maxItems": 4},
            f"score_{i}": {"type": "number", "minimum": 0, "maximum": 10},
            f"kind_{i}": {"enum": ["photo", "drawing", "diagram"]},
        },
        "required": [f"title_{i}", f"kind_{i}"],
        "additionalProperties": False,
    }


def _body(data_url: str, grammar: dict[str, Any] | None) -> dict[str, Any]:
    content = [{"type": "text", "text": "Describe."}, {"type": "image_url", "image_url": {"url": data_url}}]
    body: dict[str, Any] = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
    if grammar is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": grammar}}
    return body


BACKENDS = ("auto", "xgrammar", "llguidance")
KINDS = ("none", "new", "bounded")


async def _measure(backend: str, repeats: int, data_url: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """TTFT of each kind of request, interleaved, with a never-seen schema every time."""
    ttft: dict[str, list[float]] = {kind: [] for kind in (*KINDS, "hit_ms")}
    config = PipelineConfig(grammar_backend=backend)
    async with Pipeline(config, tracer=tracer_for(args)) as pipe:
        await (await pipe.submit(_body(data_url, schema(-1)))).result()  # warm-up
        for i in tqdm(range(repeats), desc=f"compile {backend}", file=sys.stderr):
            offset = 1000 * BACKENDS.index(backend)  # distinct names per backend: never a hit
            for kind, grammar in (
                ("none", None),
                ("new", schema(offset + i)),
                ("bounded", schema(offset + i, bounded_strings=True)),
            ):
                result = await (await pipe.submit(_body(data_url, grammar))).result()
                ttft[kind].append(result.timings["first_token"])
            spec = GrammarSpec("json_schema", schema(offset + i))
            started = time.perf_counter()
            await pipe.preparation.grammar.compile(spec)
            ttft["hit_ms"].append((time.perf_counter() - started) * 1000)
        await pipe.preparation.grammar.wait_idle()  # late xgrammar compiles must not run into the next backend
    return ttft


def run(args: argparse.Namespace) -> dict[str, Any]:
    data_url = jpeg_data_url(jpeg_bytes())
    runs = {backend: anyio.run(_measure, backend, args.repeats, data_url, args) for backend in BACKENDS}
    rows, results = [], []
    for backend, ttft in runs.items():
        none, new, bounded, hit = (median(ttft[k]) for k in (*KINDS, "hit_ms"))
        rows.append([backend, none * 1000, new * 1000, new / none, bounded * 1000, bounded / none, hit])
        results.append(
            {
                "backend": backend,
                "ttft_ms_no_schema": round(none * 1000, 3),
                "ttft_ms_new_schema": round(new * 1000, 3),
                "ratio": round(new / none, 3),
                "ttft_ms_new_schema_max_length": round(bounded * 1000, 3),
                "ratio_max_length": round(bounded / none, 3),
                "cache_hit_ms": round(hit, 4),
            }
        )
    print(f"\ncompile: image request, max_tokens=1, median of {args.repeats}, {machine()}")
    print("(auto: the dispatch table and the xgrammar budget choose per request; the others are forced)")
    print_table(
        ["backend", "TTFT none ms", "new schema ms", "ratio", "maxLength strings ms", "ratio", "cache hit ms"], rows
    )
    figures = {"scenario": "compile", "results": results, "repeats": args.repeats, "machine": machine()}

    def plot(ax: Any) -> None:
        for backend, ttft in runs.items():
            ax.plot([t * 1000 for t in ttft["bounded"]], "^-", label=f"{backend}: maxLength strings")
            ax.plot([t * 1000 for t in ttft["new"]], "s-", label=f"{backend}: new schema")
        ax.plot([t * 1000 for t in runs["auto"]["none"]], "o-", label="no schema")
        ax.set_xlabel("run")
        ax.set_ylabel("time to first token (ms)")
        ax.legend()

    write_outputs(args.out, "compile", figures, plot)
    return figures
