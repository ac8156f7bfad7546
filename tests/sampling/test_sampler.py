"""The sampler draws each token with its probability, never a masked or cut one, and is seeded per row."""

from __future__ import annotations

import math

import pytest
import torch

from sampling.params import SamplingParams
from sampling.sampler import sample

VOCAB = 1024
DRAWS = 20_000


def _logits(probs: dict[int, float]) -> torch.Tensor:
    """A ``[1, VOCAB]`` row whose softmax is ``probs`` (every other token at -inf, as a mask leaves it)."""
    row = torch.full((1, VOCAB), float("-inf"))
    for token, p in probs.items():
        row[0, token] = math.log(p)
    return row


def _counts(logits: torch.Tensor, params: SamplingParams, seed: int = 0) -> dict[int, int]:
    generator = torch.Generator().manual_seed(seed)
    counts: dict[int, int] = {}
    for _ in range(DRAWS):
        token = int(sample(logits.clone(), [params], [generator])[0])
        counts[token] = counts.get(token, 0) + 1
    return counts


def _assert_frequencies(counts: dict[int, int], expected: dict[int, float]) -> None:
    """Every drawn token is expected, and each count is within 5 standard deviations of its mean."""
    assert set(counts) <= set(expected), sorted(set(counts) - set(expected))
    for token, p in expected.items():
        mean, sd = DRAWS * p, math.sqrt(DRAWS * p * (1 - p))
        assert abs(counts.get(token, 0) - mean) <= 5 * sd + 1, (token, counts.get(token, 0), mean)


def test_tokens_are_drawn_with_their_probabilities_and_masked_ones_never() -> None:
    # the first and the last token of the vocabulary are masked, and their neighbours carry the mass:
    # a draw that fell off either end of a cumulative sum would show up as token 0 or VOCAB - 1
    probs = {1: 0.4, 2: 0.3, 500: 0.2, VOCAB - 3: 0.0999, VOCAB - 2: 0.0001}
    counts = _counts(_logits(probs), SamplingParams(temperature=1.0))
    _assert_frequencies(counts, probs)


def test_temperature_reshapes_the_distribution() -> None:
    probs = {3: 0.7, 4: 0.2, 5: 0.1}
    temperature = 2.0
    weights = {t: p ** (1 / temperature) for t, p in probs.items()}
    total = sum(weights.values())
    counts = _counts(_logits(probs), SamplingParams(temperature=temperature))
    _assert_frequencies(counts, {t: w / total for t, w in weights.items()})


def test_top_k_and_top_p_cut_tokens_are_never_drawn() -> None:
    probs = {7: 0.5, 8: 0.3, 9: 0.15, 10: 0.05}
    top_k = _counts(_logits(probs), SamplingParams(top_k=2))
    _assert_frequencies(top_k, {7: 0.5 / 0.8, 8: 0.3 / 0.8})
    top_p = _counts(_logits(probs), SamplingParams(top_p=0.9))  # 0.5 + 0.3 < 0.9: token 9 stays, 10 goes
    _assert_frequencies(top_p, {7: 0.5 / 0.95, 8: 0.3 / 0.95, 9: 0.15 / 0.95})


def test_min_p_cut_tokens_are_never_drawn() -> None:
    probs = {7: 0.5, 8: 0.3, 9: 0.15, 10: 0.05}
    counts = _counts(_logits(probs), SamplingParams(min_p=0.2))  # under 0.2 x 0.5 = 0.1: token 10 goes
    _assert_frequencies(counts, {7: 0.5 / 0.95, 8: 0.3 / 0.95, 9: 0.15 / 0.95})


def test_a_row_draws_the_same_tokens_whatever_shares_its_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    params = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)]

    def run(rows: list[int], seed: int) -> list[list[int]]:
        generators: list[torch.Generator | None] = [torch.Generator().manual_seed(seed + r) for r in rows]
        return [sample(logits[rows].clone(), [params[r] for r in rows], generators).tolist() for _ in range(50)]

    together = run([0, 1, 2], 10)
    alone = [run([r], 10) for r in (0, 2)]
    assert [step[0] for step in together] == [step[0] for step in alone[0]]
    assert [step[2] for step in together] == [step[0] for step in alone[1]]
    assert len({step[0] for step in together}) > 1  # it samples: not the argmax every time


@pytest.mark.parametrize("seed", [1, 2])
def test_one_seed_one_sequence_of_draws(seed: int) -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5))
    draws = [
        [int(sample(logits.clone(), [SamplingParams()], [g])[0]) for _ in range(20)]
        for g in (torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed))
    ]
    assert draws[0] == draws[1]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.6, top_k=3),
        SamplingParams(top_p=0.7),
        SamplingParams(temperature=1.5, min_p=0.3),
    ],
    ids=str,
)
def test_a_row_drawn_among_its_allowed_ids_draws_what_the_whole_row_would(params: SamplingParams) -> None:
    # a masked row (most of it -inf) drawn over its allowed ids alone takes the same token, seed by
    # seed, as the draw over the whole vocabulary: the masked tokens' zero probabilities add nothing
    allowed = torch.tensor([0, 17, 18, 300, 301, 302, VOCAB - 1])
    row = torch.full((1, VOCAB), float("-inf"))
    row[0, allowed] = torch.randn(len(allowed), generator=torch.Generator().manual_seed(3))
    for seed in range(400):
        whole = sample(row.clone(), [params], [torch.Generator().manual_seed(seed)])
        among = sample(row.clone(), [params], [torch.Generator().manual_seed(seed)], candidates={0: allowed})
        assert int(among[0]) == int(whole[0]), seed
    drawn = {int(sample(row.clone(), [params], [None], candidates={0: allowed})[0]) for _ in range(200)}
    assert drawn <= set(allowed.tolist()) and len(drawn) > 1
