"""repetition_penalty: CTRL's rule over the prompt and the output, as transformers' processor and its
``generate`` apply it, in vLLM's order with logit_bias and the OpenAI penalties; in both loops."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from sampling.logits_process import adjust
from sampling.params import SamplingParams
from tests.sampling.conftest import NewEngine
from tests.sampling.helpers import add, prompt, run_all


def _reference(penalty: float, ids: list[int], row: torch.Tensor) -> torch.Tensor:
    """transformers' processor on one row whose input ids (prompt, then output) are ``ids``."""
    return RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([ids]), row[None].clone())[0]


def test_the_penalty_covers_the_prompt_and_the_output_as_transformers_does() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(),  # untouched
        SamplingParams(repetition_penalty=0.6),  # below 1: encourages repeats
        SamplingParams(repetition_penalty=2.0),  # a prompt but no output yet
    ]
    prompts: list[list[int]] = [[1, 3, 3, 9, 40], [1, 2], [7, 8], [11, 12, 13]]
    outputs: list[list[int]] = [[9, 9, 20, 3], [2, 2], [30, 7], []]
    expected = logits.clone()
    for row in (0, 2, 3):
        expected[row] = _reference(params[row].repetition_penalty, prompts[row] + outputs[row], logits[row])
    # the engine passes each prompt's distinct ids as a tensor; a list means the same
    given: list[torch.Tensor | list[int]] = [torch.tensor(sorted(set(prompts[0]))), prompts[1], prompts[2]]
    given.append(torch.tensor(prompts[3]))
    adjust(logits, params, outputs, given)
    torch.testing.assert_close(logits, expected)


def test_bias_then_repetition_then_frequency_and_presence() -> None:
    """vLLM's order: the bias is added first, so the penalty scales the biased logit."""
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(repetition_penalty=1.5, logit_bias=((4, 2.0), (6, -3.0)), frequency_penalty=0.5)
    prompt_ids, outputs = [4, 5], [6, 6, 8]
    expected = logits[0].clone()
    expected[4] += 2.0
    expected[6] -= 3.0
    expected = _reference(1.5, prompt_ids + outputs, expected)
    expected[6] -= 0.5 * 2
    expected[8] -= 0.5
    adjust(logits, [p], [outputs], [prompt_ids])
    torch.testing.assert_close(logits[0], expected)


@pytest.mark.parametrize("one_step_ahead", [False, True], ids=["sync", "ahead"])
def test_greedy_answers_equal_transformers_generate_with_the_penalty(
    new_engine: NewEngine, reference: Any, hf_tokenizer: Any, one_step_ahead: bool
) -> None:
    """The random model never repeats itself: a bias makes one token its greedy choice at every step,
    a token of the prompt or a fresh one, and the penalty must undo it (at once for the prompt's,
    after one write for the fresh one), as transformers' ``generate`` does with the same bias."""
    ids = prompt(hf_tokenizer, "again and again")
    engine = new_engine(one_step_ahead=one_step_ahead)
    expected = {}
    for token in (ids[2], 5000):
        with torch.inference_mode():
            out = reference.generate(
                torch.tensor([ids]),
                max_new_tokens=12,
                do_sample=False,
                repetition_penalty=1.8,
                sequence_bias={(token,): 1.0},
            )
        expected[token] = out[0, len(ids) :].tolist()
        bias = ((token, 1.0),)
        add(engine, f"penalised{token}", ids, max_tokens=12, temperature=0.0, logit_bias=bias, repetition_penalty=1.8)
        add(engine, f"biased{token}", ids, max_tokens=12, temperature=0.0, logit_bias=bias)
    outputs = run_all(engine)
    for token, tokens in expected.items():
        assert outputs[(f"penalised{token}", 0)].token_ids == tokens
        assert outputs[(f"biased{token}", 0)].token_ids == [token] * 12
        assert tokens.count(token) <= 1
