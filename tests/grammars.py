"""Whether a compiled grammar of either backend accepts a whole text (then the stop token)."""

from __future__ import annotations

from typing import Any

import xgrammar as xgr

from sampling.llguidance_matcher import LLGrammar, new_matcher

EOS = 2  # </s> of the embedded tokenizer


def accepts(grammar: Any, text: str, hf_tokenizer: Any = None) -> bool:
    """``text`` is a complete sentence of ``grammar`` (xgrammar: by bytes; llguidance: by the
    tokenizer's tokens, so it needs ``hf_tokenizer``)."""
    if isinstance(grammar, LLGrammar):
        matcher = new_matcher(grammar)
        tokens = hf_tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.accept_token(t) for t in tokens) and matcher.accept_token(EOS)
    matcher = xgr.GrammarMatcher(grammar)
    return matcher.accept_string(text) and matcher.accept_token(EOS) and matcher.is_terminated()
