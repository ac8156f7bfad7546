"""DeviceQueue: the one-step-ahead loop's stand-in for a CUDA stream."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from sampling.overlap import DeviceQueue


def test_jobs_run_in_submission_order_on_one_thread_under_inference_mode() -> None:
    queue = DeviceQueue()
    gate = threading.Event()
    seen: list[tuple[int, str, bool]] = []

    def job(i: int) -> int:
        if i == 0:
            assert gate.wait(5)  # later jobs queue up behind this one
        seen.append((i, threading.current_thread().name, torch.is_inference_mode_enabled()))
        return i * i

    results = [queue.submit(job, i) for i in range(5)]
    gate.set()
    assert [f.result(timeout=5) for f in results] == [0, 1, 4, 9, 16]
    assert [i for i, _, _ in seen] == list(range(5))
    assert len({name for _, name, _ in seen}) == 1 and seen[0][1] != threading.current_thread().name
    assert all(inference for _, _, inference in seen)
    queue.shutdown()


def test_an_exception_reaches_the_caller_and_the_queue_goes_on() -> None:
    queue = DeviceQueue()

    def fail() -> None:
        raise RuntimeError("device lost")

    with pytest.raises(RuntimeError, match="device lost"):
        queue.call(fail)
    assert queue.call(lambda: 7) == 7
    queue.shutdown()


def test_idle_before_counts_only_time_the_queue_sat_empty() -> None:
    queue = DeviceQueue()
    gate = threading.Event()
    queue.call(lambda: None)
    queued_behind = [queue.submit(gate.wait, 5), queue.submit(queue.idle_before)]
    gate.set()
    assert queued_behind[1].result(timeout=5) == 0.0  # submitted while the job before it ran
    emptied = time.perf_counter()
    while time.perf_counter() - emptied < 0.02:  # keep the queue empty a known while (not a synchronisation)
        pass
    assert queue.call(queue.idle_before) >= 0.02
    queue.shutdown()
