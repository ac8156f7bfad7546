"""bodies: the serving process's memory during a burst of compressed bodies, and /health during a bomb.

A server (``python -m pipeline serve``) in its own process gets ``--bursts`` of concurrent gzip bodies,
each a chat request whose one message is ``--inflated-mb`` of one repeated character (about 1,000:1
compressed, under the 64 MiB body limit). Its RSS is sampled every 20 ms: the peak during each burst
and what is held ``--settle`` seconds after it. Then one body of ``--bomb-mb`` compressed bytes that
inflates to about 1,000 times as much, while a thread asks ``/health`` every 5 ms on a connection of
its own: the body's status and time, and the longest ``/health`` wait. Last, two bodies that stall
(10 of 1,000 bytes; a chunk-size line promising 2 GiB, then 1 KiB): how long the server holds each
before its 408 and close.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import socket
import threading
import time
import zlib
from collections import Counter
from typing import Any

import aiohttp

from pipeline.bench.common import load_average, machine, print_table, write_outputs
from pipeline.bench.server_process import ServerProcess

__all__ = ["add_arguments", "run"]

_MB = 1024 * 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bursts", default="24,40", help="concurrent bodies per burst, comma-separated")
    parser.add_argument("--inflated-mb", type=float, default=60.0, help="each body's JSON once inflated")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds after a burst before RSS is read again")
    parser.add_argument("--bomb-mb", type=float, default=2.0, help="compressed MiB of the bomb (0: none)")
    parser.add_argument("--no-stall", action="store_true", help="skip the stalled bodies (held 30 s by default)")
    parser.add_argument("--serve-args", default="", help="more options for the server, space-separated")
    parser.add_argument("--out", default=None)


def _gzip_stream(prefix: bytes, fill: bytes, count: int, suffix: bytes) -> bytes:
    """gzip of ``prefix + fill * count + suffix``, compressed piecewise (never held inflated)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    parts = [packer.compress(prefix)]
    parts += [packer.compress(fill) for _ in range(count)]
    parts += [packer.compress(suffix), packer.flush()]
    return b"".join(parts)


def chat_gzip(inflated_bytes: int) -> bytes:
    """A chat request of ``inflated_bytes`` of JSON (one long message), gzip-compressed."""
    prefix, suffix = b'{"max_tokens": 1, "messages": [{"role": "user", "content": "', b'"}]}'
    fill = b"a" * _MB
    return _gzip_stream(prefix, fill, max(1, inflated_bytes // _MB), suffix)


async def _post_all(base: str, body: bytes, count: int) -> tuple[Counter[int], float]:
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        async def one() -> int:
            async with session.post(f"{base}/v1/chat/completions", data=body, headers=headers) as resp:
                await resp.read()
                return resp.status

        started = time.perf_counter()
        statuses = await asyncio.gather(*(one() for _ in range(count)))
        return Counter(statuses), time.perf_counter() - started


def _probe_health(base: str, stop: threading.Event, waits: list[float]) -> None:
    """GET /health every 5 ms on one keep-alive connection until ``stop``; each wait in ``waits``."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    while not stop.is_set():
        started = time.perf_counter()
        conn.request("GET", "/health")
        conn.getresponse().read()
        waits.append(time.perf_counter() - started)
        stop.wait(0.005)
    conn.close()


def _bomb(server: ServerProcess, compressed_mb: float) -> dict[str, Any]:
    inflated_mb = max(1, round(compressed_mb * 1024))  # a MiB of one character deflates to about 1 KiB
    body = chat_gzip(inflated_mb * _MB)
    stop, waits = threading.Event(), list[float]()
    probe = threading.Thread(target=_probe_health, args=(server.base, stop, waits), daemon=True)
    probe.start()
    time.sleep(0.2)  # a few idle samples first
    statuses, seconds = asyncio.run(_post_all(server.base, body, 1))
    time.sleep(5.0)  # and what follows the answer (aiohttp went on inflating a bomb it had refused)
    stop.set()
    probe.join()
    return {
        "bomb_compressed_mb": round(len(body) / _MB, 2),
        "bomb_inflated_mb": inflated_mb,
        "bomb_status": next(iter(statuses)),
        "bomb_s": round(seconds, 3),
        "health_max_ms": round(max(waits) * 1000, 1),
        "health_probes": len(waits),
    }


def _stalled_for(base: str, head: bytes, sent: bytes, out: dict[str, Any], name: str) -> None:
    """Send ``head`` and ``sent``, then nothing: the seconds until the server closes, and its status."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=600) as sock:
        sock.sendall(head + sent)
        started = time.perf_counter()
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        out[f"{name}_held_s"] = round(time.perf_counter() - started, 2)
        out[f"{name}_status"] = int(answer.split(b" ", 2)[1]) if answer else None


def _stalls(base: str) -> dict[str, Any]:
    post = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    cases = {
        "length": (post + b"Content-Length: 1000\r\n\r\n", b'{"messages'),
        "chunked": (post + b"Transfer-Encoding: chunked\r\n\r\n", b"80000000\r\n" + b"x" * 1024),
    }
    out: dict[str, Any] = {}
    threads = [threading.Thread(target=_stalled_for, args=(base, *sent, out, name)) for name, sent in cases.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    body = chat_gzip(int(args.inflated_mb * _MB))
    server = ServerProcess(args.serve_args.split())
    figures: dict[str, Any] = {"machine": machine(), "body_kb": round(len(body) / 1024, 1)}
    rows = []
    try:
        asyncio.run(_post_all(server.base, chat_gzip(1024), 1))  # warm: one small compressed request
        figures["rss_idle_mb"] = round(server.rss() / _MB)
        for burst in [int(b) for b in args.bursts.split(",") if b]:
            server.reset_peak()
            statuses, seconds = asyncio.run(_post_all(server.base, body, burst))
            peak = server.peak
            time.sleep(args.settle)
            after = server.rss()
            row = {
                "burst": burst,
                "statuses": dict(sorted(statuses.items())),
                "burst_s": round(seconds, 2),
                "rss_peak_mb": round(peak / _MB),
                "rss_after_mb": round(after / _MB),
            }
            figures[f"burst_{burst}"] = row
            rows.append([burst, row["statuses"], row["burst_s"], row["rss_peak_mb"], row["rss_after_mb"]])
        if args.bomb_mb > 0:
            figures["bomb"] = _bomb(server, args.bomb_mb)
        if not args.no_stall:
            figures["stalled"] = _stalls(server.base)
    finally:
        server.stop()
    figures["load_average"] = load_average()
    if rows:
        print_table(["burst", "statuses", "seconds", "RSS peak MB", f"RSS +{args.settle:g} s MB"], rows)
    if "bomb" in figures:
        bomb = figures["bomb"]
        print(
            f"bomb: {bomb['bomb_compressed_mb']} MiB -> {bomb['bomb_inflated_mb']} MiB: {bomb['bomb_status']} "
            f"in {bomb['bomb_s']} s; /health waited at most {bomb['health_max_ms']} ms ({bomb['health_probes']} probes)"
        )
    if "stalled" in figures:
        print("stalled bodies held:", figures["stalled"])
    write_outputs(args.out, "bodies", figures)
    return figures
