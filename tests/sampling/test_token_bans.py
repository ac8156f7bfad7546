"""allowed_token_ids, bad_words_ids and min_tokens on one step's logits, against transformers' own
logits processors, and the rule that a ban never empties what a constraint allows."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
)

from sampling.params import SamplingParams
from sampling.token_bans import apply_bans

VOCAB = 64
EOS = [2]
INF = float("-inf")


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def _reference(processor: object, outputs: list[int], row: torch.Tensor) -> torch.Tensor:
    """``processor`` on one row, after ``outputs`` (its input ids are the generated ids alone)."""
    return processor(torch.tensor([outputs], dtype=torch.long).view(1, -1), row[None].clone())[0]  # type: ignore[operator]


@pytest.mark.parametrize(
    "outputs",
    [[], [5], [5, 6], [9, 5, 6], [6, 5], [7, 7, 7]],
    ids=lambda o: "out=" + ",".join(map(str, o)),
)
def test_bad_words_ban_what_transformers_bans(outputs: list[int]) -> None:
    words = ((3,), (5, 6, 8), (6, 9), (7, 7, 11), (5, 12), (40, 41, 42, 43))
    logits = _logits(1)
    expected = _reference(NoBadWordsLogitsProcessor([list(w) for w in words]), outputs, logits[0])
    rows = apply_bans(logits, [SamplingParams(bad_words_ids=words)], [outputs], EOS)
    assert rows == [0]
    torch.testing.assert_close(logits[0], expected)


@pytest.mark.parametrize("num_outputs", [0, 2, 3, 4])
def test_min_tokens_bans_eos_and_stop_token_ids_as_transformers_does(num_outputs: int) -> None:
    params = SamplingParams(min_tokens=3, stop_token_ids=(17, 30))
    outputs = list(range(40, 40 + num_outputs))
    logits = _logits(1, seed=1)
    # transformers counts new tokens past the prompt: here the input ids are the outputs alone
    processor = MinNewTokensLengthLogitsProcessor(0, 3, EOS + [17, 30])
    expected = _reference(processor, outputs, logits[0])
    rows = apply_bans(logits, [params], [outputs], EOS)
    assert rows == ([0] if num_outputs < 3 else [])
    torch.testing.assert_close(logits[0], expected)


def test_allowed_token_ids_keep_only_those_tokens() -> None:
    allowed = (1, 5, 33, 63, VOCAB + 7)  # an id past the vocabulary is ignored
    logits = _logits(1, seed=2)
    processor = PrefixConstrainedLogitsProcessor(lambda _batch, _ids: [t for t in allowed if t < VOCAB], 1)
    expected = _reference(processor, [4, 4], logits[0])
    apply_bans(logits, [SamplingParams(allowed_token_ids=allowed)], [[4, 4]], EOS)
    torch.testing.assert_close(logits[0], expected)


def test_only_the_rows_that_ask_are_touched_and_a_batch_without_bans_does_nothing() -> None:
    logits = _logits(3, seed=3)
    before = logits.clone()
    assert apply_bans(logits, [SamplingParams()] * 3, [[1], [2], [3]], EOS) == []
    assert torch.equal(logits, before)
    params = [SamplingParams(), SamplingParams(bad_words_ids=((9,),)), SamplingParams(min_tokens=1)]
    assert apply_bans(logits, params, [[], [], [4]], EOS) == [1]  # row 2 has its one token already
    assert torch.equal(logits[[0, 2]], before[[0, 2]])
    assert logits[1, 9] == INF and torch.equal(logits[1, :9], before[1, :9])


def test_a_ban_that_would_empty_a_masked_row_yields_to_the_mask() -> None:
    """A finished grammar allows only EOS; min_tokens forbids it: the row keeps EOS (the constraint
    wins). Where the mask leaves another token, the ban holds."""
    logits = torch.full((2, VOCAB), INF)
    logits[0, EOS[0]] = 1.5  # the mask allows EOS alone
    logits[1, [EOS[0], 20]] = torch.tensor([3.0, -1.0])  # EOS or token 20
    before = logits.clone()
    params = [SamplingParams(min_tokens=5), SamplingParams(min_tokens=5)]
    assert apply_bans(logits, params, [[7], [7]], EOS) == [0, 1]
    assert torch.equal(logits[0], before[0])
    assert logits[1, EOS[0]] == INF and logits[1, 20] == -1.0
