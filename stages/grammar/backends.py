"""The two grammar backends behind one call: compile a spec into what the engine makes matchers from,
plus the answer check of the same spec; and our own error messages for both.

- xgrammar compiles every kind; JSON without free whitespace (``any_whitespace=False``).
- llguidance compiles JSON schemas, regexes, choices, EBNF grammars (converted to Lark), Lark
  grammars (vLLM's ``guided_grammar`` takes Lark) and the structural tags Lark says exactly
  (``sampling.guided.llguidance.tags``); ``stages.grammar.dispatch`` decides which backend a spec goes to.
- ``XGrammarCompiler.parse`` checks an EBNF grammar or a structural tag without the tokenizer
  (milliseconds, no compile slot), so a malformed one is refused at once.

Both produce the same 32-bit bitmask layout, so the engine masks logits the same way for either.
A compile also proves the grammar can emit something: a constraint whose first mask allows no token
(an empty language, a bare ``{"$ref": "#"}`` cycle) is a 400 here, never a 500 in the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from pipeline.errors import GrammarError, PipelineError, UnsupportedSchemaError
from pipeline.types import GrammarSpec
from sampling.guided.llguidance.backend import LLGuidanceBackend
from sampling.guided.llguidance.matcher import INTERNAL_FAILURE, LLGrammar, clean_library_message
from sampling.guided.llguidance.schema import close_schema
from stages.grammar.answer_check import AnswerCheck, build_answer_check, xgrammar_acceptor
from stages.grammar.dispatch import is_lark
from stages.grammar.empty_schemas import empty_schema_reason
from stages.grammar.schema_support import check_schema_support

__all__ = ["Compiled", "LLGuidanceCompiler", "XGrammarCompiler", "clean_message", "refuse_without_values"]

# xgrammar's messages carry a timestamp and its C++ source path: "[12:03:55] /workspace/cpp/x.cc:91: "
_LIBRARY_NOISE = re.compile(r"\[\d{2}:\d{2}:\d{2}\]\s*|\S+\.(?:cc|cpp|h|hpp|rs|py):\d+(?::\d+)?:?\s*")
_MAX_MESSAGE = 500
# What a cached llguidance grammar holds (llguidance does not report it): the matcher prototype and
# its lexer state. Measured (RSS with and without the grammar, heap trimmed): 4-16 MB for a 10,000
# entry choice or enum, 5,000 properties or a 16 KB const, whose grammar JSON is 16-190 KB: about
# 100 bytes per byte of grammar, where the old estimate (2) let the cache hold 10-30x its bound.
_LLGUIDANCE_BASE_BYTES = 256 * 1024
_LLGUIDANCE_BYTES_PER_GRAMMAR_BYTE = 100
# kinds whose answer check is the compiled grammar's own acceptor (no independent checker exists)
_ACCEPTOR_KINDS = frozenset({"grammar", "structural_tag"})


def clean_message(message: str) -> str:
    """A library's error message without its source paths, timestamps, stack or panic: one line of ours."""
    if clean_library_message(str(message)) == INTERNAL_FAILURE:  # a panic: nothing in it is for the client
        return INTERNAL_FAILURE
    cleaned = (clean_library_message(_LIBRARY_NOISE.sub("", raw)).strip() for raw in str(message).splitlines())
    lines = [line for line in cleaned if line]
    text = lines[-1] if lines else "unknown error"
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE] + " ..."


@dataclass(frozen=True, slots=True)
class Compiled:
    """A compiled constraint before the stage names it: the grammar, its answer check, its size."""

    grammar: Any  # xgr.CompiledGrammar | LLGrammar
    check: AnswerCheck
    nbytes: int


def _compile_error(spec: GrammarSpec, exc: Exception) -> GrammarError:
    return GrammarError(f"could not compile the {spec.kind}: {clean_message(str(exc))}", field=spec.field)


def _refuse_empty(spec: GrammarSpec) -> GrammarError:
    return GrammarError(
        f"the {spec.kind.replace('_', ' ')} admits no output (an empty language or a rule that never ends)",
        field=spec.field,
    )


def refuse_without_values(spec: GrammarSpec) -> None:
    """:raises GrammarError: the schema provably admits no value (``false``, ``{"not": {}}``, a bare
    ``$ref`` cycle): a backend that ignores the keyword would write text for it."""
    if spec.value is False:
        raise GrammarError("the schema is false: no value satisfies it", field=spec.field)
    reason = empty_schema_reason(spec.value)
    if reason is not None:
        raise GrammarError(f"the schema admits no value: {reason}", field=spec.field)


def _without_free_whitespace(node: Any) -> Any:
    """A structural tag whose JSON contents allow at most one whitespace character between tokens (0 is
    refused by xgrammar 0.2.8): a weak model writes whitespace until ``max_tokens`` where a grammar
    lets it (seen here: ``<answer>{`` and then tabs and newlines)."""
    if isinstance(node, list):
        return [_without_free_whitespace(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _without_free_whitespace(item) for key, item in node.items()}
    if out.get("type") == "json_schema" and "json_schema" in out and "max_whitespace_cnt" not in out:
        out["max_whitespace_cnt"] = 1
    return out


class XGrammarCompiler:
    name = "xgrammar"

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, *, any_whitespace: bool) -> None:
        # xgrammar's own cache is off: the stage's is bounded by bytes, keyed by the canonical spec
        self.compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=2, cache_enabled=False)
        self.vocab_size = tokenizer_info.vocab_size
        self.any_whitespace = any_whitespace

    def compile(self, spec: GrammarSpec) -> Compiled:
        """Compile ``spec`` (synchronous: seconds for a hard schema).

        :raises GrammarError: naming ``spec.field``: refused, invalid or empty.
        """
        try:
            grammar = self._compile(spec)
        except PipelineError:
            raise
        except Exception as exc:  # xgrammar reports bad input as RuntimeError/ValueError
            raise GrammarError(
                f"could not compile the {spec.kind}: {clean_message(str(exc))}", field=spec.field
            ) from None
        matcher = xgr.GrammarMatcher(grammar)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        if not bool(torch.any(bitmask != 0)):
            raise _refuse_empty(spec)
        check = build_answer_check(spec, grammar_acceptor=xgrammar_acceptor(grammar))
        return Compiled(grammar, check, int(grammar.memory_size_bytes))

    def acceptor(self, spec: GrammarSpec) -> Callable[[str], bool]:
        """Whether a whole text is a sentence of ``spec``'s grammar (built by a compiler whose vocabulary
        is empty: milliseconds, no token masks).

        :raises GrammarError: naming ``spec.field``: xgrammar cannot compile it.
        """
        try:
            return xgrammar_acceptor(self._compile(spec))
        except PipelineError:
            raise
        except Exception as exc:  # xgrammar reports bad input as RuntimeError/ValueError
            raise _compile_error(spec, exc) from None

    def parse(self, spec: GrammarSpec) -> None:
        """Parse an EBNF or Lark grammar or a structural tag without the tokenizer (milliseconds; the
        compile takes seconds and a compile slot), so that a malformed one is refused at once.

        :raises GrammarError: naming ``spec.field``: the text does not parse.
        """
        try:
            if spec.kind == "grammar":
                if is_lark(spec.value):
                    xgr.Grammar.from_lark(spec.value)
                else:
                    xgr.Grammar.from_ebnf(spec.value, root_rule_name="root")
            elif spec.kind == "structural_tag":
                xgr.Grammar.from_structural_tag(json.dumps(spec.value))
        except Exception as exc:  # xgrammar reports bad input as RuntimeError/ValueError
            raise _compile_error(spec, exc) from None

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        value = spec.value
        if spec.kind == "json_schema":
            refuse_without_values(spec)
            if isinstance(value, dict):
                # keywords xgrammar ignores (stages.grammar.schema_support) are held by the answer check
                check_schema_support(value, strict=spec.strict, field=spec.field)
                return self.compiler.compile_json_schema(
                    json.dumps(value), any_whitespace=self.any_whitespace, strict_mode=spec.strict
                )
            return self.compiler.compile_json_schema("{}", any_whitespace=self.any_whitespace, strict_mode=False)
        if spec.kind == "json_object":
            return self.compiler.compile_json_schema(
                '{"type": "object"}', any_whitespace=self.any_whitespace, strict_mode=False
            )
        if spec.kind == "regex":
            return self.compiler.compile_regex(value)
        if spec.kind == "grammar":
            if is_lark(value):
                return self.compiler.compile_grammar(xgr.Grammar.from_lark(value))
            return self.compiler.compile_grammar(value, root_rule_name="root")
        if spec.kind == "choice":
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
            return self.compiler.compile_grammar(f"root ::= {alternatives}")
        if spec.kind == "structural_tag":
            tag = value if self.any_whitespace else _without_free_whitespace(value)
            return self.compiler.compile_structural_tag(json.dumps(tag))
        raise GrammarError(f"unknown constraint kind {spec.kind!r}", field=spec.field)


class LLGuidanceCompiler:
    name = "llguidance"

    def __init__(self, backend: LLGuidanceBackend) -> None:
        self.backend = backend

    def compile(self, spec: GrammarSpec) -> Compiled:
        """Compile ``spec`` (milliseconds).

        :raises GrammarError: naming ``spec.field``: refused (strict keywords it cannot enforce),
            invalid or empty.
        """
        try:
            grammar = self._compile(spec)
        except PipelineError:
            raise
        except Exception as exc:
            raise GrammarError(
                f"could not compile the {spec.kind}: {clean_message(str(exc))}", field=spec.field
            ) from None
        if not any(grammar.prototype.compute_bitmask()):
            raise _refuse_empty(spec)
        grammar.spare.append(grammar.prototype)  # not used here any more: the first matcher takes it
        acceptor = self.backend.acceptor(grammar) if spec.kind in _ACCEPTOR_KINDS else None
        check = build_answer_check(spec, grammar_acceptor=acceptor)
        return Compiled(
            grammar, check, _LLGUIDANCE_BASE_BYTES + _LLGUIDANCE_BYTES_PER_GRAMMAR_BYTE * len(grammar.grammar)
        )

    def _compile(self, spec: GrammarSpec) -> LLGrammar:
        backend, value, field = self.backend, spec.value, spec.field
        if spec.kind == "json_schema":
            refuse_without_values(spec)
            if isinstance(value, dict):
                check_schema_support(value, strict=spec.strict, field=field)
            if not spec.strict or not isinstance(value, dict):
                return backend.compile_json_schema(value, strict=False, field=field)
            try:
                try:
                    return backend.compile_json_schema(value, strict=True, field=field)
                except UnsupportedSchemaError:
                    # strict llguidance refuses keywords it cannot enforce; the answer check holds
                    # them, so constrain as far as it goes (objects closed, as strict mode closes them)
                    return backend.compile_json_schema(close_schema(value), strict=False, field=field)
            except GrammarError as exc:
                if isinstance(exc, UnsupportedSchemaError) or "Unimplemented keys" not in exc.message:
                    raise
                # some keywords it will not approximate even leniently: xgrammar may (the stage
                # falls back to it on this error)
                raise UnsupportedSchemaError(exc.message, field=field) from None
        if spec.kind == "json_object":
            return backend.compile_json_schema({"type": "object"}, strict=False, field=field)
        if spec.kind == "regex":
            return backend.compile_regex(value, field=field)
        if spec.kind == "choice":
            return backend.compile_choice(value, field=field)
        if spec.kind == "grammar":
            return backend.compile_ebnf(value, field=field)  # EBNF converted; Lark as it is
        if spec.kind == "structural_tag":
            return backend.compile_structural_tag(value, field=field)
        raise GrammarError(f"llguidance does not compile a {spec.kind} here", field=field)
