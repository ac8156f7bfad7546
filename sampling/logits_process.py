"""Per-request logit adjustments before the grammar mask, and log probabilities after it.

Order in a step: ``adjust`` on the raw logits (logit_bias, then the repetition penalty, then the
presence and frequency penalties: vLLM's order), then the grammar mask, then the request's bans
(sampling/token_bans.py), then ``StepLogprobs.compute`` (log-softmax of what is left), then
temperature, min-p, top-k and top-p inside the sampler. Bias and penalties come before the mask so a
constraint always wins: +100 on a token the grammar refuses does not let it through.

Log probabilities are taken after the mask and before the temperature (README, "Log probabilities"):
- after the mask, so ``top_logprobs`` lists tokens that could have been emitted, and a guided greedy
  answer's top entry is the token it chose; before it, a constrained request would report the model's
  preference for tokens the grammar forbids.
- before the temperature, because temperature 0 (greedy) has no distribution to report, and a
  figure that changes with the temperature cannot be compared across requests. At temperature 1
  without top-k/top-p they are exactly the probabilities the token was drawn with.

Everything is vectorised over the rows that ask for it; rows that do not (penalty 0, no bias, no
logprobs) cost nothing, and a batch where none asks skips the work entirely.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from sampling.params import SamplingParams

__all__ = ["StepLogprobs", "TokenLogprob", "adjust"]


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One sampled token's log probability and the ``top`` most likely tokens of its step, best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def adjust(
    logits: torch.Tensor,
    params: Seq[SamplingParams],
    outputs: Seq[Seq[int]],
    prompts: Seq[torch.Tensor | Seq[int]] = (),
) -> None:
    """Add each row's logit_bias, apply its repetition penalty over its ``prompts`` and ``outputs``
    ids, and subtract its presence and frequency penalties over its ``outputs`` (its generated ids),
    in place.

    ``logits``: ``[B, vocab]`` fp32; ``params`` and ``outputs`` one per row, ``prompts`` too where a
    row has a repetition penalty (its prompt's ids, each once is enough).
    """
    vocab = logits.shape[-1]
    biased = [(row, token, value) for row, p in enumerate(params) for token, value in p.logit_bias if token < vocab]
    if biased:
        rows, tokens, values = zip(*biased, strict=True)
        index = (torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device))
        logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=logits.device), accumulate=True)
    repeated = [row for row, p in enumerate(params) if p.repetition_penalty != 1.0]
    if repeated:
        _repetition_penalty(logits, params, outputs, prompts, repeated)
    penalised = [row for row, p in enumerate(params) if p.has_penalties and outputs[row]]
    if penalised:
        _penalise(logits, params, outputs, penalised)


def _repetition_penalty(
    logits: torch.Tensor,
    params: Seq[SamplingParams],
    outputs: Seq[Seq[int]],
    prompts: Seq[torch.Tensor | Seq[int]],
    rows: list[int],
) -> None:
    """CTRL's rule at every token the prompt or the output of ``rows`` holds: a positive logit is
    divided by the penalty, any other multiplied by it; sparse, as ``_penalise``."""
    vocab = logits.shape[-1]
    seen = []
    for row in rows:
        prompt = prompts[row] if row < len(prompts) else ()
        ids = torch.cat([torch.as_tensor(prompt, dtype=torch.long), torch.tensor(outputs[row], dtype=torch.long)])
        seen.append(ids[ids < vocab] + row * vocab)
    positions = torch.unique(torch.cat(seen)).to(logits.device)  # flat row * vocab + token, each once
    penalty = torch.ones(logits.shape[0], dtype=logits.dtype)
    penalty[rows] = torch.tensor([params[r].repetition_penalty for r in rows], dtype=logits.dtype)
    penalty = penalty.to(logits.device)[positions // vocab]
    flat = logits.view(-1)
    values = flat[positions]
    flat[positions] = torch.where(values > 0, values / penalty, values * penalty)


def _penalise(logits: torch.Tensor, params: Seq[SamplingParams], outputs: Seq[Seq[int]], rows: list[int]) -> None:
    """Subtract the penalties of ``rows`` at the tokens they generated: sparse, O(generated tokens),
    never a ``[B, vocab]`` intermediate (a dense count matrix cost 10x a greedy argmax per step)."""
    vocab = logits.shape[-1]
    # flat positions row * vocab + token of every generated token of the penalised rows
    flat = torch.cat([torch.tensor(outputs[row], dtype=torch.long) + row * vocab for row in rows])
    positions, counts = torch.unique(flat, return_counts=True)
    frequency = torch.zeros(logits.shape[0], dtype=logits.dtype)
    presence = torch.zeros(logits.shape[0], dtype=logits.dtype)
    frequency[rows] = torch.tensor([params[r].frequency_penalty for r in rows], dtype=logits.dtype)
    presence[rows] = torch.tensor([params[r].presence_penalty for r in rows], dtype=logits.dtype)
    owner = positions // vocab
    penalty = frequency[owner] * counts.to(logits.dtype) + presence[owner]
    logits.view(-1).index_add_(0, positions.to(logits.device), -penalty.to(logits.device))


@dataclass(slots=True)
class StepLogprobs:
    """The log probabilities of one step's rows that asked for them, still on the device.

    log p(t) = logit(t) - logsumexp(logits): one reduction per row and a top-k over the logits
    (the same order as over log p), never a ``[B, vocab]`` log-softmax.
    """

    rows: list[int]
    logits: torch.Tensor  # [R, vocab] the rows' masked logits (dropped once the sampled ids are picked)
    normaliser: torch.Tensor  # [R] logsumexp of each row
    top_ids: torch.Tensor | None = None  # [R, K]
    top_values: torch.Tensor | None = None  # [R, K]
    chosen: torch.Tensor | None = None  # [R] the sampled tokens' log probabilities

    @classmethod
    def compute(cls, logits: torch.Tensor, params: Seq[SamplingParams]) -> StepLogprobs | None:
        """The rows whose params ask for logprobs (None when none does), with their top-k.

        The sampler must not write into ``logits`` before ``pick`` (it does not: it scales copies)."""
        rows = [row for row, p in enumerate(params) if p.logprobs is not None]
        if not rows:
            return None
        picked = logits if len(rows) == logits.shape[0] else logits[torch.tensor(rows, device=logits.device)]
        step = cls(rows, picked, torch.logsumexp(picked, dim=-1))
        k = max(params[r].logprobs or 0 for r in rows)
        if k:
            top = torch.topk(picked, k, dim=-1)
            step.top_ids, step.top_values = top.indices, top.values - step.normaliser[:, None]
        return step

    def pick(self, ids: torch.Tensor) -> None:
        """Gather the sampled ids' log probabilities (``ids``: ``[B]``, the whole step's)."""
        index = torch.tensor(self.rows, device=ids.device)
        self.chosen = self.logits.gather(1, ids[index][:, None]).squeeze(1) - self.normaliser
        self.logits = self.logits[:0]  # [R, vocab] is not kept alive until the host reads the rest

    def to_host(self, params: Seq[SamplingParams], tokens: Seq[int]) -> dict[int, TokenLogprob]:
        """Row -> its ``TokenLogprob`` (after the step's ids reached the host, so nothing waits long)."""
        assert self.chosen is not None
        chosen = self.chosen.tolist()
        top_ids = self.top_ids.tolist() if self.top_ids is not None else None
        top_values = self.top_values.tolist() if self.top_values is not None else None
        out = {}
        for i, row in enumerate(self.rows):
            k = params[row].logprobs or 0
            top: tuple[tuple[int, float], ...] = ()
            if k and top_ids is not None and top_values is not None:
                # a mask that allows fewer than k tokens leaves -inf entries: not alternatives
                top = tuple((t, v) for t, v in zip(top_ids[i][:k], top_values[i][:k], strict=True) if v > -math.inf)
            out[row] = TokenLogprob(tokens[row], chosen[i], top)
        return out
