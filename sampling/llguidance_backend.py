"""Guided decoding with llguidance: a second grammar backend with the interface the engine uses for xgrammar.

Why: xgrammar 0.2.8 does not enforce some JSON-schema keywords it accepts (a raw TAB gets into a string
with ``minLength``/``maxLength``, mlc-ai/xgrammar#800); llguidance enforces bounded strings, ``pattern``
with lengths, ``multipleOf`` and common formats, refuses by name what it cannot enforce, and compiles in
milliseconds. Its bitmask is xgrammar's (int32 ``[rows, ceil(vocab / 32)]``, bit i of word w allows token
32 w + i), so the engine's mask application is shared. What matches xgrammar on purpose:

- JSON is compact: no free whitespace, ``", "`` between items and ``": "`` after keys (xgrammar's
  ``any_whitespace=False`` layout); properties come in schema order.
- ``strict`` closes objects that have ``properties`` and arrays that have ``prefixItems`` (xgrammar's
  ``strict_mode``) and refuses unsupported keywords; ``strict=False`` ignores them (``LLGrammar.warnings``).
- The stop token is allowed exactly when the grammar can end; after it the matcher is terminated.
  A rejected token leaves the matcher as it was (llguidance's own ``consume_token`` would poison it).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import torch

from pipeline.errors import GrammarError, UnsupportedSchemaError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = ["BitmaskFiller", "LLGrammar", "LLGuidanceBackend", "LLGuidanceMatcher", "batch_accept", "new_matcher"]

_JSON_ERROR = "could not compile the json_schema: "
# llguidance messages that mean "cannot enforce this", not "invalid schema", as the keyword concerned
_LIMITATIONS = {
    "oneOf constraints are not supported": "oneOf (branches that may overlap)",
    "oneOf not fully supported": "oneOf (branches that may overlap)",
    "min/maxProperties only supported": "minProperties/maxProperties (with optional properties)",
    "patternProperty regexes": "patternProperties (overlapping patterns)",
}
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[.*\])")
_REPEATS = re.compile(r" \(\d+ times\)$")
_RUST_SOURCE = re.compile(r"\S+\.rs:\d+(:\d+)?")
_MAX_MESSAGE = 1000
# JSON-schema keywords whose value is one subschema, a list of them, or a map of name -> subschema
_SUB_ONE = (
    "additionalProperties",
    "items",
    "additionalItems",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
)
_SUB_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_COMBINATORS = frozenset({"anyOf", "oneOf", "allOf", "$ref"})  # siblings of these are intersected with them
_OPENERS = frozenset({"additionalProperties", "patternProperties", "unevaluatedProperties"})
_OBJECT_KEYWORDS = frozenset({"properties", "required", "additionalProperties", "patternProperties"})
_ANNOTATIONS = frozenset({"$ref", "description", "title", "default", "examples", "$comment", "deprecated"})
_SUB_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


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


class LLGuidanceMatcher:
    """One sequence's grammar state, with xgrammar's ``GrammarMatcher`` semantics."""

    __slots__ = ("_matcher", "_stop_token_ids", "_vocab_size", "_is_terminated")

    def __init__(self, grammar: LLGrammar) -> None:
        # Not LLMatcher.deep_copy(): copies share one lexer and its fuel, so one sequence that runs
        # the lexer out (a permanent error) would break every later matcher of a cached grammar.
        self._matcher = llguidance.LLMatcher(grammar.tokenizer, grammar.grammar, log_level=0, limits=grammar.limits)
        if self._matcher.is_error():
            raise ValueError(f"the {grammar.kind} no longer compiles: {_clean(self._matcher.get_error())}")
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

    def is_terminated(self) -> bool:
        """Whether the stop token has been accepted (the grammar was complete)."""
        return self._is_terminated

    def can_terminate(self) -> bool:
        """Whether the text so far is complete (the stop token would be accepted)."""
        return not self._is_terminated and self._matcher.is_accepting()


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


def _json_options(*, lenient: bool) -> JsonCompileOptions:
    """xgrammar's ``any_whitespace=False`` layout; these override the schema's own ``x-guidance``."""
    return {
        "whitespace_flexible": False,
        "item_separator": ", ",
        "key_separator": ": ",
        "lenient": lenient,
        "coerce_one_of": lenient,
    }


def _clean(message: str) -> str:
    text = _RUST_SOURCE.sub("", message).strip()
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE] + " ..."


def _limitations(message: str) -> list[str]:
    """The keywords an llguidance message says it cannot enforce (``['uniqueItems']``, ``['format
    (idn-email)']``); empty when the message says something else (an invalid schema)."""
    message = _REPEATS.sub("", message)
    if match := _UNIMPLEMENTED.fullmatch(message):
        return re.findall(r'"((?:[^"\\]|\\.)*)"', match[1])  # Rust's debug form of a list of names
    if message.startswith("Unknown format: "):
        return [f"format ({message.removeprefix('Unknown format: ')})"]
    if "look-around" in message:
        return ["pattern (look-around)"]
    return [label for prefix, label in _LIMITATIONS.items() if message.startswith(prefix)]


def _guarded_refs(node: Any, found: set[str]) -> set[str]:
    """Local refs whose target is intersected with something: members of a multi-allOf, refs with siblings."""
    if isinstance(node, dict):
        all_of = node.get("allOf")
        members: list[Any] = all_of if isinstance(all_of, list) and len(all_of) > 1 else []
        for sub in [*members, node if node.keys() - _ANNOTATIONS else None]:
            if isinstance(sub, dict) and isinstance(sub.get("$ref"), str):
                found.add(sub["$ref"].removeprefix("#"))
        for value in node.values():
            _guarded_refs(value, found)
    elif isinstance(node, list):
        for value in node:
            _guarded_refs(value, found)
    return found


def _close(node: Any, guarded: set[str], path: str, is_intersected: bool) -> None:
    """xgrammar's strict mode, in place: objects with ``properties`` and arrays with ``prefixItems``
    take nothing undeclared. Not where the schema is intersected with another (allOf members, $ref
    siblings, branches beside object keywords), nor where ``required`` names an undeclared property:
    closing there would refuse what the other side declares (llguidance: "unsatisfiable")."""
    if not isinstance(node, dict):
        return
    is_open = not is_intersected and path not in guarded and not _COMBINATORS & node.keys()
    declared = node.get("properties")
    required: list[Any] = node["required"] if isinstance(node.get("required"), list) else []
    if is_open and isinstance(declared, dict) and not _OPENERS & node.keys() and set(required) <= declared.keys():
        node["additionalProperties"] = False
    if is_open and isinstance(node.get("prefixItems"), list) and "items" not in node:
        node["items"] = False
    for key in _SUB_ONE:
        _close(node.get(key), guarded, f"{path}/{key}", False)
    has_object_keywords = bool(_OBJECT_KEYWORDS & node.keys())
    for key in _SUB_LIST:
        if isinstance(node.get(key), list):
            intersected = key in _COMBINATORS and (
                is_intersected or has_object_keywords or (key == "allOf" and len(node[key]) > 1)
            )
            for i, sub in enumerate(node[key]):
                _close(sub, guarded, f"{path}/{key}/{i}", intersected)
    for key in _SUB_MAP:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                _close(sub, guarded, f"{path}/{key}/{name}", False)


def close_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``schema`` closed as xgrammar's ``strict_mode`` closes it (see ``_close``)."""
    closed = copy.deepcopy(schema)
    _close(closed, _guarded_refs(closed, set()), "", False)
    return closed


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


class LLGuidanceBackend:
    """One ``LLTokenizer`` (about 2 s to build: make one per tokenizer), its compilers and a fill executor."""

    def __init__(self, hf_tokenizer: Any, *, vocab_size: int, stop_token_ids: list[int], max_threads: int = 1) -> None:
        if vocab_size < len(hf_tokenizer):
            raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(hf_tokenizer)}")
        # n_vocab = the logits width, so a mask row is exactly the engine's row; ids past the tokenizer
        # are never allowed. eos = the stop ids: allowed exactly when the grammar is complete.
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=stop_token_ids)
        self.vocab_size = vocab_size
        self.stop_token_ids = frozenset(stop_token_ids)
        self.num_words = (vocab_size + 31) // 32
        self._filler = BitmaskFiller(max_threads)
        # The lexer spends "fuel" building states; a mask refills it to step_lexer_fuel, tokens taken
        # without a mask (replay, a deferred greedy token) spend what is left, and at zero the lexer
        # fails for good ("too many expressions constructed"), refusing valid text. The defaults
        # (1M, 200k) refused valid instances of a word-count pattern with maxLength in the corpus;
        # 20M / 2M (about 1.4 s / 140 ms of lexer work at most) accepted them all. Verbose errors
        # would put the parser state and the grammar into a client's 400.
        self._limits = llguidance.LLParserLimits(
            initial_lexer_fuel=20_000_000, step_lexer_fuel=2_000_000, verbose_errors=False
        )

    def _build(self, kind: str, grammar: str, *, field: str | None) -> LLGrammar:
        """Validate by building a matcher and its first mask.

        :raises GrammarError: with llguidance's message.
        """
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._limits)
        if not matcher.is_error():
            matcher.compute_bitmask()
        if matcher.is_error():
            raise GrammarError(f"could not compile the {kind}: {_clean(matcher.get_error())}", field=field)
        warnings = tuple(matcher.get_grammar_warnings())
        return LLGrammar(
            kind, grammar, self.tokenizer, self._limits, matcher, self.stop_token_ids, self.vocab_size, warnings
        )

    def compile_json_schema(
        self, schema: dict[str, Any] | bool, *, strict: bool, field: str | None = None
    ) -> LLGrammar:
        """Compact JSON satisfying ``schema``.

        :raises UnsupportedSchemaError: listing the keywords llguidance cannot enforce (strict: every one;
            otherwise those it cannot even approximate, e.g. overlapping patternProperties, look-around).
        :raises GrammarError: the schema is invalid, unsatisfiable or too large.
        """
        if schema is False:
            raise GrammarError("could not compile the json_schema: the schema false allows no value", field=field)
        if not isinstance(schema, dict):
            schema = {}
        if strict:
            schema = close_schema(schema)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_json_options(lenient=not strict))
        try:
            return self._build("json_schema", grammar, field=field)
        except GrammarError as exc:
            refusal = exc
        keywords = _limitations(refusal.message.removeprefix(_JSON_ERROR))
        if not keywords:
            raise refusal
        if strict:  # list every keyword llguidance cannot enforce: lenient mode warns about each
            lenient = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_json_options(lenient=True))
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
                lenient, self.tokenizer, limits=self._limits
            )
            more = [keyword for message in messages for keyword in _limitations(message)]
            if is_error and not more:  # a limitation, and an invalid schema too: say the latter
                raise GrammarError(_JSON_ERROR + _clean(messages[0]), field=field)
            keywords = list(dict.fromkeys(more + keywords))
        hint = " (send strict: false to accept an output that may not satisfy them)" if strict else ""
        raise UnsupportedSchemaError(
            f"the schema uses keywords that guided decoding cannot enforce: {'; '.join(keywords)}{hint}",
            keywords=keywords,
            field=field,
        )

    def compile_regex(self, pattern: str, *, field: str | None = None) -> LLGrammar:
        """Text fully matching ``pattern``; ``\\d`` and ``\\w`` are ASCII, as in xgrammar and JSON schema.

        :raises GrammarError: the pattern does not parse or uses look-around.
        """
        lark = f"start: /{llguidance.regex_to_lark(pattern, 'dw')}/"
        return self._build("regex", llguidance.LLMatcher.grammar_from_lark(lark), field=field)

    def compile_lark(self, grammar: str, *, field: str | None = None) -> LLGrammar:
        """A Lark grammar (llguidance's dialect; the start rule is ``start``).

        :raises GrammarError: the grammar does not parse or names an unknown rule.
        """
        return self._build("grammar", llguidance.LLMatcher.grammar_from_lark(grammar), field=field)

    def compile_ebnf(self, grammar: str, *, field: str | None = None) -> LLGrammar:
        """A GBNF / xgrammar-style EBNF grammar (``root ::= ...``), converted to Lark; Lark passes through.
        xgrammar's look-ahead ``(= ...)`` and ``\\uXXXX`` escapes are not converted (refused).

        :raises GrammarError: the grammar cannot be converted or compiled.
        """
        try:
            lark = llguidance.grammar_from("gbnf", grammar)
        except ValueError as exc:
            raise GrammarError(f"could not compile the grammar: {_clean(str(exc))}", field=field) from None
        return self._build("grammar", lark, field=field)

    def compile_choice(self, choices: list[str], *, field: str | None = None) -> LLGrammar:
        """Exactly one of ``choices``.

        :raises GrammarError: no choices, or one that is not a string.
        """
        if not choices or not all(isinstance(c, str) for c in choices):
            raise GrammarError("could not compile the choice: it must be a non-empty list of strings", field=field)
        lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        return self._build("choice", llguidance.LLMatcher.grammar_from_lark(lark), field=field)

    def fill(self, matchers: Sequence[LLGuidanceMatcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """Fill row ``rows[i]`` of ``bitmask`` from ``matchers[i]``: one call that releases the GIL.

        :raises ValueError: the bitmask is not a contiguous CPU int32 ``[R, ceil(vocab / 32)]`` or a row is out of it.
        """
        if bitmask.dim() != 2 or bitmask.shape[1] != self.num_words:
            raise ValueError(f"the bitmask must be [rows, {self.num_words}], not {list(bitmask.shape)}")
        self._filler.fill(matchers, bitmask, rows)

    new_matcher = staticmethod(new_matcher)
    batch_accept = staticmethod(batch_accept)
