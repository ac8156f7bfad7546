"""Guided decoding in the engine: each sequence's grammar matcher (xgrammar's or llguidance's), the
step's grammar work (bitmask rows filled beside the forward, tokens accepted after it) and llguidance's
backend.

- ``decoder``: ``GuidedDecoder``, the matchers of a batch of either backend, filled and accepted together.
- ``step_grammar``: ``StepGrammar``, the grammar side of one engine step.
- ``llguidance/``: the second backend: its compiler (``backend``), its matchers (``matcher``), xgrammar's
  strict mode for it (``schema``) and structural tags as Lark (``tags``).

Names load on first use: the grammar stage imports ``llguidance.backend`` without the engine's parts.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["GrammarUnavailable", "GuidedDecoder", "StepGrammar", "new_matcher", "refusal", "resolve_grammar"]

_HOMES = {
    "GrammarUnavailable": "decoder",
    "GuidedDecoder": "decoder",
    "new_matcher": "decoder",
    "refusal": "decoder",
    "resolve_grammar": "decoder",
    "StepGrammar": "step_grammar",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
