"""forced: a structured answer with forced tokens ÷ the same answer one token per step ÷ plain decoding.

Drives the decode engine directly, three runs per pair, interleaved, on one shared runner (the same
weights and KV cache), each run a batch of B greedy requests from the first prefill to the last token:

- ``one``: under a JSON schema with fixed keys, forcing off (a decode step per token);
- ``forced``: the same requests with forcing on (what the grammar forces is appended after each
  sampled token and run as one extend in the next step: sampling/guided/forced.py);
- ``plain``: no grammar, ``ignore_eos``, each request as many tokens as its forced answer had.

A run's answer time is the time of its steps but the pure prefill ones (the same in all three). A
pair's ratios are forced ÷ one and forced ÷ plain, taken within the repeat so that a shared
machine's drift cancels; the median over repeats is reported with min and max. ``free`` measures
what forcing costs where nothing is forced (a regex of free text): its TPOT with forcing on ÷ off.

``--corpus N`` decodes the first N schemas of the dev corpus (JSONSchemaBench) greedily, forcing on
and off, per backend: the share of answer tokens that were forced, steps per answer, and how many
answers are the same tokens (or the same up to a place where the model spelt a forced text
otherwise than its tokenizer does).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from pipeline.bench.common import (
    add_model_argument,
    add_torch_arguments,
    load_average,
    machine,
    median,
    print_table,
    torch_device,
    write_outputs,
)
from pipeline.bench.schemas import decode_all
from pipeline.config import PipelineConfig, default_cache_dir
from pipeline.engine.factory import build_llm_engine
from pipeline.stage_factory import build_grammar_stage
from pipeline.types import GrammarSpec
from sampling.engine import LLMEngine
from sampling.inputs import EngineInput
from sampling.params import SamplingParams
from stages.grammar.backends import Compiled
from vision.checkpoint import open_checkpoint

__all__ = ["FIXED_KEYS", "add_arguments", "run"]

BACKENDS = ("xgrammar", "llguidance")
# fixed keys, short values: about half of the answer is forced (braces, keys, quotes, separators)
FIXED_KEYS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 12},
        "email": {"type": "string", "maxLength": 16},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "email", "active"],
    "additionalProperties": False,
}
FREE_TEXT = "[a-z ,.]{1,400}"  # nothing forced, ever
CORPUS_DIR = Path(__file__).resolve().parents[2] / "tests" / "data" / "jsonschemabench"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs of each kind per batch and backend")
    parser.add_argument("--max-tokens", type=int, default=96, help="the answer's token bound")
    parser.add_argument("--corpus", type=int, default=0, help="decode this many dev-corpus schemas (0: none)")
    add_torch_arguments(parser)
    parser.add_argument("--out", default=None, help="folder for forced.json and forced.png")


def _prompts(tokenizer: Any, batch: int) -> list[list[int]]:
    return [
        tokenizer.encode(f"[INST]Describe person {i} as JSON.[/INST]", add_special_tokens=False) for i in range(batch)
    ]


def run_batch(
    engine: LLMEngine, prompts: list[list[int]], grammar: Any, max_tokens: list[int] | int, tag: str
) -> dict[str, Any]:
    """Greedy answers of ``prompts`` under ``grammar`` (None: plain, ``ignore_eos``): the answer time
    (seconds of the steps but pure prefills), the steps and tokens per answer, the answers' tokens."""
    engine.timeline.clear()
    limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    for i, (prompt, limit) in enumerate(zip(prompts, limits, strict=True)):
        params = SamplingParams(max_tokens=limit, temperature=0.0, ignore_eos=grammar is None)
        engine.add(EngineInput(f"{tag}-{i}", prompt, -1, None, params, grammar))
    tokens: list[list[int]] = [[] for _ in prompts]
    steps = [0] * len(prompts)
    texts = [""] * len(prompts)
    forced_before = engine.parts.num_forced
    while engine.has_work():
        for out in engine.step():
            if out.finish_reason == "error":
                raise RuntimeError(f"{out.request_id}: {out.error}")
            i = int(out.request_id.rsplit("-", 1)[1])
            tokens[i] += out.token_ids
            texts[i] += out.text
            steps[i] += 1
    seconds = sum(t.total for t in engine.timeline if t.kind != "prefill")
    return {
        "seconds": seconds,
        "tokens": tokens,
        "texts": texts,
        "steps": steps,
        "forced": engine.parts.num_forced - forced_before,
    }


def _measure(
    engines: dict[bool, LLMEngine], prompts: list[list[int]], grammar: Any, free: Any, args: argparse.Namespace
) -> dict[str, Any]:
    """One backend at one batch size: ``--repeats`` interleaved triples, and the free-text pairs."""
    batch = len(prompts)
    over_one, over_plain, free_ratio, steps_one, steps_forced, tokens_one, tokens_forced, share = ([] for _ in range(8))
    for r in range(args.repeats):
        one = run_batch(engines[False], prompts, grammar, args.max_tokens, f"one{batch}-{r}")
        forced = run_batch(engines[True], prompts, grammar, args.max_tokens, f"forced{batch}-{r}")
        lengths = [len(t) for t in forced["tokens"]]
        plain = run_batch(engines[False], prompts, None, lengths, f"plain{batch}-{r}")
        over_one.append(forced["seconds"] / one["seconds"])
        over_plain.append(forced["seconds"] / plain["seconds"])
        steps_one.append(sum(one["steps"]) / batch)
        steps_forced.append(sum(forced["steps"]) / batch)
        tokens_one.append(sum(map(len, one["tokens"])) / batch)
        tokens_forced.append(sum(lengths) / batch)
        share.append(forced["forced"] / max(1, sum(lengths)))
        # nothing forced: what asking costs, per token
        free_off = run_batch(engines[False], prompts, free, 48, f"free-off{batch}-{r}")
        free_on = run_batch(engines[True], prompts, free, 48, f"free-on{batch}-{r}")
        free_ratio.append(
            (free_on["seconds"] / sum(map(len, free_on["tokens"])))
            / (free_off["seconds"] / sum(map(len, free_off["tokens"])))
        )
    return {
        "forced_over_one": _spread(over_one),
        "forced_over_plain": _spread(over_plain),
        "free_on_over_off": _spread(free_ratio),
        "steps_per_answer_one": round(median(steps_one), 1),
        "steps_per_answer_forced": round(median(steps_forced), 1),
        "tokens_per_answer_one": round(median(tokens_one), 1),
        "tokens_per_answer_forced": round(median(tokens_forced), 1),
        "forced_share": round(median(share), 3),
    }


def _spread(values: list[float]) -> dict[str, Any]:
    return {"median": round(median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def respelled_only(table: list[bytes], one: list[int], forced: list[int]) -> bool:
    """Whether ``forced`` is ``one`` up to a place where both write the same text in other tokens."""
    for a, b in zip(one, forced, strict=False):
        if a != b:
            return table[a].startswith(table[b]) or table[b].startswith(table[a])
    return len(one) == len(forced)


def _corpus(
    engines: dict[bool, LLMEngine], checkpoint: Any, config: PipelineConfig, count: int, progress: Any
) -> list[dict[str, Any]]:
    """The first ``count`` dev-corpus schemas decoded greedily, forcing off and on, per backend."""
    compilers = build_grammar_stage(config, checkpoint).compilers
    table = engines[True].token_bytes.table
    prompt = checkpoint.tokenizer.encode("[INST]Answer with JSON.[/INST]", add_special_tokens=False)
    schemas = [json.loads(p.read_text())["schema"] for p in sorted(CORPUS_DIR.glob("*.json"))[:count]]
    rows = []
    for backend in BACKENDS:
        compiled: dict[str, Compiled] = {}
        for i, schema in enumerate(schemas):
            try:
                compiled[f"c{i}"] = compilers[backend].compile(GrammarSpec("json_schema", schema))
            except Exception:  # noqa: BLE001 - a refused schema is left out, as the serving 400 would
                continue
        runs: dict[bool, list[list[int]]] = {}
        before = engines[True].parts.num_forced
        for force in (False, True):
            answers = decode_all(engines[force], prompt, compiled, 16, 128)
            runs[force] = [answers[name][1] for name in compiled]
            progress.update(1)
        forced = engines[True].parts.num_forced - before
        total = sum(map(len, runs[True]))
        same = sum(a == b for a, b in zip(runs[False], runs[True], strict=True))
        respelled = sum(respelled_only(table, a, b) for a, b in zip(runs[False], runs[True], strict=True)) - same
        rows.append(
            {
                "backend": backend,
                "schemas": len(compiled),
                "forced_share": round(forced / max(1, total), 3),
                # a step writes one sampled token of each answer, and the forced ones after it
                "steps_per_answer_one": round(sum(map(len, runs[False])) / max(1, len(compiled)), 1),
                "steps_per_answer_forced": round((total - forced) / max(1, len(compiled)), 1),
                "same_tokens": same,
                "respelled_only": respelled,
                "other": len(compiled) - same - respelled,
            }
        )
    return rows


def forced_config(config: PipelineConfig, batches: list[int], max_tokens: int) -> PipelineConfig:
    """``config`` sized for the largest batch of prompts (< 64 tokens) and answers of ``max_tokens``."""
    blocks = max(batches) * -(-(max_tokens + 64) // config.kv_block_size) + 64
    return dataclasses.replace(config, max_running_seqs=max(batches), num_kv_blocks=blocks)


def build_engines(checkpoint: Any, config: PipelineConfig, device: str) -> dict[bool, LLMEngine]:
    """Two engines over one runner (the same weights and KV cache): forcing off (False) and on (True)."""
    off = build_llm_engine(
        checkpoint, dataclasses.replace(config, forced_tokens=False), device=device, record_timeline=True
    )
    on = build_llm_engine(
        checkpoint,
        dataclasses.replace(config, forced_tokens=True),
        device=device,
        record_timeline=True,
        runner=off.runner,
    )
    return {False: off, True: on}


def measure_rows(
    engines: dict[bool, LLMEngine],
    checkpoint: Any,
    config: PipelineConfig,
    batches: list[int],
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """A row per batch size and backend (``args``: ``repeats``, ``max_tokens``)."""
    compilers = build_grammar_stage(config, checkpoint).compilers
    fixed = {b: compilers[b].compile(GrammarSpec("json_schema", FIXED_KEYS)).grammar for b in BACKENDS}
    free = {b: compilers[b].compile(GrammarSpec("regex", FREE_TEXT)).grammar for b in BACKENDS}
    rows = []
    for batch in batches:
        prompts = _prompts(checkpoint.tokenizer, batch)
        for backend in BACKENDS:
            measured = _measure(engines, prompts, fixed[backend], free[backend], args)
            rows.append({"batch": batch, "backend": backend, **measured})
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    load = [load_average()]
    device = torch_device(args)
    checkpoint = open_checkpoint(args.model, default_cache_dir())
    batches = [int(b) for b in args.batches.split(",")]
    config = forced_config(PipelineConfig(model=args.model, max_model_len=1024), batches, args.max_tokens)
    engines = build_engines(checkpoint, config, device)
    corpus_parts = 2 * len(BACKENDS) if args.corpus else 0
    with tqdm(total=1 + corpus_parts, desc="forced", file=sys.stderr) as progress:
        results = measure_rows(engines, checkpoint, config, batches, args)
        progress.update(1)
        corpus = _corpus(engines, checkpoint, config, args.corpus, progress) if args.corpus else []
    load.append(load_average())
    print(
        f"\nforced: greedy, {args.repeats} interleaved repeats, answers of at most {args.max_tokens} tokens, "
        f"{device}, torch threads {torch.get_num_threads()}, {machine()}, load {load[0]} -> {load[1]}"
    )
    print_results(results, corpus)
    figures = {"scenario": "forced", "results": results, "corpus": corpus, "machine": machine(), "load": load}

    def plot(ax: Any) -> None:
        for backend in BACKENDS:
            mine = [r for r in results if r["backend"] == backend]
            ax.plot(
                [str(r["batch"]) for r in mine],
                [r["forced_over_one"]["median"] for r in mine],
                "o-",
                label=f"{backend} ÷ one per step",
            )
            ax.plot(
                [str(r["batch"]) for r in mine],
                [r["forced_over_plain"]["median"] for r in mine],
                "s--",
                label=f"{backend} ÷ plain",
            )
        ax.axhline(0.7, linestyle=":", color="grey")
        ax.set_xlabel("batch")
        ax.set_ylabel("time to the whole answer, forced ÷ other")
        ax.legend()

    write_outputs(args.out, "forced", figures, plot)
    return figures


def print_results(results: list[dict[str, Any]], corpus: list[dict[str, Any]]) -> None:
    def cell(spread: dict[str, Any]) -> str:
        return f"{spread['median']:.2f} ({spread['min']:.2f}-{spread['max']:.2f})"

    header = ["batch", "backend", "forced ÷ one/step", "forced ÷ plain", "steps/answer", "tokens/answer"]
    header += ["forced share", "nothing forced: on ÷ off"]
    rows = [
        [
            r["batch"],
            r["backend"],
            cell(r["forced_over_one"]),
            cell(r["forced_over_plain"]),
            f"{r['steps_per_answer_forced']} vs {r['steps_per_answer_one']}",
            f"{r['tokens_per_answer_forced']} vs {r['tokens_per_answer_one']}",
            r["forced_share"],
            cell(r["free_on_over_off"]),
        ]
        for r in results
    ]
    print_table(header, rows)
    print("(time to the whole answer, median (min-max) over repeats; steps and tokens per answer: forced vs one")
    print(" token per step; plain: no grammar, as many tokens as the forced answer; targets: ≤ 0.7 and ≤ 0.8)")
    if corpus:
        print("\ndev corpus, greedy: share of answer tokens forced, and forced answers against one-per-step ones")
        header = ["backend", "schemas", "forced share", "steps/answer", "same tokens", "respelled only", "other"]
        print_table(
            header,
            [
                [
                    c["backend"],
                    c["schemas"],
                    c["forced_share"],
                    f"{c['steps_per_answer_forced']} vs {c['steps_per_answer_one']}",
                    c["same_tokens"],
                    c["respelled_only"],
                    c["other"],
                ]
                for c in corpus
            ],
        )
