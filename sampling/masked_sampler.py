"""Logits to token ids under the grammars: adjust, mask, ban, sample; greedy rows skip the full mask where exact.

Every call here runs torch ops, so it runs on the thread that runs the step's forward (the engine's
thread in the synchronous loop, the device thread one step ahead: sampling/step.py says why), and
so do the grammar calls of the lazy path (``try_accept``, and the fill of the rows it refuses).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from sampling.guided.decoder import GuidedDecoder
from sampling.logits_process import StepLogprobs, adjust
from sampling.sampler import greedy_ids, sample
from sampling.sequence import Sequence
from sampling.timeline import StepTiming
from sampling.token_bans import apply_bans

__all__ = ["MaskedSampler", "is_lazy"]


def is_lazy(seq: Sequence) -> bool:
    """Whether a guided row may skip its full mask when its argmax is allowed (greedy, and no
    log probabilities, which need the whole masked distribution, nor bans, which yield to the mask
    where they would leave nothing and so must see it: sampling/token_bans.py)."""
    p = seq.params
    return p.is_greedy and p.logprobs is None and not p.has_bans


class MaskedSampler:
    """Samples a step's rows with their penalties, biases, grammar masks (``guided``'s bitmask rows) and bans."""

    def __init__(self, guided: GuidedDecoder, eos_token_ids: list[int], *, lazy_mask: bool = True) -> None:
        self.guided = guided
        self.eos_token_ids = eos_token_ids
        self.lazy_mask = lazy_mask  # skip the mask for greedy rows whose choice the grammar allows (exact)

    def defers_greedy(self, device: torch.device) -> bool:
        """Whether a decode's fill leaves greedy rows to ``sample`` (the lazy path): on the CPU the fill
        competes with the forward for the cores, so greedy rows try their argmax on the matcher first
        and are filled only if it is refused."""
        return self.lazy_mask and device.type == "cpu"

    def sample(
        self,
        seqs: list[Sequence],
        matchers: list[Any | None],
        logits: torch.Tensor,
        filled: list[int],
        timing: StepTiming,
    ) -> tuple[torch.Tensor, set[int], StepLogprobs | None]:
        """Adjust, mask, ban and sample: the ids ``[B]`` on the device, the rows whose matchers accepted theirs
        already (the lazy greedy path), and the log probabilities of the rows that ask for them.
        ``matchers`` are the rows' matchers when the step was filled (None: unguided): one step ahead,
        an abort on the host may drop a sequence's meanwhile."""
        t0 = time.perf_counter()
        params = [s.params for s in seqs]
        has_bans = any(p.has_bans for p in params)
        if any(p.adjusts_logits for p in params):
            prompts = [s.distinct_prompt_ids() if s.params.repetition_penalty != 1.0 else () for s in seqs]
            adjust(logits, params, [s.output_ids for s in seqs], prompts)
        no_eos = [row for row, s in enumerate(seqs) if s.params.ignore_eos and matchers[row] is None]
        if no_eos and self.eos_token_ids:
            no_eos_rows = torch.tensor(no_eos, device=logits.device)[:, None]
            logits[no_eos_rows, torch.tensor(self.eos_token_ids, device=logits.device)] = float("-inf")
        if any(s.reasoning_end is not None for s in seqs):
            self._bound_reasoning(seqs, logits)
        greedy: torch.Tensor | None = None
        accepted: set[int] = set()
        masked, fill_before = filled, timing.fill
        candidates: dict[int, torch.Tensor] = {}
        lazy = any(m is not None and is_lazy(s) for s, m in zip(seqs, matchers, strict=True))
        if self.lazy_mask and logits.device.type == "cpu" and lazy:
            greedy, accepted, masked = self._lazy_mask(seqs, matchers, logits, filled, timing)
        if masked:
            candidates = self.guided.apply(logits, masked)
        banned = apply_bans(logits, params, [s.output_ids for s in seqs], self.eos_token_ids) if has_bans else []
        if greedy is not None and (masked or banned):
            rows = sorted(r for r in {*masked, *banned} if seqs[r].params.is_greedy)
            if rows:
                greedy[rows] = greedy_ids(logits[rows])
        t1 = time.perf_counter()
        logprobs = StepLogprobs.compute(logits, params)  # after the mask, before the temperature
        ids = sample(logits, params, [s.generator for s in seqs], greedy=greedy, candidates=candidates)
        if logprobs is not None:
            logprobs.pick(ids)
        # the lazy path's accept and fill are timed as such, not as apply
        timing.apply = t1 - t0 - timing.accept - (timing.fill - fill_before)
        timing.sample = time.perf_counter() - t1
        return ids, accepted, logprobs

    def _bound_reasoning(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """The rows still reasoning: no end of sequence where a constrained answer is owed, and the end
        tag alone where ``max_reasoning_tokens`` are spent (in place)."""
        for row, seq in enumerate(seqs):
            end = seq.reasoning_end
            if end is None:
                continue
            if seq.must_end_reasoning:
                kept = logits[row, end].clone()
                logits[row].fill_(float("-inf"))
                logits[row, end] = kept
            elif seq.owes_answer:
                ends = [t for t in (*self.eos_token_ids, *seq.params.stop_token_ids) if 0 <= t < logits.shape[-1]]
                if ends:
                    logits[row, torch.tensor(ends, device=logits.device)] = float("-inf")

    def _lazy_mask(
        self,
        seqs: list[Sequence],
        matchers: list[Any | None],
        logits: torch.Tensor,
        filled: list[int],
        timing: StepTiming,
    ) -> tuple[torch.Tensor, set[int], list[int]]:
        """Greedy rows without the full-vocabulary mask where that is exact (CPU): the argmax, the rows
        whose matchers accepted it, and the rows that still need the mask.

        A greedy row's argmax, if the grammar allows it, is also its masked argmax: a row whose fill
        was deferred offers it to its matcher (refused: the row is filled now), a filled row tests
        its bit. A row that allows few tokens takes the argmax among them.
        """
        greedy = greedy_ids(logits)
        top = greedy.tolist()
        is_filled = set(filled)
        deferred = [r for r, m in enumerate(matchers) if m is not None and r not in is_filled]
        accepted: set[int] = set()
        check = [r for r in filled if is_lazy(seqs[r]) and not self.guided.allows(r, top[r])]
        if deferred:
            t0 = time.perf_counter()
            ok = self.guided.try_accept([matchers[r] for r in deferred], [top[r] for r in deferred])
            accepted = {r for r, good in zip(deferred, ok, strict=True) if good}
            refused = [r for r in deferred if r not in accepted]
            t1 = time.perf_counter()
            if refused:
                self.guided.fill([matchers[r] for r in refused], refused)
                check += refused
            timing.accept, timing.fill = t1 - t0, timing.fill + time.perf_counter() - t1
        masked = [r for r in filled if not is_lazy(seqs[r])]
        for r in check:
            choice = self.guided.masked_argmax(logits, r)
            if choice is None:
                masked.append(r)
            else:
                greedy[r] = choice
        return greedy, accepted, masked
