"""The tokens a request forbids at a step, with vLLM's meaning: ``allowed_token_ids`` (every other
token), ``bad_words_ids`` (a word's last token, where the output ends with the rest of the word) and
``min_tokens`` (the end-of-sequence tokens, until that many tokens are out).

Bans are applied after the grammar mask, to the rows that ask for them (a batch where none asks does
no work): a banned token's logit becomes -inf. Where the row keeps a token, masks commute, so that
is the same as banning first. A constraint always wins: where the bans would leave a row no token its
grammar allows (a finished grammar allows only EOS, and ``min_tokens`` forbids it), the row keeps
what the mask left, as if it had asked for no ban at that step (vLLM would sample from a row of
-inf). Guided greedy rows with bans therefore take the full mask, never the lazy path
(sampling/masked_sampler.py), and the test for an empty row runs on the device.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from sampling.params import SamplingParams

__all__ = ["apply_bans", "banned_tokens"]


def banned_tokens(params: SamplingParams, outputs: Seq[int], eos_token_ids: Seq[int]) -> list[int]:
    """The tokens that ``bad_words_ids`` and ``min_tokens`` forbid after ``outputs`` (the generated ids).

    A bad word of one token is always banned; a longer one bans its last token when the output ends
    with the rest of it (the output alone: the prompt never completes a bad word, as in vLLM)."""
    banned: list[int] = []
    if len(outputs) < params.min_tokens:
        banned += eos_token_ids
        banned += params.stop_token_ids
    for word in params.bad_words_ids:
        prefix = len(word) - 1
        if not word or prefix > len(outputs):
            continue
        if prefix == 0 or list(outputs[-prefix:]) == list(word[:-1]):
            banned.append(word[-1])
    return banned


def apply_bans(
    logits: torch.Tensor,
    params: Seq[SamplingParams],
    outputs: Seq[Seq[int]],
    eos_token_ids: Seq[int],
) -> list[int]:
    """Set the logits of each row's banned tokens to -inf, in place, unless that leaves the row
    nothing: the rows that asked for a ban at this step.

    ``logits``: ``[B, vocab]`` fp32, the grammar mask applied; ``params`` and ``outputs`` one per row.
    """
    vocab = logits.shape[-1]
    rows: list[int] = []
    banned: list[list[int]] = []
    for row, p in enumerate(params):
        if not p.has_bans:
            continue
        tokens = [t for t in banned_tokens(p, outputs[row], eos_token_ids) if 0 <= t < vocab]
        if tokens or p.allowed_token_ids is not None:
            rows.append(row)
            banned.append(tokens)
    if not rows:
        return []
    device = logits.device
    index = torch.tensor(rows, device=device)
    before = logits[index]  # [R, vocab]
    after = before.clone()
    allowing = [i for i, row in enumerate(rows) if params[row].allowed_token_ids is not None]
    if allowing:
        after[allowing] = float("-inf")
        pairs = [(i, t) for i in allowing for t in params[rows[i]].allowed_token_ids or () if 0 <= t < vocab]
        if pairs:
            at = tuple(torch.tensor(column, device=device) for column in zip(*pairs, strict=True))
            after[at] = before[at]
    pairs = [(i, t) for i, tokens in enumerate(banned) for t in tokens]
    if pairs:
        at = tuple(torch.tensor(column, device=device) for column in zip(*pairs, strict=True))
        after[at] = float("-inf")
    # a row the bans would empty keeps its masked logits (the constraint wins); no host sync on CUDA
    kept = after.amax(dim=-1, keepdim=True) > float("-inf")
    logits[index] = torch.where(kept, after, before)
    return rows
