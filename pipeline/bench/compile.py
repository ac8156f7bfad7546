"""compile: time to first token with a never-seen schema ÷ with no schema, per grammar backend; cache hit.

The grammar compile starts at admission and overlaps fetch, decode and encode, so with an image in
the request a new schema should cost little extra time to first token. Each repeat sends one request
of every kind (no schema, a new schema, a new schema with bounded strings) back to back, in an order
that rotates between repeats; each kind's ratio is the median over repeats of its TTFT ÷ the
no-schema TTFT of the same repeat, so drift of a shared machine cancels within a repeat.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from typing import Any

import anyio
from tqdm import tqdm

from pipeline.bench.common import (
    DistinctImages,
    jpeg_data_url,
    load_average,
    machine,
    median,
    percentile,
    print_table,
    tracer_for,
    write_outputs,
)
from pipeline.config import PipelineConfig
from pipeline.core.pipeline import Pipeline
from pipeline.types import GrammarSpec

__all__ = ["add_arguments", "run", "schema"]

BACKENDS = ("auto", "xgrammar", "llguidance")
KINDS = ("none", "new", "bounded")  # no schema, a new schema, a new schema with minLength/maxLength strings
LABELS = {"new": "new schema", "bounded": "bounded strings"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=40, help="requests of each kind per backend")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated: auto, xgrammar, llguidance")
    parser.add_argument("--out", default=None)


def schema(i: int, *, bounded_strings: bool = False) -> dict[str, Any]:
    """A realistic schema, new for every ``i`` (property names differ), so it is never a cache hit.

    ``bounded_strings`` adds ``minLength``/``maxLength`` to its strings: xgrammar 0.2.8 expands a
    bounded repetition over the whole vocabulary, which makes its compile about 100x slower (about
    1.5 s here, vs 15 ms).
    """
    bound: dict[str, Any] = {"minLength": 1, "maxLength": 40} if bounded_strings else {}
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


def _grammar(kind: str, i: int) -> dict[str, Any] | None:
    return None if kind == "none" else schema(i, bounded_strings=kind == "bounded")


async def _measure(backend: str, repeats: int, data_urls: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """TTFT of each kind of request (seconds), the backend that served each, and cache hits (ms).

    Every request carries an image of its own (``data_urls``, never reused within one pipeline), so
    its preparation runs whole beside the compile, as a new image's would."""
    images = iter(data_urls)
    ttft: dict[str, list[float]] = {kind: [] for kind in KINDS}
    served: dict[str, Counter[str]] = {kind: Counter() for kind in KINDS if kind != "none"}
    hits: list[float] = []
    offset = 1000 * (1 + BACKENDS.index(backend))  # distinct names per backend: never a hit
    async with Pipeline(PipelineConfig(grammar_backend=backend), tracer=tracer_for(args)) as pipe:
        grammar = pipe.preparation.grammar
        for kind in KINDS:  # warm-up: the first image, the first compile of each backend
            await (await pipe.submit(_body(next(images), _grammar(kind, offset - 1)))).result()
            await grammar.wait_idle()
        for i in tqdm(range(repeats), desc=f"compile {backend}", file=sys.stderr):
            for kind in KINDS[i % len(KINDS) :] + KINDS[: i % len(KINDS)]:
                result = await (await pipe.submit(_body(next(images), _grammar(kind, offset + i)))).result()
                ttft[kind].append(result.timings["first_token"])
                if kind != "none":
                    served[kind][result.grammar_backend or "?"] += 1
                # an xgrammar compile that ran over its budget (auto) finishes in the background:
                # untimed here, so it does not slow the next request's preparation
                await grammar.wait_idle()
            spec = GrammarSpec("json_schema", schema(offset + i))
            started = time.perf_counter()
            await grammar.compile(spec)
            hits.append((time.perf_counter() - started) * 1000)
    return {"ttft": ttft, "served": served, "hit_ms": hits}


def _summary(backend: str, run: dict[str, Any]) -> dict[str, Any]:
    ttft, hits = run["ttft"], run["hit_ms"]
    out: dict[str, Any] = {"backend": backend, "ttft_ms_none": round(median(ttft["none"]) * 1000, 2)}
    for kind in ("new", "bounded"):
        ratios = [t / n for t, n in zip(ttft[kind], ttft["none"], strict=True)]
        out[f"ttft_ms_{kind}"] = round(median(ttft[kind]) * 1000, 2)
        out[f"ratio_{kind}"] = round(median(ratios), 3)
        out[f"ratio_{kind}_p25"] = round(percentile(ratios, 25), 3)
        out[f"ratio_{kind}_p75"] = round(percentile(ratios, 75), 3)
        out[f"ratio_{kind}_min"] = round(min(ratios), 3)
        out[f"ratio_{kind}_max"] = round(max(ratios), 3)
        out[f"served_{kind}"] = dict(run["served"][kind])
    out["cache_hit_ms_p50"] = round(median(hits), 4)
    out["cache_hit_ms_max"] = round(max(hits), 4)
    return out


def _served(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} {n}" for name, n in sorted(counts.items()))


def run(args: argparse.Namespace) -> dict[str, Any]:
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    load = [load_average()]
    jpegs = DistinctImages().jpegs(0, len(KINDS) * (1 + args.repeats))
    data_urls = [jpeg_data_url(j) for j in jpegs]
    runs = {backend: anyio.run(_measure, backend, args.repeats, data_urls, args) for backend in backends}
    results = [_summary(backend, r) for backend, r in runs.items()]
    load.append(load_average())
    print(
        f"\ncompile: image request (a distinct image each), max_tokens=1, {args.repeats} repeats, "
        f"{machine()}, load {load[0]} -> {load[1]}"
    )
    print("(auto: the dispatch table and the xgrammar budget choose per request; the others are forced)")
    rows = []
    for r in results:
        for kind in ("new", "bounded"):
            rows.append(
                [
                    r["backend"],
                    LABELS[kind],
                    _served(r[f"served_{kind}"]),
                    r["ttft_ms_none"],
                    r[f"ttft_ms_{kind}"],
                    r[f"ratio_{kind}"],
                    f"{r[f'ratio_{kind}_p25']:.2f}-{r[f'ratio_{kind}_p75']:.2f}",
                    f"{r[f'ratio_{kind}_min']:.2f}-{r[f'ratio_{kind}_max']:.2f}",
                    r["cache_hit_ms_p50"],
                    r["cache_hit_ms_max"],
                ]
            )
    headers = ["backend", "schema", "served by", "TTFT none ms", "TTFT ms", "ratio", "IQR", "min-max"]
    headers += ["hit ms", "hit max"]
    print_table(headers, rows)
    print("(TTFT: medians; ratio: median over repeats of TTFT ÷ the same repeat's no-schema TTFT; target ≤ 1.10,")
    print(" cache hit < 1 ms)")
    figures = {"scenario": "compile", "results": results, "repeats": args.repeats, "machine": machine(), "load": load}

    def plot(ax: Any) -> None:
        for backend, r in runs.items():
            ax.plot([t * 1000 for t in r["ttft"]["bounded"]], "^-", label=f"{backend}: bounded strings")
            ax.plot([t * 1000 for t in r["ttft"]["new"]], "s-", label=f"{backend}: new schema")
            ax.plot([t * 1000 for t in r["ttft"]["none"]], "o:", label=f"{backend}: no schema")
        ax.set_xlabel("repeat")
        ax.set_ylabel("time to first token (ms)")
        ax.set_yscale("log")
        ax.legend(fontsize=7)

    write_outputs(args.out, "compile", figures, plot)
    return figures
