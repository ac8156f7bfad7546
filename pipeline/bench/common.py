"""Shared pieces of the benchmarks: statistics, tables, output files, test images, a local image server."""

from __future__ import annotations

import base64
import io
import json
import os
import platform
import random
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from pipeline.observability.trace import Tracer

__all__ = [
    "DistinctImages",
    "ImageServer",
    "add_model_argument",
    "add_torch_arguments",
    "children_cpu_seconds",
    "jpeg_bytes",
    "jpeg_data_url",
    "load_average",
    "machine",
    "median",
    "percentile",
    "print_table",
    "torch_device",
    "tracer_for",
    "write_outputs",
]

_TRACERS: dict[str, Tracer] = {}


def tracer_for(args: Any) -> Tracer | None:
    """The run's tracer when ``--trace FILE`` was given (one per file, written when the run ends)."""
    path = getattr(args, "trace", None)
    if not path:
        return None
    return _TRACERS.setdefault(path, Tracer())


def write_traces() -> None:
    for path, tracer in _TRACERS.items():
        tracer.write(path)
        print(f"trace: {tracer.num_events} events written to {path} (open it in https://ui.perfetto.dev)")


def add_model_argument(parser: Any) -> None:
    """``--model DIR``: a Hugging Face checkpoint folder to measure instead of the embedded default model."""
    parser.add_argument(
        "--model", default=None, help="checkpoint folder (config, safetensors, tokenizer); default: the embedded model"
    )


def add_torch_arguments(parser: Any) -> None:
    """``--torch-threads`` and ``--device``, read by ``torch_device``."""
    parser.add_argument("--torch-threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")


def torch_device(args: Any) -> str:
    """Apply ``--torch-threads``; the device ``--device`` names (auto: CUDA when there is one)."""
    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    return args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), nearest-rank; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def machine() -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{platform.machine()}, {os.cpu_count()} cores, {gpu}"


def children_cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of processes ``pids`` so far (Linux ``/proc``; 0 for one gone)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


def load_average() -> float:
    """The 1-minute load average: how busy a shared machine was around a run (compare with its cores)."""
    return round(os.getloadavg()[0], 2)


def print_table(headers: list[str], rows: list[list[Any]]) -> None:
    cells = [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


def write_outputs(out_dir: str | None, scenario: str, figures: dict[str, Any], plot: Any = None) -> None:
    """With ``--out DIR``: DIR/SCENARIO.json and, given a ``plot(ax)`` function, DIR/SCENARIO.png."""
    if not out_dir:
        return
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{scenario}.json").write_text(json.dumps(figures, indent=2))
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
        plot(ax)
        ax.set_title(f"{scenario} ({machine()})", fontsize=9)
        fig.tight_layout()
        fig.savefig(folder / f"{scenario}.png")
        plt.close(fig)


def jpeg_bytes(width: int = 1024, height: int = 768) -> bytes:
    """A noisy JPEG (quality 90) with a coloured box; the noise differs between calls (Pillow's C rand)."""
    from PIL import Image

    rng = random.Random(0)
    image = Image.effect_noise((width, height), 40).convert("RGB")
    image.paste((rng.randrange(256), 80, 160), (100, 100, 600, 500))
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def jpeg_data_url(jpeg: bytes) -> str:
    """``jpeg`` (e.g. from ``jpeg_bytes()``) as a base64 ``data:image/jpeg`` URL."""
    return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()


class DistinctImages:
    """JPEGs of one size that all differ (a box of another colour at another place on one noise
    background), so no two requests of a burst share an encoder-cache entry: preparation runs for each.
    """

    def __init__(self, width: int = 1024, height: int = 768, seed: int = 0) -> None:
        from PIL import Image

        self.width, self.height, self.seed = width, height, seed
        self._background = Image.effect_noise((width, height), 40).convert("RGB")
        self._cache: dict[int, bytes] = {}

    def jpeg(self, index: int) -> bytes:
        """The ``index``-th image (the same bytes each time it is asked for)."""
        if index not in self._cache:
            rng = random.Random(self.seed * 1_000_003 + index)
            image = self._background.copy()
            x, y = rng.randrange(self.width // 2), rng.randrange(self.height // 2)
            colour = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
            image.paste(colour, (x, y, x + self.width // 3, y + self.height // 3))
            buf = io.BytesIO()
            image.save(buf, format="JPEG", quality=90)
            self._cache[index] = buf.getvalue()
        return self._cache[index]

    def jpegs(self, start: int, count: int) -> list[bytes]:
        return [self.jpeg(i) for i in range(start, start + count)]


class ImageServer:
    """Serves images on 127.0.0.1: ``/image.jpg`` (the first) and ``/image/{i}.jpg`` (each of them)."""

    def __init__(self, body: bytes | list[bytes], content_type: str = "image/jpeg") -> None:
        self.bodies = [body] if isinstance(body, bytes) else list(body)
        self.content_type = content_type
        self._runner: web.AppRunner | None = None
        self.url = ""

    def url_for(self, index: int) -> str:
        """The URL of image ``index`` (indexes past the end wrap around)."""
        return self.url.removesuffix("/image.jpg") + f"/image/{index % len(self.bodies)}.jpg"

    async def __aenter__(self) -> ImageServer:
        app = web.Application()

        async def first(_: web.Request) -> web.Response:
            return web.Response(body=self.bodies[0], content_type=self.content_type)

        async def nth(request: web.Request) -> web.Response:
            index = int(request.match_info["index"])
            if not 0 <= index < len(self.bodies):
                raise web.HTTPNotFound()
            return web.Response(body=self.bodies[index], content_type=self.content_type)

        app.router.add_get("/image.jpg", first)
        app.router.add_get("/image/{index:\\d+}.jpg", nth)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}/image.jpg"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
