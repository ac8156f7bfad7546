"""Command line: ``python -m pipeline serve|bench`` (nothing in the project imports this module)."""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from stages.reasoning import PARSERS as REASONING_PARSERS

if TYPE_CHECKING:
    from pipeline.api.connections import ConnectionLimits
    from pipeline.config import PipelineConfig

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

DEMO_SCHEMA = {
    "type": "object",
    "properties": {
        "caption": {"type": "string", "maxLength": 40},
        "dominant_color": {"type": "string", "enum": ["red", "green", "blue", "other"]},
        "objects": {"type": "integer", "minimum": 0, "maximum": 20},
    },
    "required": ["caption", "dominant_color", "objects"],
    "additionalProperties": False,
}


def demo_request() -> dict[str, object]:
    """A multimodal, schema-guided chat request with an image made on the spot."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (320, 240), (30, 60, 200))
    ImageDraw.Draw(image).ellipse((100, 60, 220, 180), fill=(230, 40, 40))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Describe this image as JSON."},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "description", "schema": DEMO_SCHEMA, "strict": True},
        },
        "max_tokens": 96,
        "temperature": 0,
    }


async def _send_demo(port: int) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=demo_request()) as resp:
            body = await resp.json()
    print(f"POST /v1/chat/completions (image + json_schema) -> {resp.status}")
    if resp.status != 200:
        print(json.dumps(body, indent=2))
        return
    choice = body["choices"][0]
    print(f"finish_reason: {choice['finish_reason']}   usage: {body['usage']}")
    print("content:", choice["message"]["content"])
    print("stage timings (s):", {k: round(v, 4) for k, v in body["timings"].items()})


def _config(args: argparse.Namespace) -> PipelineConfig:
    from pipeline.config import PipelineConfig

    return PipelineConfig(
        model=args.model,
        served_model_names=tuple(args.served_model_name or ()),
        grammar_backend=args.grammar_backend,
        forced_tokens=args.forced_tokens,
        grammar_abandon_on_shutdown=True,  # exit within --shutdown-timeout, whatever still compiles
        device=args.device,
        compile_model={None: "auto", True: "on", False: "off"}[args.compile],
        decode_buffers=args.decode_buffers,
        dtype=args.dtype,
        engine_torch_threads=args.engine_threads,
        prefill_seqs_per_step=args.prefill_seqs_per_step,
        mixed_chunk_tokens=args.mixed_chunk_tokens,
        allow_private_networks=args.allow_private_networks,
        inline_preparation=args.inline_preparation,
        max_pending_requests=args.max_pending,
        stage_queue_size=args.stage_queue_size,
        decode_threads=args.decode_threads,
        template_threads=args.template_threads,
        max_messages=args.max_messages,
        max_content_parts=args.max_content_parts,
        max_tools=args.max_tools,
        chat_template=args.chat_template,
        chat_template_content_format=args.chat_template_content_format,
        trust_request_chat_template=args.trust_request_chat_template,
        allow_control_tokens_in_content=args.allow_control_tokens_in_content,
        reasoning_parser=args.reasoning_parser,
        generation_config=args.generation_config,
        preparation_mode=args.preparation_mode,
        prep_workers=args.prep_workers,
        engine_mode=args.engine_mode,
    )


def _connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    from pipeline.api.connections import ConnectionLimits

    return ConnectionLimits(
        max_connections=args.max_connections,
        reserved_connections=args.reserved_connections,
        header_timeout_s=args.header_timeout,
        keepalive_timeout_s=args.keepalive_timeout,
        body_timeout_s=args.body_timeout,
        body_timeout_rate=args.body_timeout_rate,
    )


async def serve(args: argparse.Namespace) -> None:
    from pipeline.api.auth import resolve_api_key
    from pipeline.api.listener import listen
    from pipeline.api.server import create_app
    from pipeline.core.pipeline import Pipeline
    from pipeline.observability.trace import Tracer
    from vision.heap import freeze_heap

    config = _config(args)
    limits = _connection_limits(args)  # refuses bad values before the model loads
    print(f"loading {args.model or 'the embedded default model'} ...", flush=True)
    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    tracer = Tracer() if args.trace else None
    async with Pipeline(config, tracer=tracer) as pipe:
        freeze_heap()  # the model, the tokenizer and the stages stay: no collection walks them again
        app = create_app(
            pipe,
            max_inflating_bytes=round(args.max_inflating_mb * 1024 * 1024),
            api_key=resolve_api_key(args.api_key),
            protect_all=args.api_key_everywhere,
        )
        defaults = pipe.sampling_defaults.as_dict()
        print(
            f"chat template: content as {pipe.preparation.template.content_format}; "
            f"sampling defaults: {defaults or 'none'}",
            flush=True,
        )
        async with listen(app, args.host, args.port, limits) as listener:
            port = listener.port
            print(f"serving {pipe.model_name} on {listener.url}", flush=True)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            if args.demo or args.once:
                await _send_demo(port)
            if not args.once:
                await stop.wait()
                print("shutting down: no new requests; finishing those in flight", flush=True)
            pipe.stop_accepting()
            await pipe.drain(args.shutdown_timeout)
    if tracer is not None:
        tracer.write(args.trace)
        print(f"trace: {tracer.num_events} events written to {args.trace}", flush=True)


def _exit_without_waiting_for_threads() -> None:
    """Exit now if worker threads still run: a grammar compile abandoned at shutdown is one C++ call
    that cannot be interrupted, and the interpreter would wait for it past --shutdown-timeout."""
    main = threading.main_thread()
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not main):
        print("exiting without waiting for abandoned grammar compiles", flush=True)
        sys.stderr.flush()
        os._exit(0)


def _default(name: str) -> object:
    """The default of ``PipelineConfig.<name>``: CLI options default to the config, never to a copy of it."""
    import dataclasses

    from pipeline.config import PipelineConfig

    return next(f.default for f in dataclasses.fields(PipelineConfig) if f.name == name)


def _write_checkpoint(args: argparse.Namespace) -> int:
    """``checkpoint``: a preset's random-weight checkpoint, in bf16 (the dtype the engine runs on a GPU)."""
    import torch

    from vision.default_checkpoint import write_pixtral_checkpoint

    started = time.perf_counter()
    from vision.sized_checkpoint import PRESETS

    shape = PRESETS[args.preset]
    count = write_pixtral_checkpoint(Path(args.folder), shape, seed=args.seed, device=args.device, dtype=torch.bfloat16)
    print(f"{args.folder}: {args.preset}, {count / 1e9:.2f}B parameters, {time.perf_counter() - started:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    from pipeline.api.connections import ConnectionLimits
    from pipeline.api.inflate import MAX_INFLATING_BYTES

    parser = argparse.ArgumentParser(prog="python -m pipeline")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="the OpenAI-compatible server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--model",
        default=_default("model"),
        help="a checkpoint folder, a .gguf file, or a Hugging Face name ORG/NAME (from the Hugging Face cache, "
        "downloaded into it when missing unless HF_HUB_OFFLINE=1); default: the embedded model",
    )
    s.add_argument(
        "--served-model-name",
        action="append",
        help="a name requests may give as 'model' (repeatable; the first is reported); default: the checkpoint's",
    )
    s.add_argument("--device", default=_default("device"), help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    s.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile the decode step's model forward with torch.compile (inductor; kernels cached under the "
        "cache dir between starts); default: auto, which compiles nowhere yet (docs/benchmarks.md)",
    )
    s.add_argument(
        "--dtype",
        default=_default("dtype"),
        choices=["auto", "float32", "bfloat16", "float16"],
        help="the language model's weights and KV cache; auto: bfloat16 on CUDA, float32 elsewhere "
        "(default: %(default)s)",
    )
    s.add_argument(
        "--decode-buffers",
        action=argparse.BooleanOptionalAction,
        default=_default("decode_buffers"),
        help="decode steps read their inputs from tensors allocated once, batches padded to buckets "
        "(what a CUDA graph replays; default: off)",
    )
    s.add_argument(
        "--engine-threads",
        type=int,
        default=_default("engine_torch_threads"),
        help="torch's intra-op threads in the engine process; 0: one per core; default: 1 for a model under "
        "50M parameters, else one per core",
    )
    s.add_argument(
        "--prefill-seqs-per-step",
        type=int,
        default=_default("prefill_seqs_per_step"),
        help="sequences whose prefill chunks share one forward (default: %(default)s)",
    )
    s.add_argument(
        "--mixed-chunk-tokens",
        type=int,
        default=_default("mixed_chunk_tokens"),
        help="running decodes join a prefill step of at most this many tokens; 0: never (default: %(default)s)",
    )
    s.add_argument(
        "--grammar-backend",
        default=_default("grammar_backend"),
        choices=["auto", "xgrammar", "llguidance"],
        help="structured-output backend; auto picks per request (default: %(default)s)",
    )
    s.add_argument(
        "--forced-tokens",
        action=argparse.BooleanOptionalAction,
        default=_default("forced_tokens"),
        help="write what a constraint forces (keys, quotes, separators) without a decode step per token (default: on)",
    )
    s.add_argument("--allow-private-networks", action="store_true")
    s.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $PIPELINE_API_KEY; none: open)",
    )
    s.add_argument(
        "--api-key-everywhere",
        action="store_true",
        help="require the key on /health, /metrics and /openapi.json too",
    )
    s.add_argument(
        "--max-pending",
        type=int,
        default=_default("max_pending_requests"),
        help="requests admitted at once before 429 (default: %(default)s)",
    )
    s.add_argument(
        "--stage-queue-size",
        type=int,
        default=_default("stage_queue_size"),
        help="inbox of every stage (default: %(default)s)",
    )
    s.add_argument(
        "--decode-threads",
        type=int,
        default=_default("decode_threads"),
        help="image decode threads (default: %(default)s)",
    )
    s.add_argument(
        "--template-threads",
        type=int,
        default=_default("template_threads"),
        help="chat template + tokenize threads (default: %(default)s)",
    )
    for name, what in (
        ("max_messages", "messages in one chat request"),
        ("max_content_parts", "content parts and earlier tool calls of one request's messages together"),
        ("max_tools", "tools in one chat request"),
    ):
        s.add_argument(
            f"--{name.replace('_', '-')}",
            type=int,
            default=_default(name),
            help=f"{what}; more is a 400 before any rendering (default: %(default)s)",
        )
    s.add_argument(
        "--chat-template",
        default=_default("chat_template"),
        help="a Jinja chat template file (or the template's text) used instead of the tokenizer's",
    )
    s.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let a request bring its own chat template ('chat_template'); off: such a request is a 400",
    )
    s.add_argument(
        "--allow-control-tokens-in-content",
        action="store_true",
        help="encode control-token text in messages and tools ('[INST]', '<|im_end|>') as the tokens it "
        "spells, as transformers and vLLM do; off: as text, so only the chat template writes them",
    )
    s.add_argument(
        "--reasoning-parser",
        default=_default("reasoning_parser"),
        choices=["auto", "none", *REASONING_PARSERS],
        help="how a reasoning model's thinking is told from its answer (returned as reasoning_content, "
        "constraints applied after it): auto picks the model's own (default: %(default)s)",
    )
    s.add_argument(
        "--chat-template-content-format",
        default=_default("chat_template_content_format"),
        choices=["auto", "string", "openai"],
        help="a message's content as the template takes it: one string, or OpenAI's list of parts; "
        "auto reads the template (default: %(default)s)",
    )
    s.add_argument(
        "--generation-config",
        default=_default("generation_config"),
        help="sampling defaults for fields a request leaves unset: auto (the checkpoint's "
        "generation_config.json), none (OpenAI's), or a folder holding one (default: %(default)s)",
    )
    limits = ConnectionLimits()
    s.add_argument(
        "--max-connections",
        type=int,
        default=limits.max_connections,
        help="connections open at once, the reserve included; lowered to fit the open-file limit "
        "(default: %(default)s)",
    )
    s.add_argument(
        "--reserved-connections",
        type=int,
        default=limits.reserved_connections,
        help="of those, kept for /health probes when the rest are taken (default: %(default)s)",
    )
    s.add_argument(
        "--header-timeout",
        type=float,
        default=limits.header_timeout_s,
        help="seconds for a request's head to arrive whole; then 408 and close (default: %(default)s)",
    )
    s.add_argument(
        "--keepalive-timeout",
        type=float,
        default=limits.keepalive_timeout_s,
        help="seconds an idle keep-alive connection stays open (default: %(default)s)",
    )
    s.add_argument(
        "--body-timeout",
        type=float,
        default=limits.body_timeout_s,
        help="seconds for a request's body to arrive whole, a second more per --body-timeout-rate bytes "
        "received; then 408 and close (default: %(default)s)",
    )
    s.add_argument(
        "--body-timeout-rate",
        type=float,
        default=limits.body_timeout_rate,
        help="bytes of a body that earn it a second more (default: %(default)s)",
    )
    s.add_argument(
        "--max-inflating-mb",
        type=float,
        default=MAX_INFLATING_BYTES / (1024 * 1024),
        help="MiB of compressed request bodies held inflated at once, across requests; past it a 503 "
        "(default: %(default)s)",
    )
    s.add_argument("--inline-preparation", action="store_true", help="benchmark baseline: prepare on the event loop")
    s.add_argument(
        "--preparation-mode",
        choices=("process", "thread"),
        default=_default("preparation_mode"),
        help="image preparation in low-priority worker processes or in threads (default: %(default)s)",
    )
    s.add_argument("--prep-workers", type=int, default=0, help="worker processes (0: from the core count)")
    s.add_argument(
        "--engine-mode",
        choices=("process", "thread"),
        default=_default("engine_mode"),
        help="the decode engine in its own process, or on a thread of the server: one process (default: %(default)s)",
    )
    s.add_argument("--demo", action="store_true", help="send one image + JSON-schema request at start")
    s.add_argument("--once", action="store_true", help="run the demo request and exit")
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds a shutdown waits for requests in flight; those left get a 503 (default: %(default)s)",
    )
    # The event loop waits for the GIL whenever a worker thread holds it (the chat template, the
    # tokenizer, data URL hashing): up to the interval each time. With the interpreter's 5 ms, a
    # profile of a repeated-image burst had the loop waiting for the GIL for more of its time than it
    # ran; 0.5 ms measured in interleaved bursts to two servers (6 each, load 8-9): /health p99 42.5
    # -> 31.2 ms with the engine process, 42.0 -> 36.9 ms with the engine thread, req/s not lower.
    s.add_argument(
        "--switch-interval-ms",
        type=float,
        default=0.5,
        help="interpreter GIL switch interval: how long the loop may wait for a busy worker thread "
        "(default: %(default)s; the interpreter's own is 5)",
    )
    s.add_argument("--ray", action="store_true", help="serve on Ray Serve replicas with cache-affinity routing")
    s.add_argument("--replicas", type=int, default=2, help="with --ray: pipeline replicas (default: %(default)s)")
    s.add_argument(
        "--replica-cpus",
        type=float,
        default=1.0,
        help="with --ray: CPUs Ray reserves per replica (default: %(default)s)",
    )
    s.add_argument(
        "--ray-address",
        default=None,
        help="with --ray: the cluster to join (default: $RAY_ADDRESS, else a local cluster started here)",
    )
    s.add_argument("--trace", default=None, help="write every request's stage spans (Chrome trace JSON) at exit")
    b = sub.add_parser("bench", help="benchmarks: python -m pipeline bench SCENARIO --help")
    c = sub.add_parser("checkpoint", help="write a random-weight checkpoint of a released model's shape")
    c.add_argument("folder")
    from vision.sized_checkpoint import PRESETS

    c.add_argument("--preset", default="pixtral-7b", choices=sorted(PRESETS))
    c.add_argument("--device", default="cpu", help="where the weights are drawn (cuda: seconds, cpu: minutes)")
    c.add_argument("--seed", type=int, default=0)
    from pipeline.bench import add_bench_arguments, run_bench

    add_bench_arguments(b)
    args = parser.parse_args(argv)
    if args.command == "serve" and args.ray:
        from pipeline.scaleout.launch import serve_on_ray

        return serve_on_ray(args, _config(args), _send_demo if args.demo or args.once else None)
    if args.command == "serve":
        from sampling.hf_adapter import UnsupportedModel
        from vision.checkpoint import ModelUnavailable

        try:
            asyncio.run(serve(args))
        except (UnsupportedModel, ModelUnavailable) as exc:  # the user's model, not a bug: its message, no traceback
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 1
        _exit_without_waiting_for_threads()
        return 0
    if args.command == "checkpoint":
        return _write_checkpoint(args)
    return run_bench(args)
