"""schemas: the dev corpus (JSONSchemaBench) per grammar backend: compile time, mask fill per token,
and what greedy decoding under each grammar gives (checked by the answer check).

Each backend compiles every schema (strict, as a request would); the fill is timed on a fresh matcher
walking the compact serialisation of a valid instance, token by token; then every compiled schema is
decoded greedily in batches by the engine and each answer that stops is checked against its whole
schema. ``stop+invalid`` counts what the grammar let through: the answer check is what catches it
in serving (the request is resampled or refused, never returned).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from pipeline.bench.common import machine, percentile, print_table, write_outputs
from pipeline.config import PipelineConfig, default_cache_dir
from pipeline.engine_factory import build_llm_engine
from pipeline.preparation import build_grammar_stage
from pipeline.types import GrammarSpec, PipelineError
from sampling.guided import GuidedDecoder, new_matcher
from sampling.inputs import EngineInput
from sampling.params import SamplingParams
from stages.grammar_backends import Compiled
from vision.checkpoint import open_checkpoint

__all__ = ["add_arguments", "run"]

CORPUS = Path(__file__).resolve().parents[2] / "tests" / "data" / "jsonschemabench"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--limit", type=int, default=0, help="only the first N schemas (0: all 220)")
    parser.add_argument("--batch", type=int, default=32, help="sequences decoded at once")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--fill-steps", type=int, default=32, help="tokens walked per schema to time the fill")
    parser.add_argument("--out", default=None)


def _fill_times(compiled: Compiled, text: str, tokenizer: Any, guided: GuidedDecoder, steps: int) -> list[float]:
    """Seconds per bitmask fill along ``text``'s tokens (stops where the grammar refuses one)."""
    matcher = new_matcher(compiled.grammar)
    times = []
    for token in tokenizer.encode(text, add_special_tokens=False)[:steps]:
        started = time.perf_counter()
        guided.fill([matcher], [0])
        times.append(time.perf_counter() - started)
        if not guided.accept([matcher], [token])[0]:
            break
    return times


def _decode_all(engine: Any, prompt: list[int], compiled: dict[str, Compiled], args: argparse.Namespace) -> dict:
    outputs: dict[str, Any] = {}
    names = list(compiled)
    for start in range(0, len(names), args.batch):
        for name in names[start : start + args.batch]:
            params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
            engine.add(EngineInput(name, prompt, -1, None, params, compiled[name].grammar))
        while engine.has_work():
            for out in engine.step():
                text, _ = outputs.get(out.request_id, ("", None))
                outputs[out.request_id] = (text + out.text, out.finish_reason)
    return outputs


def run(args: argparse.Namespace) -> dict[str, Any]:
    checkpoint = open_checkpoint(None, default_cache_dir())
    tokenizer = checkpoint.tokenizer
    paths = sorted(CORPUS.glob("*.json"))[: args.limit or None]
    corpus = {p.stem: json.loads(p.read_text()) for p in paths}
    config = PipelineConfig(max_running_seqs=args.batch, max_model_len=1024, num_kv_blocks=args.batch * 12)
    compilers = build_grammar_stage(config, checkpoint).compilers
    engine = build_llm_engine(checkpoint, config, device="cuda" if torch.cuda.is_available() else "cpu")
    guided = GuidedDecoder(engine.runner.cfg.vocab_size, 1, torch.device("cpu"))
    prompt = tokenizer.encode("[INST]Answer in JSON.[/INST]", add_special_tokens=False)
    results: dict[str, Any] = {}
    for backend, compiler in compilers.items():
        compile_s: list[float] = []
        fills: list[float] = []
        compiled: dict[str, Compiled] = {}
        refused: Counter[str] = Counter()
        for name, raw in tqdm(corpus.items(), desc=f"schemas {backend}", file=sys.stderr):
            started = time.perf_counter()
            try:
                compiled[name] = compiler.compile(GrammarSpec("json_schema", raw["schema"]))
            except PipelineError as exc:
                refused[exc.message.split(":")[-1].strip()[:50]] += 1
                continue
            finally:
                compile_s.append(time.perf_counter() - started)
            valid = [t["data"] for t in raw.get("tests", []) if t.get("valid")]
            if valid:
                text = json.dumps(valid[0], ensure_ascii=False, separators=(", ", ": "))
                fills += _fill_times(compiled[name], text, tokenizer, guided, args.fill_steps)
        outcomes: Counter[str] = Counter()
        caught: Counter[str] = Counter()
        for name, (text, reason) in _decode_all(engine, prompt, compiled, args).items():
            if reason != "stop":
                outcomes[str(reason)] += 1
                continue
            violation = compiled[name].check.check(text)
            outcomes["stop+valid" if violation is None else "stop+invalid"] += 1
            if violation is not None:
                caught[violation.reason] += 1
        results[backend] = {
            "schemas": len(corpus),
            "compiled": len(compiled),
            "refused": sum(refused.values()),
            "refused_by_reason": dict(refused.most_common()),
            "compile_ms_p50": round(percentile(compile_s, 50) * 1000, 2),
            "compile_ms_p90": round(percentile(compile_s, 90) * 1000, 2),
            "compile_ms_max": round(max(compile_s) * 1000, 2),
            "fill_ms_per_token_p50": round(percentile(fills, 50) * 1000, 4),
            "fill_ms_per_token_p99": round(percentile(fills, 99) * 1000, 4),
            "stop_valid": outcomes["stop+valid"],
            "stop_invalid": outcomes["stop+invalid"],
            "invalid_by_keyword": dict(caught.most_common()),
            "length": outcomes["length"],
            "error": outcomes["error"],
        }
    print(
        f"\nschemas: {len(corpus)} JSONSchemaBench schemas, strict, greedy, max_tokens {args.max_tokens}, {machine()}"
    )
    keys = [
        "compiled", "refused", "compile_ms_p50", "compile_ms_p90", "compile_ms_max", "fill_ms_per_token_p50",
        "fill_ms_per_token_p99", "stop_valid", "stop_invalid", "length", "error",
    ]  # fmt: skip
    print_table(["backend", *keys], [[b, *(r[k] for k in keys)] for b, r in results.items()])
    for backend, r in results.items():
        print(f"{backend}: refused {r['refused_by_reason']}; stop+invalid by keyword {r['invalid_by_keyword']}")
    figures = {"scenario": "schemas", "results": results, "machine": machine()}

    def plot(ax: Any) -> None:
        names = list(results)
        ax.bar(names, [results[b]["compile_ms_p90"] for b in names])
        ax.set_ylabel("compile p90 (ms)")

    write_outputs(args.out, "schemas", figures, plot)
    return figures
