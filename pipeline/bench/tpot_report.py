"""tpot-under-load's tables: the decodes' TPOT ratios per mode and image kind, and the step timeline."""

from __future__ import annotations

import argparse
from typing import Any

from pipeline.bench.common import load_average, machine, median, percentile, print_table, write_outputs
from pipeline.bench.step_timeline import TIMELINE_HEADERS, WindowSteps, summarise, timeline_row
from pipeline.config import PipelineConfig

__all__ = ["report"]

# per mode key, per image kind: the figures (``_measure``'s first result) and the step windows
Measured = dict[str, tuple[dict[str, dict[str, list[float]]], dict[str, dict[str, list[WindowSteps]]]]]


def report(args: argparse.Namespace, kinds: list[str], measured: Measured, load_before: float) -> dict[str, Any]:
    """Print the tables of ``measured`` (keys "preparation/engine mode") and write the figures."""
    results = {key: m[0] for key, m in measured.items()}
    print(
        f"\ntpot-under-load: {args.decodes} decodes of {args.tokens} tokens, burst of {args.burst} image "
        f"requests (distinct: an image each; repeated: one image),"
        f" median of {args.repeats}, {machine()}, load {load_before} -> {load_average()};"
        f" prefill chunk beside decodes {args.chunk_with_decodes} tokens,"
        f" {args.decode_steps_per_prefill} decode step(s) between prefills,"
        f" {args.prefill_seqs_per_step} sequence(s) a prefill step, decodes beside chunks of"
        f" {args.mixed_chunk_tokens} tokens or fewer, engine process niceness {args.engine_nice}"
    )
    rows: list[list[Any]] = []
    per_mode: dict[str, dict[str, Any]] = {}
    for mode, kind in ((m, k) for m in results for k in kinds):
        res = results[mode][kind]
        prep, engine = mode.split("/")
        idle, load = median(res["idle"]), median(res["load"])
        idle_p99, load_p99 = percentile(res["idle_gaps"], 99), percentile(res["load_gaps"], 99)
        per_mode[f"{mode}/{kind}"] = {
            "tpot_ms_idle": round(idle * 1000, 3),
            "tpot_ms_load": round(load * 1000, 3),
            "tpot_p99_ms_idle": round(idle_p99 * 1000, 3),
            "tpot_p99_ms_load": round(load_p99 * 1000, 3),
            "ratio": round(load / idle, 3),
            "p99_ratio": round(load_p99 / idle_p99, 3),
            "burst_req_per_s": round(median(res["burst_rps"]), 2),
        }
        if res["ttft"]:
            per_mode[f"{mode}/{kind}"] |= {
                "burst_ttft_ms_p50": round(percentile(res["ttft"], 50) * 1000, 3),
                "burst_ttft_ms_p99": round(percentile(res["ttft"], 99) * 1000, 3),
            }
        m = per_mode[f"{mode}/{kind}"]
        rows.append(
            [
                prep,
                engine,
                kind,
                idle * 1000,
                idle_p99 * 1000,
                load * 1000,
                load_p99 * 1000,
                m["ratio"],
                m["p99_ratio"],
                m["burst_req_per_s"],
                m.get("burst_ttft_ms_p50", float("nan")),
                m.get("burst_ttft_ms_p99", float("nan")),
            ]
        )
    print_table(
        [
            "preparation",
            "engine",
            "images",
            "idle p50 ms",
            "idle p99 ms",
            "burst p50 ms",
            "burst p99 ms",
            "p50 ratio",
            "p99 ratio",
            "burst req/s",
            "burst TTFT p50 ms",
            "p99 ms",
        ],
        rows,
    )
    print("(targets, both image kinds: p50 ratio <= 1.10, p99 ratio <= 1.5)")
    if args.timeline:
        timeline_rows = []
        for mode, kind in ((m, k) for m in measured for k in kinds):
            prep, engine = mode.split("/")
            for phase in ("idle", "burst"):
                steps = summarise(measured[mode][1][kind][phase])
                per_mode[f"{mode}/{kind}"][f"steps_{phase}"] = steps
                timeline_rows.append(timeline_row(prep, engine, kind, phase, steps))
        print("\nengine steps while the decodes ran (idle runs; bursts), all repeats together:")
        print_table(TIMELINE_HEADERS, timeline_rows)
    default = f"{PipelineConfig().preparation_mode}/engine {PipelineConfig().engine_mode}"
    main_key = f"{default}/{kinds[0]}" if default in results else f"{next(iter(results))}/{kinds[0]}"
    figures = {
        "scenario": "tpot-under-load",
        "mode": main_key.split("/")[0],
        "engine_mode": main_key.split("/")[1].removeprefix("engine "),
        "images": kinds[0],
        **per_mode[main_key],
        "modes": per_mode,
        "machine": machine(),
    }

    def plot(ax: Any) -> None:
        for mode, by_kind in results.items():
            for kind, res in by_kind.items():
                ax.hist([g * 1000 for g in res["load_gaps"]], bins=50, alpha=0.5, label=f"{mode}, {kind}, burst")
        first = next(iter(next(iter(results.values())).values()))
        ax.hist([g * 1000 for g in first["idle_gaps"]], bins=50, alpha=0.5, label="idle")
        ax.set_xlabel("time per output token (ms)")
        ax.legend()

    write_outputs(args.out, "tpot-under-load", figures, plot)
    return figures
