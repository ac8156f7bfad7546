"""A rendered prompt of control tokens alone, from a conversation that had text, is a 400."""

from __future__ import annotations

import pytest

from pipeline.errors import InvalidRequest
from pipeline.types import Message, TextPart
from stages.prompt_content import check_prompt_has_content, special_token_ids

SPECIAL = frozenset({1, 3, 4})  # <s>, [INST], [/INST]


def conversation(*turns: tuple[str, str]) -> tuple[Message, ...]:
    return tuple(Message(role=role, parts=(TextPart(text),)) for role, text in turns)


def test_a_template_that_wrote_none_of_the_text_is_refused() -> None:
    with pytest.raises(InvalidRequest) as info:
        check_prompt_has_content([1], SPECIAL, conversation(("system", "Be brief.")))
    assert info.value.field == "messages" and "roles: system" in info.value.message


def test_prompts_with_text_and_conversations_without_text_pass() -> None:
    check_prompt_has_content([1, 3, 1083, 4], SPECIAL, conversation(("system", "S"), ("user", "hi")))
    check_prompt_has_content([1, 3, 4], SPECIAL, conversation(("user", "")))  # an empty message, rendered
    check_prompt_has_content([1, 3, 4], SPECIAL, conversation(("user", "  \n")))


def test_special_ids_are_the_added_tokens_marked_special() -> None:
    class Added:
        def __init__(self, special: bool) -> None:
            self.special = special

    class Tokenizer:
        added_tokens_decoder = {0: Added(True), 5: Added(False), 7: Added(True)}

    assert special_token_ids(Tokenizer()) == {0, 7}
    assert special_token_ids(object()) == frozenset()
