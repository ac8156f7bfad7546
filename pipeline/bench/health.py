"""health: /health latency while a burst of image requests is prepared, against an inline baseline.

Two bursts per server: every request with an image of its own (``distinct``: each is fetched,
decoded, processed and encoded) and every request with one image (``repeated``: after the first,
encoder-cache hits, so what remains is the server's own work per request).

The server runs in its own process, the burst in this one, and the probe in a third: a probe on a
thread of the burst's process waited for that interpreter's lock behind the burst client's own work
(sending 128 bodies of 595 KB), up to the 5 ms switch interval per wake-up, and counted it as the
server's latency.

``--floor`` also probes an idle server (an aiohttp app whose ``/health`` does nothing else, in a
process of its own) during each burst, the same way: what the machine, busy with the burst, allows
any server, so that a server's latency above it is its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import subprocess
import sys
import threading
import time
from typing import Any

import aiohttp
from aiohttp import web
from tqdm import tqdm

from pipeline.bench.common import (
    DistinctImages,
    ImageServer,
    jpeg_data_url,
    load_average,
    machine,
    median,
    percentile,
    print_table,
    write_outputs,
)

__all__ = ["add_arguments", "run"]

# the pipeline as configured (preparation in worker processes, the engine in its own process); the same
# with the engine on a thread of the server; preparation in its bounded threads; a thread per request
# (unbounded pool); all on the loop
MODES = ("pipeline", "engine-thread", "threads", "unbounded", "inline")
IMAGES = ("distinct", "repeated")
FLOOR_KEYS = ("floor_p50_ms", "floor_p99_ms", "floor_max_ms")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--burst", type=int, default=128, help="concurrent image requests per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--probe-interval-ms", type=float, default=10.0)
    parser.add_argument("--out", default=None, help="folder for the JSON figures and a PNG plot")
    parser.add_argument("--switch-interval-ms", type=float, default=None, help="passed to every server")
    parser.add_argument("--images", default=",".join(IMAGES), help="distinct, repeated or both, comma-separated")
    parser.add_argument("--servers", default=",".join(MODES), help=f"servers to run, of {', '.join(MODES)}")
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also probe an idle aiohttp server in its own process during each burst (the machine's floor)",
    )


class _Server:
    """``python -m pipeline serve`` in a child process."""

    def __init__(self, mode: str, burst: int, trace: str | None = None, extra: tuple[str, ...] = ()) -> None:
        args = [sys.executable, "-m", "pipeline", "serve", "--port", "0", "--allow-private-networks"]
        if trace:
            args += ["--trace", trace]
        args += list(extra)
        args += ["--max-pending", str(burst * 2), "--stage-queue-size", str(burst * 2)]
        if mode == "engine-thread":
            args += ["--engine-mode", "thread"]
        elif mode == "inline":
            args += ["--inline-preparation", "--preparation-mode", "thread"]
        elif mode == "threads":
            args += ["--preparation-mode", "thread"]
        elif mode == "unbounded":  # a thread per request in flight, as an unbounded pool would give
            args += ["--preparation-mode", "thread", "--decode-threads", str(burst), "--template-threads", str(burst)]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("serving"):
                self.base = line.rsplit(" ", 1)[-1].strip()
                return
        raise RuntimeError("the server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def _idle_server(conn: Any) -> None:
    """In a process of its own until terminated: an aiohttp server whose ``/health`` answers and does
    nothing else; its base URL is sent through ``conn``."""

    async def main() -> None:
        app = web.Application()

        async def health(_: web.Request) -> web.Response:
            return web.json_response({"status": "ok"})

        app.router.add_get("/health", health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        conn.send(f"http://{host}:{port}")
        await asyncio.Event().wait()

    asyncio.run(main())


class _IdleServer:
    """``_idle_server`` in a child process: the floor's subject."""

    def __init__(self) -> None:
        spawn = multiprocessing.get_context("spawn")
        receive, send = spawn.Pipe(duplex=False)
        self.proc = spawn.Process(target=_idle_server, args=(send,), daemon=True)
        self.proc.start()
        send.close()
        if not receive.poll(60):
            raise RuntimeError("the idle server did not start")
        self.base: str = receive.recv()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.join(timeout=60)


def _probe(base: str, interval: float, ready: Any, stop: Any, conn: Any) -> None:
    """In a process of its own: GET /health every ``interval`` seconds (``ready`` set after the
    first) until ``stop`` is set, then send the (start, latency) samples through ``conn``.
    ``perf_counter`` is the system's monotonic clock: the starts compare with the burst's."""
    samples: list[tuple[float, float]] = []

    async def loop() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
            while not stop.is_set():
                started = time.perf_counter()
                async with session.get(f"{base}/health") as resp:
                    await resp.read()
                done = time.perf_counter()
                samples.append((started, done - started))
                ready.set()
                await asyncio.sleep(max(0.0, interval - (done - started)))

    asyncio.run(loop())
    conn.send(samples)
    conn.close()


async def _burst(base: str, bodies: list[bytes]) -> tuple[float, int]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(body: bytes) -> int:
            async with session.post(
                f"{base}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
            ) as resp:
                await resp.read()
                return resp.status

        started = time.perf_counter()
        statuses = await asyncio.gather(*(one(b) for b in bodies))
        return time.perf_counter() - started, sum(1 for s in statuses if s == 200)


def _bodies(jpegs: list[bytes], urls: list[str]) -> list[bytes]:
    """One request per image: even ones carry it as base64, odd ones as its http URL."""
    out = []
    for i, (jpeg, http_url) in enumerate(zip(jpegs, urls, strict=True)):
        url = jpeg_data_url(jpeg) if i % 2 == 0 else http_url
        content = [{"type": "text", "text": f"Describe image {i}."}, {"type": "image_url", "image_url": {"url": url}}]
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1, "temperature": 0}
        out.append(json.dumps(body).encode())
    return out


def _latencies(samples: list[tuple[float, float]], prefix: str = "") -> dict[str, float]:
    latencies = [lat for _, lat in samples]
    return {
        prefix + "p50_ms": percentile(latencies, 50) * 1000,
        prefix + "p99_ms": percentile(latencies, 99) * 1000,
        prefix + "max_ms": max(latencies) * 1000,
    }


def _measure(base: str, bodies: list[bytes], interval: float, floor: str | None = None) -> dict[str, Any]:
    """The burst's ``/health`` latencies at ``base``, and (``floor_*``) at the idle server ``floor``
    if given, probed alike by a process of its own."""
    spawn = multiprocessing.get_context("spawn")
    stop = spawn.Event()
    probes = []
    for url in [base] + ([floor] if floor else []):
        ready = spawn.Event()
        receive, send = spawn.Pipe(duplex=False)
        probe = spawn.Process(target=_probe, args=(url, interval, ready, stop, send), daemon=True)
        probe.start()
        send.close()
        if not ready.wait(timeout=60):
            raise RuntimeError("the /health probe did not start")
        probes.append((probe, receive))
    time.sleep(0.2)  # a few idle samples first
    duration, ok = asyncio.run(_burst(base, bodies))
    stop.set()
    sampled: list[list[tuple[float, float]]] = [receive.recv() for _, receive in probes]
    for probe, _ in probes:
        probe.join()
    out = _latencies(sampled[0])
    if floor:
        out |= _latencies(sampled[1], "floor_")
    return {**out, "req_per_s": len(bodies) / duration, "ok": ok, "samples": sampled[0]}


class _ImagesThread:
    """The local image server on its own thread and loop, so the burst's client does not slow it."""

    def __init__(self, jpegs: list[bytes]) -> None:
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.url = ""
        self._server = ImageServer(jpegs)
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)
        self._thread.start()
        self._ready.wait()

    def url_for(self, index: int) -> str:
        return self._server.url_for(index)

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        async with self._server as server:
            self.url = server.url
            self._ready.set()
            await self._stop.wait()

    def stop(self) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join()


def _burst_bodies(args: argparse.Namespace, images: _ImagesThread, jpegs: list[bytes]) -> dict[str, list[list[bytes]]]:
    """Per image kind, the bodies of each repeat: distinct images never repeat across runs (the
    server's encoder cache lives as long as the server); image 0 is the repeated one."""
    burst = args.burst
    distinct = [
        _bodies(jpegs[1 + r * burst : 1 + (r + 1) * burst], [images.url_for(1 + r * burst + i) for i in range(burst)])
        for r in range(args.repeats)
    ]
    repeated = _bodies([jpegs[0]] * burst, [images.url_for(0)] * burst)
    return {"distinct": distinct, "repeated": [repeated] * args.repeats}


def run(args: argparse.Namespace) -> dict[str, Any]:
    kinds = [k.strip() for k in args.images.split(",") if k.strip()]
    if not kinds or any(k not in IMAGES for k in kinds):
        raise SystemExit(f"--images: choose from {', '.join(IMAGES)}")
    modes = [m for m in MODES if m in {s.strip() for s in args.servers.split(",")}]
    if "pipeline" not in modes:
        raise SystemExit("--servers: the pipeline is the subject, keep it")
    jpegs = DistinctImages().jpegs(0, 1 + args.burst * args.repeats)
    results: dict[tuple[str, str], list[dict[str, Any]]] = {(m, k): [] for m in modes for k in kinds}
    load_before = load_average()

    images = _ImagesThread(jpegs)
    idle = _IdleServer() if args.floor else None
    floor = idle.base if idle is not None else None
    with tqdm(total=len(modes) * (len(kinds) * args.repeats + 1), desc="health", file=sys.stderr) as progress:
        bodies = _burst_bodies(args, images, jpegs)
        try:
            for mode in modes:
                trace = args.trace if mode == "pipeline" else None
                extra = ("--switch-interval-ms", str(args.switch_interval_ms)) if args.switch_interval_ms else ()
                server = _Server(mode, burst=args.burst, trace=trace, extra=extra)
                try:
                    _measure(server.base, bodies["repeated"][0][:4], args.probe_interval_ms / 1000)  # warm-up
                    progress.update()
                    for r in range(args.repeats):
                        for kind in kinds:
                            results[mode, kind].append(
                                _measure(server.base, bodies[kind][r], args.probe_interval_ms / 1000, floor)
                            )
                            progress.update()
                finally:
                    server.stop()
        finally:
            images.stop()
            if idle is not None:
                idle.stop()
    keys = ("p50_ms", "p99_ms", "max_ms", "req_per_s", "ok") + (FLOOR_KEYS if floor else ())

    def summary(mode: str, kind: str) -> dict[str, float]:
        runs = results[mode, kind]
        return {k: median([r[k] for r in runs]) for k in keys}

    labels = {
        "pipeline": "pipeline (worker processes, engine process)",
        "engine-thread": "pipeline, engine thread",
        "threads": "bounded threads",
        "unbounded": "unbounded threads",
        "inline": "inline baseline",
    }
    print(
        f"\nhealth: burst of {args.burst} image requests (1024x768 JPEG, half base64, half http), "
        f"median of {args.repeats} runs, {machine()}, load {load_before} -> {load_average()}"
    )
    rows = []
    for kind in kinds:
        for mode in modes:
            s = summary(mode, kind)
            row = [labels[mode], kind, s["p50_ms"], s["p99_ms"], s["max_ms"], s["req_per_s"], int(s["ok"])]
            rows.append(row + [s[k] for k in FLOOR_KEYS if k in s])
    floor_columns = ["floor p50 ms", "floor p99 ms", "floor max ms"] if floor else []
    print_table(["server", "images", "p50 ms", "p99 ms", "max ms", "req/s", "ok", *floor_columns], rows)
    print("(targets for the pipeline, both image kinds: p99 <= 5 ms, max <= 25 ms, req/s >= bounded threads')")
    if floor:
        print("(floor: an idle aiohttp server in its own process, probed alike during the same bursts)")

    def figures_of(kind: str) -> dict[str, float]:
        out: dict[str, float] = {}
        # the pipeline's keys bare, the others' prefixed
        prefixes = {"pipeline": "", "engine-thread": "engine_thread_", "threads": "threads_"}
        prefixes |= {"inline": "baseline_", "unbounded": "unbounded_"}
        for mode in modes:
            s = summary(mode, kind)
            for key in ("p50_ms", "p99_ms", "max_ms", "req_per_s") + (FLOOR_KEYS if floor else ()):
                out[prefixes[mode] + key] = round(s[key], 3 if key.endswith("ms") else 2)
        return out

    per_kind = {kind: figures_of(kind) for kind in kinds}
    figures = {
        "scenario": "health",
        "burst": args.burst,
        "images": kinds[0],
        **per_kind[kinds[0]],
        "by_images": per_kind,
        "repeats": args.repeats,
        "machine": machine(),
    }

    def plot(ax: Any) -> None:
        styles = {"pipeline": "-", "engine-thread": "-", "threads": "-.", "unbounded": "--", "inline": ":"}
        for mode in modes:
            style = styles[mode]
            samples: list[tuple[float, float]] = results[mode, kinds[0]][-1]["samples"]
            t0 = samples[0][0]
            ax.plot([t - t0 for t, _ in samples], [lat * 1000 for _, lat in samples], style, label=mode)
        ax.set_xlabel(f"seconds since the probe started ({kinds[0]} images)")
        ax.set_ylabel("/health latency (ms)")
        ax.set_yscale("log")
        ax.legend()

    write_outputs(args.out, "health", figures, plot)
    return figures
