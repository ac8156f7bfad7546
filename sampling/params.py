"""Per-request sampling parameters, shared by admission and the decode engine."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MAX_N", "MAX_TOP_LOGPROBS", "SamplingParams"]

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
# the most sequences one request may ask for (``n``): a step holds at most max_running - 1 sequences
# and a request's forks, so the engine sizes its per-row buffers by it
MAX_N = 16


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # None: no log probabilities; k >= 0: the sampled token's and the k most likely (k <= MAX_TOP_LOGPROBS)
    logprobs: int | None = None
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence of the token among those generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    # vLLM's extra sampling fields, with vLLM's meaning
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in the prompt or the output (CTRL's rule)
    min_p: float = 0.0  # drop tokens whose probability is under min_p x the most likely token's
    min_tokens: int = 0  # no end of sequence (EOS, stop_token_ids, stop strings) before this many tokens
    stop_token_ids: tuple[int, ...] = ()  # more tokens that end the sequence, as EOS does
    include_stop_str_in_output: bool = False  # keep the stop string that ended the answer in its text
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # token sequences never written (the last one is banned)
    allowed_token_ids: tuple[int, ...] | None = None  # only these tokens may be written (None: all)
    skip_special_tokens: bool = True  # special tokens write no text
    # a reasoning model's reasoning ends (its end tag is forced) after this many tokens; None: no bound
    max_reasoning_tokens: int | None = None
    # a space between special tokens written as text where the tokenizer's decoder puts one (vLLM's
    # fast detokenizer); a byte-level vocabulary's decoder never does, so there it changes nothing
    spaces_between_special_tokens: bool = True

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether ``logits_process.adjust`` has anything to do for this request."""
        return bool(self.logit_bias) or self.has_penalties or self.repetition_penalty != 1.0

    @property
    def has_bans(self) -> bool:
        """Whether some step may forbid tokens (``token_bans``): allowed ids, bad words, min_tokens."""
        return self.allowed_token_ids is not None or bool(self.bad_words_ids) or self.min_tokens > 0
