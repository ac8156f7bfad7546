"""Forced tokens: what a sequence's grammar admits in one way only, written without a decode step each.

Most of a structured answer is forced by its constraint: for ``{"name": string, "age": integer}``
the braces, every key, its quotes and the separators admit one continuation. After a sequence's
sampled token is accepted, its matcher says what text is forced; those tokens are appended (each
accepted by the matcher) and run through the model in the sequence's next step as one extend of k
tokens (sampling/scheduler.py), after which it samples again. A forced token is the one the constraint
leaves: no step of the model chooses it.

What each backend says:

- llguidance's ``compute_ff_tokens()``: the forced text in the tokenizer's canonical tokenization,
  without the last tokens that the text after them could merge with.
- xgrammar's ``find_jump_forward_string()``: the forced text. It is tokenized here together with the
  sequence's last two tokens, so that a boundary never splits what the tokenizer would merge: only
  when that tokenization starts with those two tokens, and never the last token of the forced text
  (the free text after it could merge with it).

The tokens are those the model's tokenizer writes for the forced text; a model that would have spelt
it otherwise (``{`` then ``"name`` where the tokenizer writes ``{"`` then ``name``) sees the
tokenizer's spelling instead, the same text. An end-of-sequence token is never forced: the answer
ends where the sampler says it does.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from sampling.guided.llguidance.matcher import LLGuidanceMatcher

__all__ = ["ForcedTokens"]

_CONTEXT = 2  # the sequence's last tokens tokenized with xgrammar's forced text


class ForcedTokens:
    """The forced continuation of a sequence's grammar, in token ids."""

    def __init__(
        self,
        token_bytes: Sequence[bytes],
        encode: Callable[[str], list[int]] | None,
        end_tokens: Collection[int],
        *,
        max_tokens: int = 64,
    ) -> None:
        """``token_bytes``: each id's bytes; ``encode``: text to ids without special tokens (None: no
        forcing with xgrammar's matchers); ``end_tokens``: never forced; ``max_tokens``: at most this
        many at once (the next step's extend)."""
        self.token_bytes = token_bytes
        self.encode = encode
        self.end_tokens = frozenset(end_tokens)
        self.max_tokens = max_tokens

    def after(self, matcher: Any, output_ids: Sequence[int]) -> list[int]:
        """The tokens ``matcher`` forces next (not accepted yet), ``output_ids`` the sequence's output so far."""
        if isinstance(matcher, LLGuidanceMatcher):
            tokens = matcher.forced_tokens()
        else:
            tokens = self._xgrammar(matcher, output_ids)
        forced: list[int] = []
        for token in tokens[: self.max_tokens]:
            if token in self.end_tokens:
                break
            forced.append(token)
        return forced

    def _xgrammar(self, matcher: Any, output_ids: Sequence[int]) -> list[int]:
        if self.encode is None or matcher.is_terminated():
            return []
        text = matcher.find_jump_forward_string()
        if not text:
            return []
        context_ids = list(output_ids[-_CONTEXT:])
        try:
            context = b"".join(self.token_bytes[t] for t in context_ids).decode("utf-8")
        except (UnicodeDecodeError, IndexError):  # a character split across tokens: no safe boundary
            return []
        written = self.encode(context + text)
        if written[: len(context_ids)] != context_ids:
            # the forced text merges into the tokens before it, or the model spelt those otherwise than
            # the tokenizer does: either way the tokenizer's boundary is not the sequence's
            return []
        return written[len(context_ids) : -1]
