"""Structural tags whose text is a special token (Qwen's ``<tool_call>`` and ``</tool_call>``) under
llguidance: the tag takes the token the tokenizer writes, its mask allows exactly what its matcher
accepts, and the answer check accepts the text."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from sampling.guided.llguidance.backend import LLGuidanceBackend
from sampling.guided.llguidance.matcher import LLGrammar, new_matcher
from sampling.guided.llguidance.tags import NotTranslatable, structural_tag_to_lark
from tests.models.tool_requests import WEATHER, FamilyDir

CALL = {"type": "json_schema", "json_schema": WEATHER}
TEXT = 'Let me look. <tool_call>{"city": "Oslo", "days": 3}</tool_call> Done.'
TAGS: list[dict[str, Any]] = [
    # a trigger and an end that are special tokens, free text around them
    {
        "type": "triggered_tags",
        "triggers": ["<tool_call>"],
        "tags": [{"type": "tag", "begin": "<tool_call>", "content": CALL, "end": "</tool_call>"}],
    },
    # the same as a plain sequence of text, a tag and text
    {
        "type": "sequence",
        "elements": [
            {"type": "const_string", "value": "Let me look. "},
            {"type": "tag", "begin": "<tool_call>", "content": CALL, "end": ["</tool_call>"]},
            {"type": "regex", "pattern": " Done\\."},
        ],
    },
]


@pytest.fixture(scope="module")
def qwen3(family_dir: FamilyDir) -> tuple[Any, LLGuidanceBackend]:
    tokenizer = AutoTokenizer.from_pretrained(family_dir("qwen3"))
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return tokenizer, LLGuidanceBackend(tokenizer, vocab_size=len(tokenizer), stop_token_ids=[stop])


def _mask(backend: LLGuidanceBackend, matcher: Any) -> torch.Tensor:
    bitmask = torch.zeros((1, backend.num_words), dtype=torch.int32)
    backend.fill([matcher], bitmask, [0])
    return bitmask[0]


def _allows(mask: torch.Tensor, token: int) -> bool:
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


@pytest.mark.parametrize("fmt", TAGS, ids=["triggered_tags", "sequence"])
def test_special_token_ends_are_the_tokens_the_tokenizer_writes(
    fmt: dict[str, Any], qwen3: tuple[Any, LLGuidanceBackend]
) -> None:
    tokenizer, backend = qwen3
    grammar: LLGrammar = backend.compile_structural_tag({"type": "structural_tag", "format": fmt})
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    specials = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    assert set(specials) <= set(tokens)  # the tokenizer writes each tag as its one token
    matcher = new_matcher(grammar)
    for i, token in enumerate(tokens):
        mask = _mask(backend, matcher)
        assert _allows(mask, token), (i, token)
        assert matcher.accept_token(token), (i, token)  # what the mask allows, the matcher takes
    assert matcher.can_terminate()
    assert backend.acceptor(grammar)(TEXT)
    assert not backend.acceptor(grammar)(TEXT.replace("3}", "9}"))  # days above the schema's maximum


def test_a_special_end_is_one_token_not_its_text(qwen3: tuple[Any, LLGuidanceBackend]) -> None:
    """After the call, the mask allows the end token, never a start of its text spelled in pieces."""
    tokenizer, backend = qwen3
    grammar = backend.compile_structural_tag({"type": "structural_tag", "format": TAGS[1]})
    matcher = new_matcher(grammar)
    for token in tokenizer.encode('Let me look. <tool_call>{"city": "Oslo", "days": 3}', add_special_tokens=False):
        assert matcher.accept_token(token)
    mask = _mask(backend, matcher)
    assert not _allows(mask, tokenizer.convert_tokens_to_ids("<"))
    end = tokenizer.convert_tokens_to_ids("</tool_call>")
    assert _allows(mask, end) and matcher.accept_token(end)


def test_a_trigger_that_ends_inside_a_special_token_is_not_translated() -> None:
    """``<tool`` triggers a tag that begins with the special token ``<tool_call>``: llguidance would
    take only the text spelled in pieces, never the token the model writes, so the tag stays xgrammar's."""
    fmt = {
        "type": "triggered_tags",
        "triggers": ["<tool"],
        "tags": [{"type": "tag", "begin": "<tool_call>", "content": CALL, "end": "</tool_call>"}],
    }
    specials = {"<tool_call>": 3, "</tool_call>": 4}
    with pytest.raises(NotTranslatable, match="inside a special token"):
        structural_tag_to_lark({"type": "structural_tag", "format": fmt}, specials)
    whole = {**fmt, "triggers": ["<tool_call>"]}
    assert "<[3]>" in structural_tag_to_lark({"type": "structural_tag", "format": whole}, specials)
