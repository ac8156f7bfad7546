"""What ``bench compile-model`` measures besides TPOT: operators launched per decode step, and what
compiling costs a fresh process with an empty and with a warm inductor cache.

Operators: one decode forward under ``torch.profiler`` counts the top-level ATen operators (and the
paged attention op), the device-independent count of what an eager GPU run would launch; inductor's
fused CPU kernels run outside ATen, so their calls are counted as the Python-visible calls of the
compiled wrapper (each is one launch, as each Triton kernel is on a GPU).

Start: ``python -m pipeline.bench.compile_probe CHECKPOINT CACHE_DIR`` loads the checkpoint's runner
in a new process, then times the first decode step at B = 1 and at B = 8 (one graph serves both) compiled,
minus the same steps eager; it prints one JSON line. Run once on an empty cache folder (cold) and
once more on the same folder (warm: what a restart pays).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from sampling.families import build_runner
from sampling.paged_runner import PagedRunner
from vision.checkpoint import open_checkpoint

__all__ = ["count_step_ops", "decode_once", "time_start"]

_OPERATOR_PREFIXES = ("aten::", "vlm_pipeline::")


def decode_once(runner: PagedRunner, batch_size: int, first_position: int = 40) -> torch.Tensor:
    """One decode step of ``batch_size`` rows (each in its own blocks); its logits."""
    blocks = -(-(first_position + batch_size + 1) // runner.block_size)
    tables = [list(range(row * blocks, (row + 1) * blocks)) for row in range(batch_size)]
    positions = [first_position + row for row in range(batch_size)]
    return runner.decode(list(range(100, 100 + batch_size)), runner.decode_inputs(positions, tables))


def _is_top_level(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(_OPERATOR_PREFIXES):
            return False
        parent = parent.cpu_parent
    return True


def count_step_ops(runner: PagedRunner, batch_size: int) -> int:
    """Operators one decode step launches: top-level ATen operators plus compiled kernel calls."""
    from torch.profiler import ProfilerActivity, profile

    kernels = 0

    def count_kernels(frame: Any, event: str, arg: Any) -> None:
        nonlocal kernels
        if event == "c_call" and getattr(arg, "__name__", "") == "kernel":  # inductor's CPU kernels
            kernels += 1

    decode_once(runner, batch_size)  # compiled (or warm) before the count
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        sys.setprofile(count_kernels)
        try:
            decode_once(runner, batch_size)
        finally:
            sys.setprofile(None)
    ops = Counter(e.name for e in prof.events() if e.name.startswith(_OPERATOR_PREFIXES) and _is_top_level(e))
    return sum(ops.values()) + kernels


def time_start(checkpoint: Path, cache_dir: Path) -> dict[str, float]:
    """Compile seconds of a new process on ``cache_dir`` (see the module docstring)."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir))
    command = [sys.executable, "-m", "pipeline.bench.compile_probe", str(checkpoint), str(cache_dir)]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def _first_steps(runner: PagedRunner) -> float:
    start = time.perf_counter()
    for batch_size in (1, 8):
        decode_once(runner, batch_size)
    return time.perf_counter() - start


def _main(checkpoint_path: str) -> None:
    checkpoint = open_checkpoint(checkpoint_path, Path(checkpoint_path).parent)
    runner = build_runner(checkpoint, device="cpu", max_model_len=1024, num_blocks=64, block_size=16)
    eager = min(_first_steps(runner) for _ in range(3))
    runner.compile_decode()
    first = _first_steps(runner)
    print(json.dumps({"compile_s": round(first - eager, 2), "first_steps_s": round(first, 2)}))


if __name__ == "__main__":
    _main(sys.argv[1])
