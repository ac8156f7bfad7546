"""Guided decoding with llguidance: a second grammar backend, compiled here, matched as xgrammar's are.

Why: xgrammar 0.2.8 does not enforce some JSON-schema keywords it accepts (a raw TAB gets into a string
with ``minLength``/``maxLength``, mlc-ai/xgrammar#800); llguidance enforces bounded strings, ``pattern``
with lengths, ``multipleOf`` and common formats, refuses by name what it cannot enforce, and compiles in
milliseconds. What matches xgrammar on purpose:

- JSON is compact: no free whitespace, ``", "`` between items and ``": "`` after keys (xgrammar's
  ``any_whitespace=False`` layout); properties come in schema order.
- ``strict`` closes objects that have ``properties`` and arrays that have ``prefixItems`` (xgrammar's
  ``strict_mode``, sampling/guided/llguidance/schema.py) and refuses unsupported keywords; ``strict=False``
  ignores them (``LLGrammar.warnings``).
- The matchers, their bitmask and their stop token behave as xgrammar's (sampling/guided/llguidance/matcher.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import torch

from pipeline.errors import GrammarError, UnsupportedSchemaError
from sampling.guided.llguidance.matcher import (
    BitmaskFiller,
    LLGrammar,
    LLGuidanceMatcher,
    batch_accept,
    clean_message,
    new_matcher,
)
from sampling.guided.llguidance.schema import close_schema
from sampling.guided.llguidance.tags import NotTranslatable, structural_tag_to_lark

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = ["LLGuidanceBackend"]

# parser items in one row: see LLGuidanceBackend's limits
_MAX_ITEMS_IN_ROW = 25_000

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


def _json_options(*, lenient: bool) -> JsonCompileOptions:
    """xgrammar's ``any_whitespace=False`` layout; these override the schema's own ``x-guidance``."""
    return {
        "whitespace_flexible": False,
        "item_separator": ", ",
        "key_separator": ": ",
        "lenient": lenient,
        "coerce_one_of": lenient,
    }


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


def _special_tokens(hf_tokenizer: Any, tokenizer: llguidance.LLTokenizer) -> dict[str, int]:
    """The text of each token llguidance reads as special (no text: its lexer never matches it) -> its id."""
    added: dict[int, Any] = getattr(hf_tokenizer, "added_tokens_decoder", None) or {}
    return {
        str(token): i
        for i, token in added.items()
        if i < tokenizer.vocab_size and tokenizer.is_special_token(i) and str(token)
    }


def _ll_tokenizer(hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance's tokenizer of a fast Hugging Face tokenizer, from its JSON (added tokens included).

    ``llguidance.hf.from_tokenizer`` copies the Rust tokenizer first, so that turning off its padding and
    truncation leaves the caller's alone; that copy is a pickle round trip of the whole vocabulary (1.0 of
    its 2.5 s here, at every engine process start). A tokenizer with neither, as loaded, gives the same
    JSON without the copy; one with either goes through the library's path.
    """
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None or backend.padding is not None or backend.truncation is not None:
        return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=stop_token_ids)
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=stop_token_ids)


class LLGuidanceBackend:
    """One ``LLTokenizer`` (about 1.4 s to build here: make one per tokenizer), its compilers and a fill executor."""

    def __init__(self, hf_tokenizer: Any, *, vocab_size: int, stop_token_ids: list[int], max_threads: int = 1) -> None:
        if vocab_size < len(hf_tokenizer):
            raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(hf_tokenizer)}")
        # n_vocab = the logits width, so a mask row is exactly the engine's row; ids past the tokenizer
        # are never allowed. eos = the stop ids: allowed exactly when the grammar is complete.
        self.tokenizer = _ll_tokenizer(hf_tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        self.stop_token_ids = frozenset(stop_token_ids)
        self.special_tokens = _special_tokens(hf_tokenizer, self.tokenizer)
        self.num_words = (vocab_size + 31) // 32
        self._filler = BitmaskFiller(max_threads)
        # The lexer spends "fuel" building states; a mask refills it to step_lexer_fuel, tokens taken
        # without a mask (replay, a deferred greedy token) spend what is left, and at zero the lexer
        # fails for good ("too many expressions constructed"), refusing valid text. The defaults
        # (1M, 200k) refused valid instances of a word-count pattern with maxLength in the corpus;
        # 20M / 2M (about 1.4 s / 140 ms of lexer work at most) accepted them all. Verbose errors
        # would put the parser state and the grammar into a client's 400.
        # A parser row holds about 4 items per optional property of a JSON object (600 made 2,399):
        # at the default cap of 2,000 the first token of such an answer failed the matcher after
        # its mask had allowed it. 25,000 takes some 6,000 optional properties and still stops a
        # right-recursive grammar whose rows grow with the text.
        self._limits = llguidance.LLParserLimits(
            initial_lexer_fuel=20_000_000,
            step_lexer_fuel=2_000_000,
            max_items_in_row=_MAX_ITEMS_IN_ROW,
            verbose_errors=False,
        )

    def _build(self, kind: str, grammar: str, *, field: str | None) -> LLGrammar:
        """Validate by building a matcher and its first mask.

        :raises GrammarError: with llguidance's message.
        """
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._limits)
        if not matcher.is_error():
            matcher.compute_bitmask()
        if matcher.is_error():
            raise GrammarError(f"could not compile the {kind}: {clean_message(matcher.get_error())}", field=field)
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
                raise GrammarError(_JSON_ERROR + clean_message(messages[0]), field=field)
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
            raise GrammarError(f"could not compile the grammar: {clean_message(str(exc))}", field=field) from None
        return self._build("grammar", lark, field=field)

    def compile_structural_tag(self, tag: dict[str, Any], *, field: str | None = None) -> LLGrammar:
        """xgrammar 0.2's structural tag, where Lark says it exactly (``sampling.guided.llguidance.tags``).

        :raises UnsupportedSchemaError: a format with no translation (xgrammar may compile it).
        :raises GrammarError: the translation does not compile.
        """
        try:
            lark = structural_tag_to_lark(tag, self.special_tokens)
        except NotTranslatable as exc:
            raise UnsupportedSchemaError(f"llguidance does not compile {exc} here", field=field) from None
        return self._build("structural_tag", llguidance.LLMatcher.grammar_from_lark(lark), field=field)

    def acceptor(self, grammar: LLGrammar) -> Callable[[str], bool]:
        """Whether a whole text is a complete sentence of ``grammar`` (a fresh matcher per call, fed
        the text's tokens: llguidance takes any tokenization of the same bytes)."""

        def accepts(text: str) -> bool:
            try:
                data = text.encode("utf-8")
            except UnicodeEncodeError:  # a raw surrogate: not text a client can be sent
                return False
            matcher = llguidance.LLMatcher(self.tokenizer, grammar.grammar, log_level=0, limits=self._limits)
            tokens = self.tokenizer.tokenize_bytes(data)
            return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()

        return accepts

    def compile_choice(self, choices: list[str], *, field: str | None = None) -> LLGrammar:
        """Exactly one of ``choices``.

        :raises GrammarError: no choices, or one that is not a string.
        """
        if not choices or not all(isinstance(c, str) for c in choices):
            raise GrammarError("could not compile the choice: it must be a non-empty list of strings", field=field)
        # One lexeme (a terminal), not one parser alternative per choice: the parser's row held one
        # item per choice and a list of 2,000 or more failed the matcher on its first token.
        lark = "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
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
