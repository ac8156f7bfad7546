"""schemas: the dev corpus (JSONSchemaBench) per grammar backend: compile time, mask fill per token,
and what greedy decoding under each grammar gives (checked by the answer check).

Each backend compiles every schema (strict, as a request would) in a worker thread with a deadline;
a compile past it counts as a timeout and its grammar is not used (serving answers 504 or falls
back). A thread cannot be stopped, so the benchmark then waits for it (until ``--drain-s`` after
it started) before the next compile: a stray compile would take a core from the ones after it.
The fill is timed on a fresh matcher walking a valid instance of the schema token by token (its
compact serialisation), or the greedy answer's tokens where there is no instance or the grammar
refuses it early. Then every compiled schema is decoded greedily in batches by the engine and each
answer that stops is checked against its whole schema: ``stop+invalid`` counts what the grammar let
through (in serving the answer check catches it: the request is resampled or refused, never returned).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from pipeline.bench.common import load_average, machine, percentile, print_table, write_outputs
from pipeline.config import PipelineConfig, default_cache_dir
from pipeline.engine.factory import build_llm_engine
from pipeline.errors import PipelineError
from pipeline.stage_factory import build_grammar_stage
from pipeline.types import GrammarSpec
from sampling.engine import LLMEngine
from sampling.guided.decoder import GuidedDecoder, new_matcher
from sampling.inputs import EngineInput
from sampling.params import SamplingParams
from stages.grammar.backends import Compiled
from vision.checkpoint import open_checkpoint

__all__ = ["add_arguments", "decode_all", "run"]

CORPUS = Path(__file__).resolve().parents[2] / "tests" / "data" / "jsonschemabench"
OUTCOMES = ("stop+valid", "stop+invalid", "length", "error")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--limit", type=int, default=0, help="only the first N schemas (0: all 220)")
    parser.add_argument("--backends", default="xgrammar,llguidance", help="comma-separated")
    parser.add_argument("--batch", type=int, default=32, help="sequences decoded at once")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--fill-steps", type=int, default=48, help="tokens walked per schema to time the fill")
    parser.add_argument("--compile-timeout", type=float, default=10.0, help="seconds per compile; past it: timeout")
    parser.add_argument("--drain-s", type=float, default=60.0, help="wait for a timed-out compile until then")
    parser.add_argument("--out", default=None)


@dataclass
class _Attempt:
    """One compile in its worker thread: the grammar or the error, and how long it took."""

    spec: GrammarSpec
    done: threading.Event = field(default_factory=threading.Event)
    seconds: float = 0.0
    compiled: Compiled | None = None
    error: Exception | None = None  # a PipelineError: refused; any other: a crash


def _compile_in_thread(compiler: Any, attempt: _Attempt) -> None:
    started = time.perf_counter()
    try:
        attempt.compiled = compiler.compile(attempt.spec)
    except Exception as exc:
        attempt.error = exc
    finally:
        attempt.seconds = time.perf_counter() - started
        attempt.done.set()


def _compile(compiler: Any, spec: GrammarSpec, timeout_s: float, drain_s: float) -> tuple[_Attempt, bool]:
    """The attempt, and whether it finished within ``timeout_s`` (otherwise waited for up to ``drain_s``)."""
    attempt = _Attempt(spec)
    # daemon: a compile still running when the benchmark ends must not hold the interpreter open
    threading.Thread(target=_compile_in_thread, args=(compiler, attempt), daemon=True).start()
    if attempt.done.wait(timeout_s):
        return attempt, True
    attempt.done.wait(max(0.0, drain_s - timeout_s))
    return attempt, False


def _walk(grammar: Any, tokens: list[int], guided: GuidedDecoder, steps: int) -> list[float]:
    """Seconds per bitmask fill of a fresh matcher along ``tokens`` (until the grammar refuses one)."""
    matcher = new_matcher(grammar)
    times = []
    for token in tokens[:steps]:
        started = time.perf_counter()
        guided.fill([matcher], [0])
        times.append(time.perf_counter() - started)
        if not guided.accept([matcher], [token])[0]:
            break
    return times


def decode_all(
    engine: LLMEngine, prompt: list[int], compiled: dict[str, Compiled], batch: int, max_tokens: int
) -> dict[str, tuple[str, list[int], str | None]]:
    """Greedy answers under each grammar, ``batch`` at a time: name -> (text, tokens, finish reason;
    an engine error's message as the text)."""
    outputs: dict[str, tuple[str, list[int], str | None]] = {}
    names = list(compiled)
    for start in range(0, len(names), batch):
        for name in names[start : start + batch]:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            engine.add(EngineInput(name, prompt, -1, None, params, compiled[name].grammar))
        while engine.has_work():
            for out in engine.step():
                text, tokens, _ = outputs.get(out.request_id, ("", [], None))
                text = (out.error or "") if out.finish_reason == "error" else text + out.text
                outputs[out.request_id] = (text, tokens + out.token_ids, out.finish_reason)
    return outputs


def _instance_tokens(raw: dict[str, Any], tokenizer: Any) -> list[int]:
    valid = [t["data"] for t in raw.get("tests", []) if t.get("valid")]
    if not valid:
        return []
    # the layout both backends write: no free whitespace, ", " between items, ": " after keys
    text = json.dumps(valid[0], ensure_ascii=False, separators=(", ", ": "))
    return list(tokenizer.encode(text, add_special_tokens=False))


def _compile_corpus(compiler: Any, corpus: dict[str, Any], args: argparse.Namespace, desc: str) -> dict[str, Any]:
    """Every schema compiled with a deadline: the grammars, the compile times, refusals and timeouts."""
    compiled: dict[str, Compiled] = {}
    seconds: list[float] = []
    refused: dict[str, list[str]] = {}  # message -> schemas
    timed_out: dict[str, float | None] = {}  # name -> its full compile time (None: still running)
    for name, raw in tqdm(corpus.items(), desc=desc, file=sys.stderr):
        attempt, in_time = _compile(
            compiler, GrammarSpec("json_schema", raw["schema"]), args.compile_timeout, args.drain_s
        )
        is_done = attempt.done.is_set()
        seconds.append(attempt.seconds if is_done else args.drain_s)  # still running: at least that long
        if not in_time:
            timed_out[name] = round(attempt.seconds, 2) if is_done else None
        elif isinstance(attempt.error, PipelineError):
            message = attempt.error.message.removeprefix("could not compile the json_schema: ")
            refused.setdefault(message[:100], []).append(name)
        elif attempt.error is not None:  # a bug of the backend or of ours: counted apart, never hidden
            refused.setdefault(f"crashed: {type(attempt.error).__name__}: {attempt.error}"[:100], []).append(name)
        elif attempt.compiled is not None:
            compiled[name] = attempt.compiled
    return {"compiled": compiled, "seconds": seconds, "refused": refused, "timed_out": timed_out}


def _check_answers(
    answers: dict[str, tuple[str, list[int], str | None]], compiled: dict[str, Compiled]
) -> dict[str, Any]:
    """Outcome counts; the schemas of each answer-check failure by keyword; engine errors by message."""
    outcomes: Counter[str] = Counter()
    invalid: dict[str, list[str]] = {}
    errors: Counter[str] = Counter()
    for name, (text, _, reason) in answers.items():
        if reason == "error":
            errors[text[:80]] += 1
        if reason != "stop":
            outcomes[str(reason)] += 1
            continue
        violation = compiled[name].check.check(text)
        outcomes["stop+valid" if violation is None else "stop+invalid"] += 1
        if violation is not None:
            invalid.setdefault(violation.reason, []).append(name)
    return {"outcomes": outcomes, "invalid": invalid, "errors": errors}


def _time_fills(
    compiled: dict[str, Compiled],
    corpus: dict[str, Any],
    answers: dict[str, tuple[str, list[int], str | None]],
    tokenizer: Any,
    guided: GuidedDecoder,
    steps: int,
) -> tuple[list[float], Counter[str]]:
    """Seconds per fill along each schema's instance (its greedy answer where the instance has no
    tokens or is refused early), and how many walks came from each source."""
    fills: list[float] = []
    sources: Counter[str] = Counter()
    for name, item in compiled.items():
        walked, source = _walk(item.grammar, _instance_tokens(corpus[name], tokenizer), guided, steps), "instance"
        greedy = answers[name][1]
        if len(walked) < steps // 2 and len(greedy) > len(walked):
            walked, source = _walk(item.grammar, greedy, guided, steps), "greedy answer"
        fills += walked
        sources[source] += 1
    return fills, sources


def _run_backend(
    backend: str, compiler: Any, corpus: dict[str, Any], engine: LLMEngine, tokenizer: Any, args: argparse.Namespace
) -> dict[str, Any]:
    done = _compile_corpus(compiler, corpus, args, f"compile {backend}")
    compiled, seconds = done["compiled"], done["seconds"]
    prompt = tokenizer.encode("[INST]Answer in JSON.[/INST]", add_special_tokens=False)
    answers = decode_all(engine, prompt, compiled, args.batch, args.max_tokens)
    checked = _check_answers(answers, compiled)
    guided = GuidedDecoder(engine.runner.cfg.vocab_size, 1, torch.device("cpu"))
    fills, sources = _time_fills(compiled, corpus, answers, tokenizer, guided, args.fill_steps)
    return {
        "schemas": len(corpus),
        "compiled": len(compiled),
        "refused": sum(map(len, done["refused"].values())),
        "timeouts": len(done["timed_out"]),
        **{f"compile_ms_p{q}": round(percentile(seconds, q) * 1000, 2) for q in (50, 90, 99)},
        "compile_ms_max": round(max(seconds, default=0.0) * 1000, 2),
        "compile_s_total": round(sum(seconds), 2),
        **{f"fill_ms_per_token_p{q}": round(percentile(fills, q) * 1000, 4) for q in (50, 90, 99)},
        "fill_ms_per_token_max": round(max(fills, default=0.0) * 1000, 4),
        "fill_tokens": len(fills),
        "fill_walks": dict(sources),
        **{outcome.replace("+", "_"): checked["outcomes"][outcome] for outcome in OUTCOMES},
        "refused_by_reason": done["refused"],
        "timed_out_s": done["timed_out"],
        "invalid_by_keyword": checked["invalid"],
        "errors": dict(checked["errors"].most_common()),
    }


def _print_backend(backend: str, r: dict[str, Any], timeout_s: float) -> None:
    print(
        f"\n{backend}: {r['schemas']} schemas: {r['compiled']} compiled, {r['refused']} refused, "
        f"{r['timeouts']} timed out (> {timeout_s:g} s)"
    )
    ms = ("p50", "p90", "p99", "max")
    rows: list[list[Any]] = [["compile ms", *(r[f"compile_ms_{q}"] for q in ms), f"total {r['compile_s_total']} s"]]
    walks = ", ".join(f"{n} {source}" for source, n in r["fill_walks"].items())
    rows.append(["fill ms/token", *(r[f"fill_ms_per_token_{q}"] for q in ms), f"{r['fill_tokens']} tokens ({walks})"])
    print_table(["", *ms, "of"], rows)
    counts = [*(r[outcome.replace("+", "_")] for outcome in OUTCOMES), r["refused"], r["timeouts"]]
    print_table([*OUTCOMES, "refused", "timeout"], [counts])
    if r["refused_by_reason"]:
        print(f"refused (message: schemas): {r['refused_by_reason']}")
    if r["timed_out_s"]:
        print(f"timed out (full compile s; None: still running after the drain): {r['timed_out_s']}")
    if r["invalid_by_keyword"]:
        print(f"stop+invalid (keyword: schemas): {r['invalid_by_keyword']}")
    if r["errors"]:
        print(f"engine errors: {r['errors']}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    load = [load_average()]
    checkpoint = open_checkpoint(None, default_cache_dir())
    paths = sorted(CORPUS.glob("*.json"))[: args.limit or None]
    corpus = {p.stem: json.loads(p.read_text()) for p in paths}
    config = PipelineConfig(
        max_running_seqs=args.batch,
        max_model_len=1024,
        num_kv_blocks=args.batch * (-(-(args.max_tokens + 32) // 16)),  # prompt (< 32 tokens) + answer, each
    )
    compilers = build_grammar_stage(config, checkpoint).compilers
    engine = build_llm_engine(checkpoint, config, device="cuda" if torch.cuda.is_available() else "cpu")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    tokenizer = checkpoint.tokenizer
    results = {b: _run_backend(b, compilers[b], corpus, engine, tokenizer, args) for b in backends}
    load.append(load_average())
    print(
        f"\nschemas: {len(corpus)} JSONSchemaBench schemas, strict, greedy, batch {args.batch}, "
        f"max_tokens {args.max_tokens}, {machine()}, load {load[0]} -> {load[1]}"
    )
    for backend, r in results.items():
        _print_backend(backend, r, args.compile_timeout)
    figures = {
        "scenario": "schemas",
        "results": results,
        "compile_timeout_s": args.compile_timeout,
        "machine": machine(),
        "load": load,
    }

    def plot(ax: Any) -> None:
        names = list(results)
        ax.bar(names, [results[b]["compile_ms_p90"] for b in names])
        ax.set_ylabel("compile p90 (ms)")

    write_outputs(args.out, "schemas", figures, plot)
    return figures
