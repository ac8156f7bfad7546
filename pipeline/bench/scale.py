"""scale: requests/s and CPU-seconds per request with 1 and 2 Ray Serve replicas.

A local Ray cluster with one CPU per replica runs the Serve application (``pipeline.scaleout.ray_serve``);
clients send image requests (a distinct 512x384 JPEG each, ``max_tokens`` tokens) through Ray's
HTTP proxy, a fixed number at a time. CPU is read from ``/proc`` for every process of the cluster
and split by role: Ray's HTTP proxy, the ingress, the replicas, and the rest (GCS, raylet, Serve's
controller). The client runs in this process and is not counted.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from typing import Any

import anyio

from pipeline.bench.common import jpeg_data_url, load_average, machine, median, print_table, write_outputs
from pipeline.config import PipelineConfig

__all__ = ["add_arguments", "run"]

ROLES = {"proxy": "ProxyActor", "ingress": ":Ingress", "replicas": ":PipelineReplica"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", default="1,2", help="replica counts to compare (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=96, help="requests per run")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight per replica")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--preparation-mode", choices=("process", "thread"), default="thread")
    parser.add_argument("--out", default=None)


def _descendants(root: int) -> list[tuple[int, int]]:
    """Every process under ``root`` with its parent, each after its parent."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        parent = todo.pop()
        for child in parents.get(parent, []):
            out.append((child, parent))
            todo.append(child)
    return out


def _cpu_by_role() -> dict[str, float]:
    """CPU seconds so far of every process this one started (the cluster), by role; a replica's own
    children (its engine process, its preparation workers) count as the replica's."""
    tick = os.sysconf("SC_CLK_TCK")
    cpu = dict.fromkeys([*ROLES, "other"], 0.0)
    replicas: set[int] = set()
    for pid, parent in _descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().decode(errors="replace")
        except OSError:
            continue
        role = next((r for r, mark in ROLES.items() if mark in title), "other")
        if role == "replicas" or parent in replicas:
            role = "replicas"
            replicas.add(pid)
        cpu[role] += (int(fields[11]) + int(fields[12])) / tick
    return cpu


async def _load(url: str, bodies: list[dict[str, Any]], concurrency: int) -> int:
    import aiohttp

    ok = 0
    limiter = anyio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def one(body: dict[str, Any]) -> None:
            nonlocal ok
            async with limiter, session.post(url + "/v1/chat/completions", json=body) as resp:
                await resp.read()
                ok += resp.status == 200

        async with anyio.create_task_group() as tg:
            for body in bodies:
                tg.start_soon(one, body)
    return ok


def _image_bodies(n: int, start: int, max_tokens: int) -> list[dict[str, Any]]:
    """Distinct images (a different colour block each), so no request finds another's cache entry."""
    import io

    from PIL import Image, ImageDraw

    bodies = []
    for i in range(start, start + n):
        image = Image.new("RGB", (512, 384), ((i * 37) % 256, (i * 91) % 256, (i * 53) % 256))
        ImageDraw.Draw(image).rectangle((i % 400, i % 300, i % 400 + 100, i % 300 + 80), fill=(255 - i % 256, 40, 90))
        buf = io.BytesIO()
        image.save(buf, format="JPEG", quality=90)
        content = [
            {"type": "text", "text": f"Describe image {i}."},
            {"type": "image_url", "image_url": {"url": jpeg_data_url(buf.getvalue())}},
        ]
        bodies.append(
            {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "ignore_eos": True}
        )
    return bodies


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray import serve

    from pipeline.scaleout.ray_serve import APP_NAME, build_app

    counts = [int(n) for n in args.replicas.split(",")]
    ray.init(num_cpus=max(counts), include_dashboard=False, log_to_driver=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    config = PipelineConfig(preparation_mode=args.preparation_mode, max_pending_requests=4 * args.concurrency)
    figures: dict[str, Any] = {"machine": machine(), "load_before": load_average(), "runs": {}}
    next_image = 0
    try:
        for n in counts:
            serve.run(build_app(config, replicas=n), name=APP_NAME, route_prefix="/")
            anyio.run(_load, url, _image_bodies(4 * n, 10_000, 2), 2 * n)  # warm every replica
            runs = []
            for _ in range(args.repeats):
                bodies = _image_bodies(args.requests, next_image, args.max_tokens)
                next_image += args.requests
                before, started = _cpu_by_role(), time.perf_counter()
                ok = anyio.run(_load, url, bodies, args.concurrency * n)
                elapsed = time.perf_counter() - started
                after = _cpu_by_role()
                cpu = {role: (after[role] - before[role]) / args.requests for role in after}
                runs.append({"ok": ok, "req_s": args.requests / elapsed, "cpu_s_per_req": cpu})
            serve.delete(APP_NAME)
            figures["runs"][n] = {
                "req_s": median([r["req_s"] for r in runs]),
                "cpu_s_per_req": {
                    role: median([r["cpu_s_per_req"][role] for r in runs]) for role in runs[0]["cpu_s_per_req"]
                },
                "ok": sum(r["ok"] for r in runs),
                "requests": args.requests * args.repeats,
                "all_req_s": [round(r["req_s"], 2) for r in runs],
            }
    finally:
        serve.shutdown()
        ray.shutdown()
    figures["load_after"] = load_average()
    base = figures["runs"][counts[0]]
    rows = []
    for n, r in figures["runs"].items():
        cpu = r["cpu_s_per_req"]
        total = sum(cpu.values())
        r["speedup"] = r["req_s"] / base["req_s"]
        r["per_replica_efficiency"] = r["speedup"] / (n / counts[0])
        rows.append(
            [
                n,
                r["req_s"],
                r["speedup"],
                r["per_replica_efficiency"],
                total,
                cpu["replicas"],
                cpu["ingress"],
                cpu["proxy"],
                cpu["other"],
                f"{r['ok']}/{r['requests']}",
            ]
        )
    print(
        f"scale: {args.requests} image requests x {args.repeats} runs, {args.max_tokens} tokens each, "
        f"{args.concurrency} in flight per replica; {figures['machine']}; load {figures['load_before']} -> "
        f"{figures['load_after']}"
    )
    print_table(
        ["replicas", "req/s", "speedup", "per-replica eff", "cpu-s/req", "replicas", "ingress", "proxy", "other", "ok"],
        rows,
    )
    write_outputs(args.out, "scale", figures)
    return figures
