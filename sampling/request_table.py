"""The engine's requests and the life of their sequences: born (added, forked), advanced by a token, finished.

A request holds the ``n`` sequences of one ``EngineInput``: one until its prefill, then the parent and
its ``n - 1`` forked siblings. ``advance()`` is where a committed token becomes a ``SeqOutput``: it is
detokenized, checked against EOS and ``stop_token_ids``, the stop strings, the end of the grammar,
``max_tokens`` and the model's length; a finished or failed sequence gives its KV blocks back at once,
and its request leaves the table with its last sequence.

vLLM's meaning throughout: neither an end token nor a stop string ends a sequence before
``min_tokens`` tokens (a stop string is looked for only where the tokens after them end it; the end
of a grammar still does: a constraint always wins). The end token writes no text, the stop string is
cut from the text, unless ``include_stop_str_in_output`` keeps either.
"""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass, field

import torch

from sampling.detokenizer import Detokenizer, TokenBytes
from sampling.inputs import EngineInput, SeqOutput
from sampling.logits_process import TokenLogprob
from sampling.scheduler import Scheduler
from sampling.sequence import SeqState, Sequence
from sampling.stop import StopChecker

__all__ = ["Request", "RequestTable"]


@dataclass
class Request:
    """One engine input and its sequences (the parent first)."""

    inp: EngineInput
    seqs: list[Sequence] = field(default_factory=list)


class RequestTable:
    """The requests in the engine by id, and the sequences' lifecycle; the scheduler frees their blocks."""

    def __init__(
        self,
        scheduler: Scheduler,
        token_bytes: TokenBytes,
        *,
        eos_token_ids: list[int],
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.scheduler = scheduler
        self.token_bytes = token_bytes
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.device = device
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()

    def __len__(self) -> int:
        return len(self.requests)

    def __getitem__(self, request_id: str) -> Request:
        return self.requests[request_id]

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.requests

    def sequences(self) -> list[Sequence]:
        """Every sequence of every request in the table."""
        return [s for request in self.requests.values() for s in request.seqs]

    def add(self, inp: EngineInput) -> None:
        """Queue a request; its ``n`` sequences share one prefill."""
        if inp.request_id in self.requests:
            raise ValueError(f"request {inp.request_id} is already in the engine")
        seq = self._new_seq(inp, 0, inp.sampling.n)
        self.requests[inp.request_id] = Request(inp, [seq])
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """Drop a request and free its slots, blocks and matchers now."""
        request = self.requests.pop(request_id, None)
        for seq in request.seqs if request else ():
            self.scheduler.release(seq)
            seq.matcher = None
            seq.state = SeqState.FINISHED

    def siblings(self, parent: Sequence) -> list[Sequence]:
        """n > 1: new sequences for the parent's ``n - 1`` siblings, not in the table until ``adopt``."""
        request = self.requests[parent.request_id]
        return [self._new_seq(request.inp, i) for i in range(1, parent.num_siblings)]

    def adopt(self, parent: Sequence, children: list[Sequence]) -> None:
        """Make ``children`` the forked siblings of ``parent`` once they hold its K/V."""
        parent.has_forked = True
        self.requests[parent.request_id].seqs += children

    def _new_seq(self, inp: EngineInput, index: int, num_siblings: int = 1) -> Sequence:
        generator = None
        if not inp.sampling.is_greedy:
            generator = torch.Generator(device=self.device)
            # an unseeded sequence draws its own seed; not torch.seed(), which also reseeds the process's
            # default generator and every accelerator's (on a CPU build each of those formats a stack
            # trace): 0.2-0.5 ms of the engine's thread per request, before its prefill
            seed = inp.sampling.seed if inp.sampling.seed is not None else secrets.randbits(63)
            generator.manual_seed((seed * 1_000_003 + index) & 0xFFFF_FFFF_FFFF_FFFF)
        return Sequence(
            seq_id=next(self._seq_ids),
            request_id=inp.request_id,
            index=index,
            prompt_ids=list(inp.prompt_token_ids),
            image_embeds=inp.image_embeds,
            params=inp.sampling,
            grammar=inp.grammar,
            detokenizer=Detokenizer(self.token_bytes, skip_special_tokens=inp.sampling.skip_special_tokens),
            generator=generator,
            stop=StopChecker(inp.sampling.stop, include=inp.sampling.include_stop_str_in_output),
            num_siblings=num_siblings,
            image_keys=list(inp.image_keys),
            mrope=inp.mrope,
            extra_prefill=inp.extra_prefill,
            grammar_trigger=inp.grammar_trigger,
            grammar_start=0 if inp.grammar_trigger is None and inp.reasoning_end is None else None,
            reasoning_end=inp.reasoning_end,
        )

    def advance(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None) -> SeqOutput:
        """Append a committed ``token`` (its matcher accepted it): its output, a finish reason if it ends ``seq``."""
        seq.output_ids.append(token)
        self.scheduler.cache_computed(seq)  # before a finish frees its blocks: they stay cached
        if seq.reasoning_end is not None:
            if token == seq.reasoning_end:  # the answer starts: its grammar now, or from its trigger on
                seq.reasoning_end = None
                if seq.grammar_trigger is None:
                    seq.grammar_start = len(seq.output_ids)
        elif seq.grammar_start is None and token == seq.grammar_trigger:
            seq.grammar_start = len(seq.output_ids)  # the next step's fill builds the matcher
        params = seq.params
        can_stop = len(seq.output_ids) > params.min_tokens
        is_terminated = seq.matcher is not None and seq.matcher.is_terminated()
        ends = (can_stop or is_terminated) and self._is_end_token(seq, token)
        stop = seq.stop
        if ends and not params.include_stop_str_in_output:
            text = ""
        else:
            text = stop.feed(seq.detokenizer.add(token), can_stop=can_stop and not ends)
        reason = None
        if ends or is_terminated or stop.hit:
            reason = "stop"
        elif len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            text += stop.flush(seq.detokenizer.flush(), can_stop=can_stop and not ends)
            self._finish(seq, reason)
        logprobs = [logprob] if logprob is not None else None
        return SeqOutput(seq.request_id, seq.index, [token], text, reason, None, len(seq.prompt_ids), logprobs)

    def _is_end_token(self, seq: Sequence, token: int) -> bool:
        """Whether ``token`` is one that ends ``seq``: in its ``stop_token_ids``, or EOS (unless it
        ignores EOS, which only a grammar's end overrides)."""
        if token in seq.params.stop_token_ids:
            return True
        return token in self.eos_token_ids and not (seq.params.ignore_eos and seq.matcher is None)

    def fail(self, seq: Sequence, message: str, kind: str | None = None) -> list[SeqOutput]:
        """Fail ``seq`` alone (``kind``: ``SeqOutput.error_kind``); a parent that fails before forking
        fails its unborn siblings too."""
        seq.error = message
        self._finish(seq, "error")
        unborn = range(1, seq.num_siblings) if not seq.has_forked else range(0)
        return [
            SeqOutput(seq.request_id, index, [], "", "error", message, len(seq.prompt_ids), error_kind=kind)
            for index in [seq.index, *unborn]
        ]

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.state = SeqState.FINISHED
        seq.finish_reason = reason
        seq.matcher = None
        self.scheduler.release(seq)
        request = self.requests.get(seq.request_id)
        if request and all(s.state is SeqState.FINISHED for s in request.seqs):
            del self.requests[seq.request_id]
