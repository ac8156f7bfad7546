"""The grammar stage: a constraint compiled by xgrammar or llguidance (``stage``, ``backend_choice``,
``jobs``, ``compile``, ``backends``, ``cache``), the bounds and refusals checked before a compile
(``limits``, ``checks``, ``schema_support``, ``empty_schemas``), the walks over a schema they share
(``schema_walk``, ``json_pointer``, ``dispatch``), the threads a native compile runs on
(``native_calls``), and the check every answer passes (``answer_check``).

The schema walks and the answer check import none of the compile (``make check`` holds it). The wire
protocol imports a schema walk (``empty_schemas``) and must not load torch or a compiler with it, so
this ``__init__`` imports its two names only when they are first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stages.grammar.stage import GrammarStage
    from stages.grammar.types import CompiledConstraint

__all__ = ["CompiledConstraint", "GrammarStage"]

_HOMES = {"CompiledConstraint": "stages.grammar.types", "GrammarStage": "stages.grammar.stage"}


def __getattr__(name: str) -> Any:
    # both pull in torch and xgrammar; pipeline.protocol imports the schema walks and stays without them
    if name not in _HOMES:
        raise AttributeError(name)
    return getattr(importlib.import_module(_HOMES[name]), name)
