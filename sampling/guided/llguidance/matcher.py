"""llguidance's matchers, with the interface the engine uses for xgrammar's: one per sequence, batched accept and fill.

What matches xgrammar on purpose: the bitmask is xgrammar's (int32 ``[rows, ceil(vocab / 32)]``, bit i
of word w allows token 32 w + i), so the engine's mask application is shared; the stop token is allowed
exactly when the grammar can end, and after it the matcher is terminated; a rejected token leaves the
matcher as it was (llguidance's own ``consume_token`` would poison it). Grammars are compiled in
sampling/guided/llguidance/backend.py; this is the half the engine needs, no tokenizer included.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import llguidance
import torch

__all__ = [
    "INTERNAL_FAILURE",
    "BitmaskFiller",
    "LLGrammar",
    "LLGuidanceMatcher",
    "batch_accept",
    "clean_library_message",
    "clean_message",
    "new_matcher",
]

_RUST_SOURCE = re.compile(r"\S+\.rs:\d+(:\d+)?")
_MAX_MESSAGE = 1000
# a panic's message and backtrace name build paths and library internals: never a client's business
_PANIC = re.compile(r"panicked at|stack backtrace|RUST_BACKTRACE")
_BUILD_PATH = re.compile(r"/(?:home|root|rustc|usr|opt|tmp|build|workspace|Users|cargo|github|runner)/[^\s:\"',)]*")
#: what a client is told when a grammar library fails inside (a panic), instead of its backtrace
INTERNAL_FAILURE = "the grammar library failed on it (an internal error; a smaller constraint may compile)"


def clean_library_message(message: str) -> str:
    """A grammar library's message fit for a client: no panic, backtrace or build path."""
    if _PANIC.search(message):
        return INTERNAL_FAILURE
    return re.sub(r"(?<=\S) {2,}(?=\S)", " ", _BUILD_PATH.sub("", message))


def clean_message(message: str) -> str:
    """An llguidance error message fit for a client: no Rust source locations, panic or build path,
    at most 1000 characters."""
    text = clean_library_message(_RUST_SOURCE.sub("", message)).strip()
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE] + " ..."


@dataclass(frozen=True, slots=True, eq=False)
class LLGrammar:
    """A validated grammar; each ``new_matcher`` builds its own ``LLMatcher`` from it (milliseconds)."""

    kind: str
    grammar: str  # llguidance's grammar JSON, what a matcher is built from
    tokenizer: llguidance.LLTokenizer = field(repr=False)
    limits: llguidance.LLParserLimits = field(repr=False)
    # the matcher that validated it, never advanced: compute_bitmask() returns its first mask at no
    # cost. Never deep_copy() it for a sequence (see LLGuidanceMatcher).
    prototype: llguidance.LLMatcher = field(repr=False)
    stop_token_ids: frozenset[int]
    vocab_size: int
    warnings: tuple[str, ...] = ()  # what strict=False ignores ("Unimplemented keys: [...]")
    # the prototype, until the grammar's first matcher takes it (its builder puts it here once it is
    # done with it): a new schema's first sequence then skips a matcher build (0.6 ms, on its time to
    # first token). A copy made with dataclasses.replace starts without one.
    spare: list[llguidance.LLMatcher] = field(default_factory=list, init=False, repr=False, compare=False)


class LLGuidanceMatcher:
    """One sequence's grammar state, with xgrammar's ``GrammarMatcher`` semantics."""

    __slots__ = ("_matcher", "_stop_token_ids", "_vocab_size", "_is_terminated")

    def __init__(self, grammar: LLGrammar) -> None:
        # Not LLMatcher.deep_copy(): copies share one lexer and its fuel, so one sequence that runs
        # the lexer out (a permanent error) would break every later matcher of a cached grammar. The
        # prototype itself is taken once (list.pop is atomic: two sequences never share it).
        try:
            self._matcher = grammar.spare.pop()
        except IndexError:
            self._matcher = llguidance.LLMatcher(grammar.tokenizer, grammar.grammar, log_level=0, limits=grammar.limits)
        if self._matcher.is_error():
            raise ValueError(f"the {grammar.kind} no longer compiles: {clean_message(self._matcher.get_error())}")
        self._stop_token_ids = grammar.stop_token_ids
        self._vocab_size = grammar.vocab_size
        self._is_terminated = False

    def accept_token(self, token: int) -> bool:
        """Advance by ``token``; False (state unchanged) when the grammar does not allow it."""
        if self._is_terminated or not 0 <= token < self._vocab_size:
            return False
        if token in self._stop_token_ids:
            # a stopped matcher (nothing can follow) allows the stop token but try_consume refuses it
            if not self._matcher.is_accepting() or not self._matcher.consume_token(token):
                return False
            self._is_terminated = True
            return True
        return self._matcher.try_consume_tokens([token]) == 1

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces next, not accepted yet: its forced text in the tokenizer's
        canonical tokenization, less the last tokens that the text after them could merge with."""
        if self._is_terminated or self._matcher.is_error():
            return []
        return list(self._matcher.compute_ff_tokens())

    def is_terminated(self) -> bool:
        """Whether the stop token has been accepted (the grammar was complete)."""
        return self._is_terminated

    def can_terminate(self) -> bool:
        """Whether the text so far is complete (the stop token would be accepted)."""
        return not self._is_terminated and self._matcher.is_accepting()

    def error(self) -> str | None:
        """Why the matcher gave up for good (a parser or lexer limit reached), or None while it works:
        a token it then refuses was refused by the limit, not by the grammar."""
        if not self._matcher.is_error():
            return None
        return clean_message(self._matcher.get_error().replace("<non-verbose/>", "").strip())


def new_matcher(grammar: LLGrammar, replay: Sequence[int] = ()) -> LLGuidanceMatcher:
    """A fresh matcher advanced over ``replay`` (tokens accepted before a preemption).

    :raises ValueError: if a replayed token is rejected.
    """
    matcher = LLGuidanceMatcher(grammar)
    for i, token in enumerate(replay):
        if not matcher.accept_token(token):
            raise ValueError(f"replayed token {token} (position {i}) rejected by the grammar")
    return matcher


def batch_accept(matchers: Sequence[LLGuidanceMatcher], tokens: Sequence[int]) -> list[bool]:
    """Advance each matcher by its token; False leaves that matcher as it was (about 1 us a matcher)."""
    return [m.accept_token(t) for m, t in zip(matchers, tokens, strict=True)]


class BitmaskFiller:
    """Fills bitmask rows from llguidance matchers in one call that releases the GIL (the engine's
    half of the backend: it needs no tokenizer, only llguidance's executor). A row must be exactly
    as wide as the backend's ``vocab_size`` (llguidance refuses another width: "Invalid buffer size")."""

    def __init__(self, max_threads: int = 1) -> None:
        self._executor = llguidance.LLExecutor(max_threads)

    def fill(self, matchers: Sequence[LLGuidanceMatcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """Fill row ``rows[i]`` of ``bitmask`` ``[R, words]`` (contiguous int32 on the CPU) from ``matchers[i]``.

        :raises ValueError: the bitmask is not a contiguous CPU int32 matrix or a row is out of it.
        """
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
            raise ValueError("the bitmask must be a contiguous int32 tensor on the CPU")
        if bitmask.dim() != 2:
            raise ValueError(f"the bitmask must be [rows, words], not {list(bitmask.shape)}")
        if len(matchers) != len(rows) or any(not 0 <= r < bitmask.shape[0] for r in rows):
            raise ValueError("one row per matcher, each inside the bitmask")
        work = [(m._matcher, r) for m, r in zip(matchers, rows, strict=True)]
        row_bytes = bitmask.shape[1] * 4  # llguidance writes row K at data_ptr + K * row_bytes
        self._executor.unsafe_compute_mask_ptr(work, bitmask.data_ptr(), row_bytes, bitmask.shape[0])
