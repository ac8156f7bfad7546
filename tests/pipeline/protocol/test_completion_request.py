"""Completions admission: each bad prompt is named by its index."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.errors import InvalidRequest
from pipeline.protocol.completion_request import MAX_PROMPTS, parse_completion_request


@pytest.mark.parametrize(
    ("prompt", "field"),
    [
        (["a"] * (MAX_PROMPTS - 1) + [3], f"prompt[{MAX_PROMPTS - 1}]"),
        ([[1]] * (MAX_PROMPTS - 1) + ["x"], f"prompt[{MAX_PROMPTS - 1}]"),
        ([1, "a"], "prompt[1]"),
        (["a", [], "b"], "prompt[1]"),
        (["a"] * (MAX_PROMPTS + 1), "prompt"),
        ([[1], []], "prompt[1]"),
    ],
)
def test_a_bad_prompt_is_named_by_its_index(prompt: Any, field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_completion_request({"prompt": prompt, "max_tokens": 2})
    assert (info.value.status, info.value.field) == (400, field)


@pytest.mark.parametrize(
    ("prompt", "field"),
    [
        ([1, 2, -5], "prompt[2]"),
        ([1, 1 << 64], "prompt[1]"),
        ([[1, 2], [3, 100]], "prompt[1][1]"),
        ([[1], [2], [3, 4, -1]], "prompt[2][2]"),
    ],
)
def test_a_token_id_out_of_the_vocabulary_is_named_by_its_place(prompt: Any, field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_completion_request({"prompt": prompt, "max_tokens": 2}, vocab_size=100)
    assert (info.value.status, info.value.field) == (400, field)
    assert "[0, 100)" in info.value.message


def test_token_ids_inside_the_vocabulary_pass() -> None:
    requests = parse_completion_request({"prompt": [[0, 99], [5]], "max_tokens": 2}, vocab_size=100)
    assert [r.prompt for r in requests] == [[0, 99], [5]]
