"""compile: time to first token with a never-seen schema ÷ with no schema, per grammar backend; cache hit.

The grammar compile starts at admission and overlaps fetch, decode and encode, so with a new image
in the request a new schema should cost little extra time to first token. Where preparation is
short (a text-only request, or an image the encoder cache holds) nothing hides the compile; in auto
dispatch llguidance (milliseconds) serves a new schema's first requests, whatever the preparation,
and starts no xgrammar compile: xgrammar compiles in the background from the schema's second use on.
``--engine-modes`` runs each engine mode
(in process mode the engine process compiles, once).
Each repeat sends, for every preparation (text only, a cached image, a distinct image), one request
of every kind (no schema, a new schema, a new schema with bounded strings, and a schema compiled
before: its ratio is what guided decoding costs the first token without a compile) back to back, in an order
that rotates between repeats; each kind's ratio is the median over repeats of its TTFT ÷ the
no-schema TTFT of the same repeat and preparation, so drift of a shared machine cancels within a repeat.
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
# no schema, a new schema, a new schema with minLength/maxLength strings, a schema compiled before (its
# compile a cache hit: what guided decoding itself costs the first token, the floor of the others)
KINDS = ("none", "new", "bounded", "known")
GUIDED = KINDS[1:]
LABELS = {"new": "new schema", "bounded": "bounded strings", "known": "compiled before"}
PREPS = ("text", "cached", "distinct")  # no image; one image every request repeats; a new image each
PREP_LABELS = {"text": "text only", "cached": "cached image", "distinct": "distinct image"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=40, help="requests of each kind per backend")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated: auto, xgrammar, llguidance")
    parser.add_argument(
        "--preparations", default=",".join(PREPS), help="comma-separated: text, cached, distinct (the request's images)"
    )
    parser.add_argument("--engine-modes", default="thread,process", help="engine modes, comma-separated")
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


def _body(data_url: str | None, grammar: dict[str, Any] | None) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": "Describe."}]
    if data_url is not None:
        content.append({"type": "image_url", "image_url": {"url": data_url}})
    body: dict[str, Any] = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
    if grammar is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": grammar}}
    return body


def _grammar(kind: str, i: int, known: int) -> dict[str, Any] | None:
    if kind == "none":
        return None
    return schema(known if kind == "known" else i, bounded_strings=kind == "bounded")


async def _measure(
    backend: str, mode: str, repeats: int, preps: list[str], data_urls: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    """TTFT of each preparation and kind of request (seconds), the backend that served each, and
    cache hits (ms).

    A distinct-image request carries an image of its own (from ``data_urls``, never reused within one
    pipeline), so its preparation runs whole beside the compile, as a new image's would; a
    cached-image request repeats the warm-up's first image, whose embeddings the encoder cache holds."""
    images = iter(data_urls)
    cached_url = next(images)
    ttft: dict[str, dict[str, list[float]]] = {prep: {kind: [] for kind in KINDS} for prep in preps}
    served: dict[str, dict[str, Counter[str]]] = {prep: {kind: Counter() for kind in GUIDED} for prep in preps}
    hits: list[float] = []
    offset = 10_000 * (1 + BACKENDS.index(backend))  # distinct names per backend: never a hit
    known = offset - 100  # the schema every "known" request sends, compiled during the warm-up

    def url(prep: str) -> str | None:
        return None if prep == "text" else cached_url if prep == "cached" else next(images)

    config = PipelineConfig(grammar_backend=backend, engine_mode=mode)
    async with Pipeline(config, tracer=tracer_for(args)) as pipe:
        grammar = pipe.preparation.grammar
        await (await pipe.submit(_body(cached_url, None))).result()  # its embeddings now cached
        for p, prep in enumerate(preps):  # warm-up: each preparation, the first compile of each backend
            for kind in KINDS:
                await (await pipe.submit(_body(url(prep), _grammar(kind, offset - 1 - p, known)))).result()
                await grammar.wait_idle()
        # one more use of the known schema (the warm-up used it once per preparation): with one
        # preparation this is its second use, which starts the compile auto dispatch serves it with
        await grammar.compile(GrammarSpec("json_schema", schema(known)))
        await grammar.wait_idle()
        for i in tqdm(range(repeats), desc=f"compile {backend}, engine {mode}", file=sys.stderr):
            for p, prep in enumerate(preps):
                index = offset + len(PREPS) * i + p
                for kind in KINDS[i % len(KINDS) :] + KINDS[: i % len(KINDS)]:
                    result = await (await pipe.submit(_body(url(prep), _grammar(kind, index, known)))).result()
                    ttft[prep][kind].append(result.timings["first_token"])
                    if kind != "none":
                        served[prep][kind][result.grammar_backend or "?"] += 1
                    # a compile that outlasts its request finishes untimed here, so that it does not
                    # slow the next request (a new schema's first use starts none in auto)
                    await grammar.wait_idle()
                spec = GrammarSpec("json_schema", schema(index))
                # the schema's second use starts xgrammar's compile (auto): untimed, and ended before
                # the hit is timed and the next repeat's requests run
                await grammar.compile(spec)
                await grammar.wait_idle()
                started = time.perf_counter()
                await grammar.compile(spec)
                hits.append((time.perf_counter() - started) * 1000)
    return {"ttft": ttft, "served": served, "hit_ms": hits}


def _summary(backend: str, mode: str, prep: str, run: dict[str, Any]) -> dict[str, Any]:
    ttft, hits = run["ttft"][prep], run["hit_ms"]
    out: dict[str, Any] = {
        "backend": backend,
        "engine_mode": mode,
        "preparation": prep,
        "ttft_ms_none": round(median(ttft["none"]) * 1000, 2),
    }
    for kind in GUIDED:
        ratios = [t / n for t, n in zip(ttft[kind], ttft["none"], strict=True)]
        out[f"ttft_ms_{kind}"] = round(median(ttft[kind]) * 1000, 2)
        out[f"ratio_{kind}"] = round(median(ratios), 3)
        out[f"ratio_{kind}_p25"] = round(percentile(ratios, 25), 3)
        out[f"ratio_{kind}_p75"] = round(percentile(ratios, 75), 3)
        out[f"ratio_{kind}_min"] = round(min(ratios), 3)
        out[f"ratio_{kind}_max"] = round(max(ratios), 3)
        out[f"served_{kind}"] = dict(run["served"][prep][kind])
    out["cache_hit_ms_p50"] = round(median(hits), 4)
    out["cache_hit_ms_max"] = round(max(hits), 4)
    return out


def _served(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} {n}" for name, n in sorted(counts.items()))


def run(args: argparse.Namespace) -> dict[str, Any]:
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    preps = [p.strip() for p in args.preparations.split(",") if p.strip()]
    for prep in preps:
        if prep not in PREPS:
            raise SystemExit(f"--preparations: unknown {prep!r} (choose from {', '.join(PREPS)})")
    load = [load_average()]
    jpegs = DistinctImages().jpegs(0, 1 + len(KINDS) * (1 + args.repeats))
    data_urls = [jpeg_data_url(j) for j in jpegs]
    modes = [m.strip() for m in args.engine_modes.split(",") if m.strip()]
    runs = {
        (backend, mode): anyio.run(_measure, backend, mode, args.repeats, preps, data_urls, args)
        for mode in modes
        for backend in backends
    }
    results = [_summary(backend, mode, prep, r) for (backend, mode), r in runs.items() for prep in preps]
    load.append(load_average())
    print(f"\ncompile: max_tokens=1, {args.repeats} repeats, {machine()}, load {load[0]} -> {load[1]}")
    print("(text only: no image; cached image: one image every request repeats; distinct image: a new one each)")
    print(
        "(auto: the dispatch table, the xgrammar budget and the preparation choose per request; the others are forced)"
    )
    rows = []
    for r in results:
        for kind in GUIDED:
            rows.append(
                [
                    r["backend"],
                    r["engine_mode"],
                    PREP_LABELS[r["preparation"]],
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
    headers = [
        "backend",
        "engine",
        "request",
        "schema",
        "served by",
        "TTFT none ms",
        "TTFT ms",
        "ratio",
        "IQR",
        "min-max",
    ]
    headers += ["hit ms", "hit max"]
    print_table(headers, rows)
    print("(TTFT: medians; ratio: median over repeats of TTFT ÷ the same repeat's no-schema TTFT; target ≤ 1.10,")
    print(" cache hit < 1 ms; compiled before: the same schema every request, its compile a cache hit)")
    figures = {"scenario": "compile", "results": results, "repeats": args.repeats, "machine": machine(), "load": load}

    def plot(ax: Any) -> None:
        for (backend, mode), r in runs.items():
            for prep in preps:
                label = f"{backend}, engine {mode}, {PREP_LABELS[prep]}"
                ax.plot([t * 1000 for t in r["ttft"][prep]["bounded"]], "^-", label=f"{label}: bounded strings")
                ax.plot([t * 1000 for t in r["ttft"][prep]["known"]], "v-", label=f"{label}: compiled before")
                ax.plot([t * 1000 for t in r["ttft"][prep]["new"]], "s-", label=f"{label}: new schema")
                ax.plot([t * 1000 for t in r["ttft"][prep]["none"]], "o:", label=f"{label}: no schema")
        ax.set_xlabel("repeat")
        ax.set_ylabel("time to first token (ms)")
        ax.set_yscale("log")
        ax.legend(fontsize=7)

    write_outputs(args.out, "compile", figures, plot)
    return figures
