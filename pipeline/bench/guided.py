"""guided: time per output token with a JSON-schema grammar ÷ without, per backend, batch 1, 8 and 32;
and our guided TPOT ÷ transformers' ``generate`` with xgrammar's logits processor.

Drives the decode engine directly (no request pipeline) with the same prompts and the same output
lengths. The engine admits one prefill per step, so a batch of B fills over B steps and empties over
B more: every sequence generates ``--steps`` + B tokens, which gives ``--steps`` decode steps that
run the whole batch. TPOT is the median time of those steps (prefill and the ramps are excluded).

Each repeat runs interleaved pairs, a plain run and then a guided run, for each backend (the same
schema compiled by both): the guided run is under a schema whose shortest valid output is longer
than ``max_tokens`` (so every sequence runs to it), the plain run uses ``ignore_eos``. A pair's
ratio is the guided TPOT ÷ the plain TPOT just before it, so drift of a shared machine cancels
within a pair; the median over pairs is reported with their quartiles, min and max. Each repeat
ends with transformers' ``generate`` on the same prompts and the same xgrammar grammar: its TPOT is
the time of ``--steps`` + 2 tokens less that of 2 (prefill excluded), and ours ÷ its is taken within
the repeat too. The step timeline shows what overlaps the forward pass (the bitmask fill) and what
adds to it (apply, sample, accept).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
from tqdm import tqdm

from pipeline.bench.common import (
    add_model_argument,
    add_torch_arguments,
    load_average,
    machine,
    median,
    percentile,
    print_table,
    torch_device,
    write_outputs,
)
from pipeline.bench.forced import build_engines, forced_config, measure_rows
from pipeline.bench.forced import print_results as print_forced
from pipeline.config import PipelineConfig, default_cache_dir
from pipeline.engine.factory import build_llm_engine
from pipeline.stage_factory import build_grammar_stage
from pipeline.types import GrammarSpec
from sampling.engine import LLMEngine, StepTiming
from sampling.inputs import EngineInput
from sampling.params import SamplingParams
from vision.checkpoint import open_checkpoint

__all__ = ["add_arguments", "guided_schema", "run", "run_guided"]

PARTS = ("forward", "fill", "wait", "apply", "sample", "copy", "accept", "total")
BACKENDS = ("xgrammar", "llguidance")


def guided_schema(num_fields: int) -> dict[str, Any]:
    """Required string fields, each at least one token: no valid output is shorter than ``num_fields``."""
    names = [f"field_{i}" for i in range(num_fields)]
    return {
        "type": "object",
        "properties": {name: {"type": "string"} for name in names},
        "required": names,
        "additionalProperties": False,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    # short runs, many pairs: the two runs of a pair are close in time, so a shared machine's load
    # changes less between them
    parser.add_argument("--steps", type=int, default=32, help="full-batch decode steps timed per run")
    parser.add_argument(
        "--repeats",
        type=int,
        default=9,
        help="interleaved plain-guided pairs per backend and batch size; the median ratio is reported",
    )
    add_torch_arguments(parser)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers generate() comparison")
    parser.add_argument(
        "--forced",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="add bench forced's rows: the whole answer with forced tokens ÷ one token per step ÷ plain",
    )
    parser.add_argument("--out", default=None, help="folder for guided.json and guided.png")


def _run_once(engine: LLMEngine, prompts: list[list[int]], grammar: Any, steps: int, tag: str) -> list[StepTiming]:
    """The ``steps`` full-batch decode steps of one run (each sequence generates ``steps`` + batch tokens).

    :raises RuntimeError: if a sequence ends early or the batch ran fewer full steps (runs would not compare).
    """
    engine.timeline.clear()
    num_tokens = steps + len(prompts)  # the ramps: one sequence joins per step, and leaves per step
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=grammar is None)
        engine.add(EngineInput(f"{tag}-{i}", prompt, 10, None, params, grammar))
    generated = [0] * len(prompts)
    while engine.has_work():
        for out in engine.step():
            if out.finish_reason not in (None, "length"):
                raise RuntimeError(f"{out.request_id} ended with {out.finish_reason}: the lengths would differ")
            generated[int(out.request_id.rsplit("-", 1)[1])] += len(out.token_ids)
    if generated != [num_tokens] * len(prompts):
        raise RuntimeError(f"{tag}: generated {generated} tokens, not {num_tokens} each")
    full = [t for t in engine.timeline if t.kind == "decode" and t.batch == len(prompts)]
    if len(full) < steps:
        raise RuntimeError(f"{tag}: {len(full)} full-batch decode steps, not {steps}: did the scheduler change?")
    return full


def _means(steps: list[StepTiming]) -> dict[str, float]:
    return {p: statistics.fmean(getattr(t, p) for t in steps) * 1000 if steps else 0.0 for p in PARTS}


def _load_hf_model(checkpoint: Any, device: str) -> Any:
    """The checkpoint as a transformers model (Llava: the language model is its Mistral part)."""
    import transformers

    model: Any = transformers.AutoModelForImageTextToText.from_pretrained(checkpoint.path, dtype=torch.float32)
    return model.to(device).eval()


def _hf_generate(model: Any, prompts: list[list[int]], grammar: Any, num_tokens: int) -> float:
    """Seconds for transformers' ``generate`` of ``num_tokens`` greedy tokens per prompt (left-padded),
    with xgrammar's logits processor (a new one per call: it cannot be reused)."""
    from xgrammar.contrib.hf import LogitsProcessor

    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    with torch.inference_mode():
        started = time.perf_counter()
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            do_sample=False,
            logits_processor=[LogitsProcessor([grammar] * len(prompts))],
            pad_token_id=0,
        )
        seconds = time.perf_counter() - started
    if out.shape[1] != width + num_tokens:
        raise RuntimeError(f"generate() gave {out.shape[1] - width} tokens, not {num_tokens}")
    return seconds


def _hf_tpot(model: Any, prompts: list[list[int]], grammar: Any, steps: int) -> float:
    """transformers' ``generate`` with xgrammar: seconds per output token, prefill excluded (the time
    of ``steps`` + 2 tokens less that of 2)."""
    short, full = _hf_generate(model, prompts, grammar, 2), _hf_generate(model, prompts, grammar, steps + 2)
    return (full - short) / steps


def _summary(values: list[float], key: str) -> dict[str, Any]:
    """``key``: the median of ``values``; with its quartiles, min, max and every value."""
    return {
        key: round(median(values), 3),
        f"{key}_p25": round(percentile(values, 25), 3),
        f"{key}_p75": round(percentile(values, 75), 3),
        f"{key}_min": round(min(values), 3),
        f"{key}_max": round(max(values), 3),
        f"{key}_all": [round(v, 3) for v in values],
    }


def _measure_batch(
    engine: LLMEngine,
    prompts: list[list[int]],
    grammars: dict[str, Any],
    hf_model: Any,
    args: argparse.Namespace,
    progress: Any,
) -> tuple[list[dict[str, Any]], dict[str, dict[str, float]]]:
    """One batch size: a result row per backend and the step timeline of each run kind."""
    batch = len(prompts)
    for grammar in (None, *grammars.values()):
        _run_once(engine, prompts, grammar, 4, "warm")
    if hf_model is not None:
        _hf_generate(hf_model, prompts, grammars["xgrammar"], 2)  # warm-up: the first call is slow
    ratios: dict[str, list[float]] = {name: [] for name in grammars}
    over_hf: dict[str, list[float]] = {name: [] for name in grammars}
    tpots: dict[str, list[float]] = {name: [] for name in (*grammars, "plain", "hf")}
    step_log: dict[str, list[StepTiming]] = {name: [] for name in (*grammars, "plain")}
    for r in range(args.repeats):
        for name, grammar in grammars.items():
            plain = _run_once(engine, prompts, None, args.steps, f"p{name}{batch}-{r}")
            guided = _run_once(engine, prompts, grammar, args.steps, f"g{name}{batch}-{r}")
            tp, tg = median([t.total for t in plain]), median([t.total for t in guided])
            ratios[name].append(tg / tp)
            tpots["plain"].append(tp)
            tpots[name].append(tg)
            step_log["plain"] += plain
            step_log[name] += guided
            progress.update(2)
        if hf_model is not None:
            hf = _hf_tpot(hf_model, prompts, grammars["xgrammar"], args.steps)
            tpots["hf"].append(hf)
            for name in grammars:
                over_hf[name].append(tpots[name][-1] / hf)  # ours (this repeat's guided run) ÷ theirs
            progress.update(1)
    rows = []
    for name in grammars:
        row: dict[str, Any] = {
            "batch": batch,
            "backend": name,
            "tpot_ms_plain": round(median(tpots["plain"]) * 1000, 3),
            "tpot_ms_guided": round(median(tpots[name]) * 1000, 3),
            **_summary(ratios[name], "ratio"),
            # the best run of each kind: what the machine gives without other load, a cross-check
            "ratio_of_best": round(min(tpots[name]) / min(tpots["plain"]), 3),
        }
        if tpots["hf"]:
            row["tpot_ms_hf_generate_xgrammar"] = round(median(tpots["hf"]) * 1000, 3)
            row.update(_summary(over_hf[name], "ours_over_hf"))
        rows.append(row)
    return rows, {f"{batch} {name}": _means(log) for name, log in step_log.items()}


def _print_results(results: list[dict[str, Any]]) -> None:
    def span(row: dict[str, Any], key: str, low: str, high: str) -> str:
        return f"{row[f'{key}_{low}']:.2f}-{row[f'{key}_{high}']:.2f}" if key in row else "-"

    header = ["batch", "backend", "TPOT plain ms", "guided ms", "ratio", "IQR", "min-max", "best÷best"]
    header += ["HF generate+xgrammar ms", "ours ÷ HF", "IQR", "min-max"]
    rows = []
    for r in results:
        cells = [r["batch"], r["backend"], r["tpot_ms_plain"], r["tpot_ms_guided"], r["ratio"]]
        cells += [span(r, "ratio", "p25", "p75"), span(r, "ratio", "min", "max"), r["ratio_of_best"]]
        cells += [r.get("tpot_ms_hf_generate_xgrammar", "-"), r.get("ours_over_hf", "-")]
        cells += [span(r, "ours_over_hf", "p25", "p75"), span(r, "ours_over_hf", "min", "max")]
        rows.append(cells)
    print_table(header, rows)
    print("(ratio: median over pairs of guided TPOT ÷ the plain TPOT measured just before it, target ≤ 1.05;")
    print(" ours ÷ HF: our guided TPOT ÷ transformers' generate() with xgrammar's logits processor, same prompts,")
    print(" schema and repeat; TPOT columns: medians; IQR: the pairs' quartiles; best÷best: the fastest guided")
    print(" run's TPOT ÷ the fastest plain run's, a cross-check less sensitive to other load on the machine)")


def run_guided(args: argparse.Namespace) -> dict[str, Any]:
    """Run the scenario; print its tables and return ``{"scenario": "guided", "results": [...]}``."""
    load = [load_average()]
    device = torch_device(args)
    checkpoint = open_checkpoint(args.model, default_cache_dir())
    tokenizer = checkpoint.tokenizer
    batches = [int(b) for b in args.batches.split(",")]
    config = PipelineConfig(
        model=args.model,
        max_running_seqs=max(batches),
        max_model_len=1024,
        kv_block_size=16,
        # each sequence: its prompt (< 64 tokens) and steps + batch tokens
        num_kv_blocks=max(batches) * (-(-(args.steps + max(batches) + 64) // 16)),
        forced_tokens=False,  # a decode step per token: what this scenario's TPOT is of (bench forced: with)
    )
    engine = build_llm_engine(checkpoint, config, device=device, record_timeline=True)
    spec = GrammarSpec("json_schema", guided_schema(args.steps + max(batches) + 1))
    compilers = build_grammar_stage(config, checkpoint).compilers
    grammars = {name: compilers[name].compile(spec).grammar for name in BACKENDS}
    hf_model = None if args.no_hf else _load_hf_model(checkpoint, device)
    results: list[dict[str, Any]] = []
    timelines: dict[str, dict[str, float]] = {}
    per_repeat = 2 * len(grammars) + (hf_model is not None)
    with tqdm(total=len(batches) * args.repeats * per_repeat, desc="guided", file=sys.stderr) as progress:
        for batch in batches:
            prompts = [
                tokenizer.encode(f"[INST]Write note {i} about the sea.[/INST]", add_special_tokens=False)
                for i in range(batch)
            ]
            rows, timeline = _measure_batch(engine, prompts, grammars, hf_model, args, progress)
            results += rows
            timelines.update(timeline)
    threads = torch.get_num_threads()
    load.append(load_average())
    print(
        f"\nguided: {args.steps} full-batch steps per run, greedy, {args.repeats} interleaved pairs per backend, "
        f"{device}, torch threads {threads}, {machine()}, load {load[0]} -> {load[1]}"
    )
    _print_results(results)
    print("\nstep timeline (mean ms of full-batch decode steps; fill runs while the forward pass runs)")
    print_table(["run", *PARTS], [[name, *(t[p] for p in PARTS)] for name, t in timelines.items()])
    figures = {"scenario": "guided", "results": results, "machine": machine(), "load": load}
    if args.forced:
        forced_args = argparse.Namespace(repeats=max(1, args.repeats // 3), max_tokens=96)
        config = forced_config(config, batches, forced_args.max_tokens)
        engines = build_engines(checkpoint, config, device)
        figures["forced"] = forced_rows = measure_rows(engines, checkpoint, config, batches, forced_args)
        print(f"\nwith forced tokens ({forced_args.repeats} interleaved repeats; bench forced has the corpus too)")
        print_forced(forced_rows, [])

    def plot(ax: Any) -> None:
        for name in grammars:
            mine = [r for r in results if r["backend"] == name]
            ax.errorbar(
                [str(r["batch"]) for r in mine],
                [r["ratio"] for r in mine],
                yerr=[[r["ratio"] - r["ratio_min"] for r in mine], [r["ratio_max"] - r["ratio"] for r in mine]],
                fmt="o-",
                capsize=4,
                label=name,
            )
        ax.axhline(1.05, linestyle=":", color="grey", label="target")
        ax.set_xlabel("batch")
        ax.set_ylabel("guided TPOT ÷ plain TPOT (median pair, min-max)")
        ax.legend()

    extra = {"timeline_ms": timelines, "torch_threads": threads, "device": device}
    write_outputs(args.out, "guided", {**figures, **extra}, plot)
    return figures


run = run_guided  # the name ``python -m pipeline bench`` calls
