"""Benchmarks: ``python -m pipeline bench SCENARIO``; each prints a table and one JSON line."""

from __future__ import annotations

import argparse
import importlib
import json

from pipeline.bench.common import write_traces

__all__ = ["add_bench_arguments", "run_bench"]

# scenario name -> module under pipeline.bench with add_arguments(parser) and run(args) -> dict
SCENARIOS = {
    "health": "health",
    "prep": "prep",
    "guided": "guided",
    "tpot-under-load": "tpot_under_load",
    "compile": "compile",
    "overload": "overload",
}


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="scenario", required=True)
    for name, module_name in SCENARIOS.items():
        try:
            module = importlib.import_module(f"pipeline.bench.{module_name}")
        except ModuleNotFoundError:
            continue
        scenario = sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        module.add_arguments(scenario)
        scenario.add_argument("--trace", default=None, help="write stage spans as a Chrome trace-event JSON file")


def run_bench(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"pipeline.bench.{SCENARIOS[args.scenario]}")
    figures = module.run(args)
    write_traces()
    print(json.dumps(figures))
    return 0
