"""One choice's answer as the engine's outputs build it (a reasoning model's reasoning, then text, then
tool calls), the deltas it passes on, and a request's ``Result``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pipeline.answer.call_split import CallSplit
from pipeline.answer.reasoning_split import ReasoningSplit
from sampling.inputs import SeqOutput
from sampling.logits_process import TokenLogprob

__all__ = ["Choice", "Delta", "Result"]


@dataclass(frozen=True, slots=True)
class Delta:
    index: int  # choice index
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them
    is_call: bool = False  # ``text`` continues the choice's tool-call array (``Choice.call_text``)
    is_reasoning: bool = False  # ``text`` continues the choice's reasoning (``Choice.reasoning``)


@dataclass
class Choice:
    index: int
    text: str = ""  # the answer's text (with tools: what the model wrote before any call)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    call_text: str | None = None  # the tool-call array the model wrote; None: it called no tool
    split: CallSplit | None = None  # the calls open where the text says (no marker token)
    # a reasoning model's answer: its reasoning, split off at the end tag (None: not one, or it was
    # prompted past its reasoning)
    reasoning: str | None = None
    thinking: ReasoningSplit | None = None

    def add(self, out: SeqOutput, trigger: int | None, marker: str = "") -> list[Delta]:
        """Take one engine output (``trigger``: the token that opens the calls, ``marker``: its text);
        the deltas to pass on (reasoning, text before the calls, then the calls, where one output
        holds several)."""
        self.token_ids += out.token_ids
        self.finish_reason = out.finish_reason
        if out.logprobs:
            self.logprobs += out.logprobs
        if self.thinking is None or not self.thinking.is_open:
            return self._add_answer(out, trigger, marker)
        thought, ids, text = self.thinking.feed(out.token_ids, out.text)
        self.reasoning = (self.reasoning or "") + thought
        if not ids and not text:  # all of it reasoning (and the end tag, where it came)
            return [Delta(self.index, thought, out.token_ids, out.finish_reason, out.logprobs, is_reasoning=True)]
        cut = len(out.token_ids) - len(ids)
        head = out.logprobs[:cut] if out.logprobs else None
        rest = out.logprobs[cut:] if out.logprobs else None
        deltas = [Delta(self.index, thought, out.token_ids[:cut], None, head, is_reasoning=True)] if cut else []
        return deltas + self._add_answer(
            dataclasses.replace(out, token_ids=ids, text=text, logprobs=rest), trigger, marker
        )

    def _add_answer(self, out: SeqOutput, trigger: int | None, marker: str) -> list[Delta]:
        """The deltas of one output of the answer (what follows any reasoning)."""
        if self.split is not None:
            return self._split(out)
        text, is_call = out.text, self.call_text is not None
        if not is_call and trigger is not None and trigger in out.token_ids:
            # the marker token's own text (if its tokenizer gives it one) belongs to neither part
            before, found, after = text.partition(marker) if marker else (text, "", "")
            self.text += before if found else text
            self.call_text, text, is_call = "", after if found else "", True
        if is_call:
            assert self.call_text is not None
            self.call_text += text
        else:
            self.text += text
        return [Delta(self.index, text, out.token_ids, out.finish_reason, out.logprobs, is_call)]

    def _split(self, out: SeqOutput) -> list[Delta]:
        assert self.split is not None
        content, call = self.split.feed(out.text, out.finish_reason is not None)
        self.text += content
        if not self.split.is_open:
            return [Delta(self.index, content, out.token_ids, out.finish_reason, out.logprobs)]
        self.call_text = (self.call_text or "") + call
        last = Delta(self.index, call, out.token_ids, out.finish_reason, out.logprobs, is_call=True)
        return [Delta(self.index, content, []), last] if content else [last]

    @property
    def answer(self) -> str:
        """The whole text the model wrote (with a text-opened split: content, marker, calls)."""
        if self.split is None or self.call_text is None:
            return self.text
        return self.text + self.split.marker + self.call_text


@dataclass
class Result:
    request_id: str
    choices: list[Choice]
    prompt_tokens: int
    completion_tokens: int
    timings: dict[str, float]  # seconds per stage, plus "first_token" and "total"
    grammar_backend: str | None = None  # which backend constrained it ("xgrammar", "llguidance")
    num_resamples: int = 0  # answers that failed the answer check and were sampled again

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason
