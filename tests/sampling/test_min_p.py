"""min_p: after the temperature, against transformers' MinPLogitsWarper, and before top-k and top-p
(vLLM's order, which differs from ``generate``'s: there min-p comes last)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from sampling.params import SamplingParams
from sampling.sampler import filter_logits, sample

VOCAB = 2000


def _warped(warpers: list[LogitsProcessor], row: torch.Tensor) -> torch.Tensor:
    no_ids = torch.zeros(1, 0, dtype=torch.long)  # warpers read no input ids
    return LogitsProcessorList(warpers)(no_ids, row[None].clone())[0]  # type: ignore[arg-type]


@pytest.mark.parametrize(("temperature", "min_p"), [(1.0, 0.05), (0.7, 0.3), (1.8, 0.01), (1.0, 1.0)])
def test_min_p_keeps_what_transformers_keeps(temperature: float, min_p: float) -> None:
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(int(min_p * 100))) * 2
    expected = _warped([TemperatureLogitsWarper(temperature), MinPLogitsWarper(min_p)], row)
    got = filter_logits(row / temperature, SamplingParams(temperature=temperature, min_p=min_p))
    torch.testing.assert_close(got, expected)
    kept = int(torch.isfinite(got).sum())
    assert 1 <= kept < VOCAB  # it cuts, and the most likely token always stays


@pytest.mark.parametrize("seed", range(4))
def test_min_p_comes_before_top_k_and_top_p(seed: int) -> None:
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    params = SamplingParams(temperature=0.9, min_p=0.02, top_k=40, top_p=0.6)
    chain = [TemperatureLogitsWarper(0.9), MinPLogitsWarper(0.02), TopKLogitsWarper(40), TopPLogitsWarper(0.6)]
    expected = _warped(chain, row)
    got = filter_logits(row / 0.9, params)
    assert torch.equal(torch.isfinite(got), torch.isfinite(expected))
    torch.testing.assert_close(got[torch.isfinite(got)], expected[torch.isfinite(expected)])


def test_the_order_matters_where_top_p_reads_what_min_p_left() -> None:
    """p = 0.5, 0.3, 0.15, 0.05; min-p 0.2 cuts the last one, and top-p 0.82 over what is left (0.526,
    0.316, 0.158) keeps two tokens, where top-p first would have kept three."""
    row = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    vllm_order = _warped([MinPLogitsWarper(0.2), TopPLogitsWarper(0.82)], row)
    generate_order = _warped([TopPLogitsWarper(0.82), MinPLogitsWarper(0.2)], row)
    got = filter_logits(row, SamplingParams(min_p=0.2, top_p=0.82))
    assert torch.isfinite(got).tolist() == torch.isfinite(vllm_order).tolist() == [True, True, False, False]
    assert torch.isfinite(generate_order).tolist() == [True, True, True, False]


def test_greedy_is_unaffected() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(9))
    params = [SamplingParams(temperature=0.0, min_p=0.9), SamplingParams(top_k=1, min_p=0.5)]
    assert sample(logits.clone(), params, [None, None]).tolist() == logits.argmax(-1).tolist()
