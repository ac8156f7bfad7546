"""The engine process's torch threads: the configured count, else one for a small model and one per
core for a larger one; a negative count is refused."""

from __future__ import annotations

import pytest

from pipeline import PipelineConfig
from pipeline.engine.threads import MIN_PARAMETERS_FOR_ALL_CORES, engine_threads
from sampling.families import build_runner
from vision.checkpoint import Checkpoint


def test_the_configured_count_wins_whatever_the_model() -> None:
    assert engine_threads(3, 10) == 3
    assert engine_threads(1, 10 * MIN_PARAMETERS_FOR_ALL_CORES) == 1
    assert engine_threads(0, 10) == 0  # torch's default: one per core


def test_unconfigured_a_small_model_gets_one_thread_and_a_larger_one_every_core() -> None:
    assert engine_threads(None, MIN_PARAMETERS_FOR_ALL_CORES - 1) == 1
    assert engine_threads(None, MIN_PARAMETERS_FOR_ALL_CORES) == 0


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_the_embedded_model_counts_as_small(checkpoint: Checkpoint, impl: str) -> None:
    runner = build_runner(checkpoint, impl=impl, device="cpu", max_model_len=64, num_blocks=4, block_size=16)  # type: ignore[arg-type]
    # between transformers' own count of the checkpoint's language model and of the whole model (the
    # adapter holds the vision tower too)
    from transformers import AutoModelForImageTextToText

    reference = AutoModelForImageTextToText.from_pretrained(checkpoint.path)
    whole = sum(p.numel() for p in reference.parameters())
    language = sum(p.numel() for p in reference.get_decoder().parameters())
    assert language <= runner.num_parameters <= whole
    assert engine_threads(PipelineConfig().engine_torch_threads, runner.num_parameters) == 1


def test_a_negative_thread_count_is_refused() -> None:
    with pytest.raises(ValueError, match="engine_torch_threads"):
        PipelineConfig(engine_torch_threads=-1)
