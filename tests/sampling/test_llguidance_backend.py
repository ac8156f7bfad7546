"""llguidance backend: compile and mask each kind, walk to termination, enforce what xgrammar 0.2.8 lets
through, refuse bad or unsupported schemas with our errors, replay, and share xgrammar's bitmask layout."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import re
from typing import Any

import jsonschema
import llguidance
import llguidance.hf
import pytest
import torch
import xgrammar as xgr

from pipeline.errors import GrammarError, UnsupportedSchemaError
from sampling.guided.llguidance.backend import LLGuidanceBackend
from sampling.guided.llguidance.matcher import BitmaskFiller, LLGrammar, LLGuidanceMatcher, batch_accept, new_matcher

STOP = 2  # tekken's </s>
_BITS = torch.arange(32, dtype=torch.int32)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    },
    "required": ["name", "tags", "count", "inner"],
}
SIMPLE = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


@pytest.fixture(scope="module")
def backend(hf_tokenizer: Any, tokenizer_info: Any) -> LLGuidanceBackend:
    return LLGuidanceBackend(
        hf_tokenizer, vocab_size=tokenizer_info.vocab_size, stop_token_ids=list(tokenizer_info.stop_token_ids)
    )


@pytest.fixture
def bitmask(backend: LLGuidanceBackend) -> torch.Tensor:
    return xgr.allocate_token_bitmask(4, backend.vocab_size)


def allowed(bitmask: torch.Tensor, row: int = 0) -> set[int]:
    words = bitmask[row]  # [vocab / 32] int32, bit i of word w: token 32 w + i
    nonzero = words.nonzero().flatten()
    bits = (words[nonzero, None] >> _BITS) & 1  # [W, 32]
    return set((nonzero[:, None] * 32 + _BITS)[bits.bool()].tolist())


def encode(hf_tokenizer: Any, text: str) -> list[int]:
    return hf_tokenizer.encode(text, add_special_tokens=False)


def walk(backend: LLGuidanceBackend, grammar: LLGrammar, hf_tokenizer: Any, seed: int = 0) -> str:
    """A seeded random walk over the allowed tokens, taking the stop token as soon as it is allowed."""
    rng = random.Random(seed)
    matcher = new_matcher(grammar)
    bitmask = xgr.allocate_token_bitmask(1, backend.vocab_size)
    tokens: list[int] = []
    for _ in range(300):
        backend.fill([matcher], bitmask, [0])
        ids = allowed(bitmask)
        assert ids, "the mask allows nothing before termination"
        token = STOP if STOP in ids else rng.choice(sorted(ids))
        assert matcher.accept_token(token)
        if matcher.is_terminated():
            return hf_tokenizer.decode(tokens)
        tokens.append(token)
    raise AssertionError(f"no termination after 300 tokens: {hf_tokenizer.decode(tokens)!r}")


def accepts(grammar: LLGrammar, hf_tokenizer: Any, text: str) -> bool:
    """Whether ``text`` then the stop token pass (the whole text is a complete sentence of the grammar)."""
    matcher = new_matcher(grammar)
    return all(matcher.accept_token(t) for t in encode(hf_tokenizer, text)) and matcher.accept_token(STOP)


@pytest.mark.parametrize("seed", range(4))
def test_json_walk_validates_and_is_compact(backend: LLGuidanceBackend, hf_tokenizer: Any, seed: int) -> None:
    text = walk(backend, backend.compile_json_schema(SCHEMA, strict=True), hf_tokenizer, seed)
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    assert text == json.dumps(value, separators=(", ", ": "))  # xgrammar's any_whitespace=False layout


def test_json_layout_is_xgrammars(backend: LLGuidanceBackend, hf_tokenizer: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array"}}}
    grammar = backend.compile_json_schema(schema, strict=True)
    assert accepts(grammar, hf_tokenizer, '{"a": 1, "b": [1, "x"]}')
    for other in ('{"a":1, "b": []}', '{"a": 1,"b": []}', '{ "a": 1}', '{"a": 1, "b": [1,2]}', '{"a": 1}\n'):
        assert not accepts(grammar, hf_tokenizer, other), other
    anything = backend.compile_json_schema(True, strict=True)
    assert accepts(anything, hf_tokenizer, '[{"x": null}, 1.5, "s"]')
    assert not accepts(anything, hf_tokenizer, "[1,2]")


@pytest.mark.parametrize(
    ("pattern", "good", "bad"),
    [(r"[0-9]{3}-[a-z]{2}", "123-ab", "12-ab"), (r"^\d+$", "42", "٣"), (r"(yes|no)!?", "no!", "yes!!")],
)
def test_regex(backend: LLGuidanceBackend, hf_tokenizer: Any, pattern: str, good: str, bad: str) -> None:
    grammar = backend.compile_regex(pattern)
    assert re.fullmatch(pattern, walk(backend, grammar, hf_tokenizer))
    assert accepts(grammar, hf_tokenizer, good) and not accepts(grammar, hf_tokenizer, bad)


def test_choice(backend: LLGuidanceBackend, hf_tokenizer: Any, bitmask: torch.Tensor) -> None:
    choices = ['say "hi"', "back\\slash", "é", "ab", "abc"]
    grammar = backend.compile_choice(choices)
    for seed in range(3):
        assert walk(backend, grammar, hf_tokenizer, seed) in choices
    assert all(accepts(grammar, hf_tokenizer, c) for c in choices)
    assert not accepts(grammar, hf_tokenizer, "a")
    backend.fill([new_matcher(grammar)], bitmask, [0])
    assert STOP not in allowed(bitmask)
    with pytest.raises(GrammarError, match="non-empty list of strings"):
        backend.compile_choice([])


def test_lark_and_ebnf(backend: LLGuidanceBackend, hf_tokenizer: Any) -> None:
    lark = backend.compile_lark('start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/')
    ebnf = backend.compile_ebnf('root ::= "(" num ("," num)* ")"\nnum ::= [0-9]{1,3}')
    for grammar in (lark, ebnf):
        assert re.fullmatch(r"\(\d{1,3}(,\d{1,3})*\)", walk(backend, grammar, hf_tokenizer))
        assert accepts(grammar, hf_tokenizer, "(1,22,333)") and not accepts(grammar, hf_tokenizer, "(1,2222)")
    with pytest.raises(GrammarError, match="GBNF"):  # xgrammar's look-ahead is not GBNF
        backend.compile_ebnf('root ::= "a" (= "b") "b"')
    with pytest.raises(GrammarError, match="unknown name"):
        backend.compile_lark("start: missing")


def test_bounded_string_refuses_raw_tab(backend: LLGuidanceBackend, hf_tokenizer: Any, compiler: Any) -> None:
    schema = {"type": "string", "maxLength": 16}  # any bound: 255 as well, but that takes xgrammar seconds
    xmatcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))
    assert xmatcher.accept_string('"a\tb')  # mlc-ai/xgrammar#800: the bug this backend routes around
    grammar = backend.compile_json_schema(schema, strict=True)
    assert not accepts(grammar, hf_tokenizer, '"a\tb"')
    assert accepts(grammar, hf_tokenizer, '"a\\tb"')


@pytest.mark.parametrize(
    ("schema", "good", "bad"),
    [
        ({"type": "string", "pattern": "^[0-9]+$", "maxLength": 2}, ['"12"', '"7"'], ['"123"', '"1a"', '""']),
        ({"type": "string", "minLength": 3}, ['"abc"'], ['"ab"']),
        ({"type": "integer", "multipleOf": 3}, ["9", "-3", "0"], ["7", "10"]),
        ({"type": "string", "format": "ipv4"}, ['"10.0.0.1"'], ['"300.1.1.1"', '"1.2.3"']),
        ({"type": "string", "format": "date"}, ['"2024-02-29"'], ['"2024-13-01"', '"24-01-01"']),
        ({"type": "integer", "exclusiveMinimum": 0, "maximum": 10}, ["1", "10"], ["0", "11"]),
    ],
)
def test_keywords_enforced(
    backend: LLGuidanceBackend, hf_tokenizer: Any, schema: dict[str, Any], good: list[str], bad: list[str]
) -> None:
    grammar = backend.compile_json_schema(schema, strict=True)
    for text in good:
        assert accepts(grammar, hf_tokenizer, text), text
        jsonschema.validate(json.loads(text), schema)
    for text in bad:
        assert not accepts(grammar, hf_tokenizer, text), text


def test_strict_closes_objects_like_xgrammar(backend: LLGuidanceBackend, hf_tokenizer: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    extra = '{"a": 1, "c": 2}'
    assert not accepts(backend.compile_json_schema(schema, strict=True), hf_tokenizer, extra)
    assert accepts(backend.compile_json_schema(schema, strict=False), hf_tokenizer, extra)
    # allOf members are intersected: closing either would refuse what the other declares
    merged = {"allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "integer"}}}]}
    assert accepts(backend.compile_json_schema(merged, strict=True), hf_tokenizer, '{"a": 1, "b": 2}')
    items = {"type": "array", "prefixItems": [{"type": "integer"}]}
    assert not accepts(backend.compile_json_schema(items, strict=True), hf_tokenizer, "[1, 2]")


def test_invalid_schema_is_our_error(backend: LLGuidanceBackend) -> None:
    for schema, message in [
        ({"type": "strin"}, "Invalid type: strin"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "Unsatisfiable"),
        ({"type": "string", "pattern": "[a-"}, "unclosed character class"),
        ({"$ref": "#/nowhere"}, "does not exist"),
        (False, "allows no value"),
    ]:
        with pytest.raises(GrammarError, match=message) as info:
            backend.compile_json_schema(schema, strict=True, field="response_format")
        assert info.type is GrammarError and info.value.status == 400 and info.value.field == "response_format"
        assert str(info.value).startswith("could not compile the json_schema: ") and ".rs:" not in str(info.value)


def test_strict_refuses_unsupported_keywords(backend: LLGuidanceBackend) -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "array", "uniqueItems": True}, "b": {"not": {}}, "c": {"format": "idn-email"}},
    }
    with pytest.raises(UnsupportedSchemaError, match="strict: false") as info:
        backend.compile_json_schema(schema, strict=True)
    assert sorted(info.value.keywords) == ["format (idn-email)", "not", "uniqueItems"]
    overlapping = {"oneOf": [{"type": "integer"}, {"type": "number"}]}
    with pytest.raises(UnsupportedSchemaError) as info:
        backend.compile_json_schema(overlapping, strict=True)
    assert info.value.keywords == ["oneOf (branches that may overlap)"]
    lenient = backend.compile_json_schema(schema, strict=False)
    assert lenient.warnings and all("Unimplemented" in w or "format" in w for w in lenient.warnings)
    # what llguidance cannot even approximate is refused either way (the caller may try xgrammar)
    overlapping_maps = {"type": "object", "patternProperties": {"^a": {"type": "integer"}, "b$": {"type": "string"}}}
    look_around = {"type": "string", "pattern": "^(?!x)"}
    for schema, keyword in [
        (overlapping_maps, "patternProperties (overlapping patterns)"),
        (look_around, "look-around"),
    ]:
        for strict in (True, False):
            with pytest.raises(UnsupportedSchemaError) as info:
                backend.compile_json_schema(schema, strict=strict)
            assert any(keyword in k for k in info.value.keywords), info.value.keywords
    # an unsupported keyword and an invalid schema: the invalid schema is what the client hears about
    with pytest.raises(GrammarError, match="Invalid type") as error:
        backend.compile_json_schema({"type": "strin", "uniqueItems": True}, strict=True)
    assert error.type is GrammarError


def test_termination_like_xgrammar(backend: LLGuidanceBackend, hf_tokenizer: Any, bitmask: torch.Tensor) -> None:
    matcher = new_matcher(backend.compile_regex("[0-9]{1,3}"))
    backend.fill([matcher], bitmask, [0])
    assert STOP not in allowed(bitmask) and not matcher.accept_token(STOP)
    letter, digit = encode(hf_tokenizer, "a")[0], encode(hf_tokenizer, "1")[0]
    assert not matcher.accept_token(letter) and matcher.accept_token(digit)  # a refusal changes nothing
    assert matcher.accept_token(digit) and matcher.can_terminate()
    backend.fill([matcher], bitmask, [0])
    assert {STOP, digit} <= allowed(bitmask)
    assert matcher.accept_token(digit)
    backend.fill([matcher], bitmask, [0])
    assert allowed(bitmask) == {STOP}  # nothing can follow "111" but the stop token
    assert not matcher.is_terminated() and matcher.accept_token(STOP) and matcher.is_terminated()
    assert not matcher.accept_token(digit) and not matcher.accept_token(STOP)
    assert not matcher.accept_token(backend.vocab_size) and not matcher.accept_token(-1)


def test_replay_and_batch(backend: LLGuidanceBackend, hf_tokenizer: Any, bitmask: torch.Tensor) -> None:
    grammar = backend.compile_json_schema(SCHEMA, strict=True)
    prefix = encode(hf_tokenizer, '{"name": "ab", "tags": ["red"')
    replayed, stepped = new_matcher(grammar, prefix), new_matcher(grammar)
    assert batch_accept([stepped] * len(prefix), prefix) == [True] * len(prefix)
    bitmask.fill_(-1)
    backend.fill([replayed, stepped], bitmask, [2, 0])
    assert torch.equal(bitmask[0], bitmask[2]) and allowed(bitmask, 0) and bitmask[1].eq(-1).all()
    with pytest.raises(ValueError, match="position 2"):
        new_matcher(grammar, [*prefix[:2], encode(hf_tokenizer, "}")[0]])
    fresh = new_matcher(grammar)
    brace, letter = encode(hf_tokenizer, "{")[0], encode(hf_tokenizer, "x")[0]
    assert batch_accept([fresh, stepped], [letter, letter]) == [False, False]
    assert batch_accept([fresh], [brace]) == [True]
    assert isinstance(fresh, LLGuidanceMatcher)


def test_replay_of_a_costly_pattern(backend: LLGuidanceBackend, hf_tokenizer: Any) -> None:
    # a word-count pattern under maxLength builds many lexer states: with llguidance's default fuel a
    # replay (no masks) ran the lexer dry and refused valid text; and matchers must not share a lexer
    schema = {"type": "string", "pattern": r"^(?:\S+\s+){0,29}\S+$", "maxLength": 500}
    grammar = backend.compile_json_schema(schema, strict=True)
    for _ in range(2):
        assert new_matcher(grammar, encode(hf_tokenizer, json.dumps(" ".join(["word"] * 30)))).accept_token(STOP)
    with pytest.raises(ValueError, match="rejected"):
        new_matcher(grammar, encode(hf_tokenizer, json.dumps(" ".join(["word"] * 31))))


def test_fill_checks_the_bitmask(backend: LLGuidanceBackend) -> None:
    matcher = new_matcher(backend.compile_regex("a"))
    with pytest.raises(ValueError, match="rows"):
        backend.fill([matcher], xgr.allocate_token_bitmask(1, backend.vocab_size + 64), [0])
    with pytest.raises(ValueError, match="inside"):
        backend.fill([matcher], xgr.allocate_token_bitmask(1, backend.vocab_size), [1])
    with pytest.raises(ValueError, match="Invalid buffer size"):  # the engine's filler: llguidance checks
        BitmaskFiller().fill([matcher], xgr.allocate_token_bitmask(1, backend.vocab_size + 64), [0])


def test_bitmask_layout_matches_xgrammar(
    backend: LLGuidanceBackend, hf_tokenizer: Any, compiler: Any, bitmask: torch.Tensor
) -> None:
    matcher = new_matcher(backend.compile_json_schema(SIMPLE, strict=True))
    xmatcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SIMPLE), any_whitespace=False))
    backend.fill([matcher], bitmask, [0])
    xmatcher.fill_next_token_bitmask(bitmask, 1)
    ll_ids, xg_ids = allowed(bitmask, 0), allowed(bitmask, 1)
    # the forced text is '{"a": ': llguidance allows only its canonical first token, xgrammar also '{'
    open_quote = encode(hf_tokenizer, '{"')
    assert ll_ids == set(open_quote) and ll_ids < xg_ids and xg_ids - ll_ids == set(encode(hf_tokenizer, "{"))
    for token in encode(hf_tokenizer, '{"a": '):
        assert matcher.accept_token(token) and xmatcher.accept_token(token)
    backend.fill([matcher], bitmask, [0])
    xmatcher.fill_next_token_bitmask(bitmask, 1)
    assert torch.equal(bitmask[0], bitmask[1])  # the same words, bit for bit: digits and '-'
    assert {hf_tokenizer.decode([t]) for t in allowed(bitmask, 0)} == set("-0123456789")


def first_token_accepted(backend: LLGuidanceBackend, grammar: LLGrammar, seed: int) -> bool:
    """Whether the matcher takes a token its first mask allows (a seeded pick, never the stop token)."""
    matcher = new_matcher(grammar)
    bitmask = xgr.allocate_token_bitmask(1, backend.vocab_size)
    backend.fill([matcher], bitmask, [0])
    token = random.Random(seed).choice(sorted(allowed(bitmask) - {STOP}))
    return matcher.accept_token(token) and matcher.error() is None


def test_a_long_choice_list_takes_what_its_mask_allows(backend: LLGuidanceBackend, hf_tokenizer: Any) -> None:
    # one parser alternative per choice overflowed llguidance's row of 2,000 items on the first token
    rng = random.Random(0)
    choices = [f"c{rng.randrange(10**9)}-{i}" for i in range(2_000)]
    grammar = backend.compile_choice(choices)
    assert first_token_accepted(backend, grammar, 0)
    assert walk(backend, grammar, hf_tokenizer, 1) in choices
    assert accepts(backend.compile_choice(["", "a"]), hf_tokenizer, "")


def test_many_optional_properties_take_what_their_mask_allows(backend: LLGuidanceBackend) -> None:
    # 600 optional properties made a parser row of 2,399 items (the cap was 2,000)
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}
    grammar = backend.compile_json_schema(schema, strict=True)
    assert all(first_token_accepted(backend, grammar, seed) for seed in range(2))


def test_a_matcher_past_a_limit_says_why(backend: LLGuidanceBackend) -> None:
    # a parser row over its cap: the mask allows the token, the matcher gives up for good, and says so
    grammar = backend.compile_lark("start: " + " | ".join(f'"x{i}"' for i in range(20)))
    matcher = new_matcher(dataclasses.replace(grammar, limits=llguidance.LLParserLimits(max_items_in_row=10)))
    assert matcher.error() is None
    assert not matcher.accept_token(grammar.tokenizer.tokenize_str("x")[0])
    assert "max is 10" in str(matcher.error())


def test_the_tokenizer_built_from_its_json_is_the_librarys_and_a_padded_one_is_left_alone(
    backend: LLGuidanceBackend, hf_tokenizer: Any, tokenizer_info: Any
) -> None:
    """The backend builds llguidance's tokenizer from the Hugging Face tokenizer's JSON without the
    library's copy: it tokenizes and masks as the library's own does, and a tokenizer that pads goes
    through the library, which leaves its padding as it was."""
    stops = list(tokenizer_info.stop_token_ids)
    library = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=tokenizer_info.vocab_size, eos_token=stops)
    ours = backend.tokenizer
    assert (ours.vocab_size, ours.eos_token) == (library.vocab_size, library.eos_token)
    for text in ("Describe the image.", '{"name": "été", "n": 12}', "  \t\n<s>[INST]", "日本語のテキスト"):
        data = text.encode()
        assert ours.tokenize_bytes(data) == library.tokenize_bytes(data)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    masks = [llguidance.LLMatcher(tok, grammar, log_level=0).compute_bitmask() for tok in (ours, library)]
    assert masks[0] == masks[1]

    padded = copy.deepcopy(hf_tokenizer)
    padded.backend_tokenizer.enable_padding(length=8)
    other = LLGuidanceBackend(padded, vocab_size=tokenizer_info.vocab_size, stop_token_ids=stops)
    assert padded.backend_tokenizer.padding is not None  # the library's copy was padded off, not ours
    assert other.tokenizer.tokenize_bytes(b"Describe.") == library.tokenize_bytes(b"Describe.")
