"""Benchmarks: ``python -m pipeline bench SCENARIO``; each prints a table and one JSON line."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from pipeline.bench.common import write_traces

__all__ = ["add_bench_arguments", "run_bench"]

# scenario name -> module under pipeline.bench with add_arguments(parser) and run(args) -> dict
SCENARIOS = {
    "health": "health",
    "prep": "prep",
    "guided": "guided",
    "forced": "forced",
    "tpot-under-load": "tpot_under_load",
    "compile": "compile",
    "schemas": "schemas",
    "overload": "overload",
    "engine-hop": "engine_hop",
    "ahead": "ahead",
    "cache": "cache",
    "scale": "scale",
    "impl": "impl",
    "compile-model": "compile_model",
    "decode-buffers": "decode_buffers",
    "cadence": "cadence",
    "bodies": "bodies",
    "served": "served",
}


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="scenario", required=True)
    for name, module_name in SCENARIOS.items():
        try:
            module = importlib.import_module(f"pipeline.bench.{module_name}")
        except ImportError as exc:
            # still listed: running it says which module failed and why, rather than "invalid choice"
            reason = f"importing pipeline.bench.{module_name} failed: {type(exc).__name__}: {exc}"
            # no option prefix: every argument (the scenario's options, --help) is taken, none refused
            broken = sub.add_parser(name, help=f"unavailable ({reason})", prefix_chars="\0", add_help=False)
            broken.add_argument("ignored", nargs="*")
            broken.set_defaults(import_error=reason)
            continue
        scenario = sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        module.add_arguments(scenario)
        scenario.add_argument("--trace", default=None, help="write stage spans as a Chrome trace-event JSON file")


def run_bench(args: argparse.Namespace) -> int:
    """Run the chosen scenario and print its figures; 2 when its module could not be imported."""
    import_error = getattr(args, "import_error", None)
    if import_error is not None:
        print(f"bench {args.scenario}: cannot run: {import_error}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"pipeline.bench.{SCENARIOS[args.scenario]}")
    figures = module.run(args)
    write_traces()
    print(json.dumps(figures))
    return 0
