"""CallSplit: the calls open where the answer's text says, however the text is chunked."""

from __future__ import annotations

import pytest

from pipeline.answer.call_split import CallSplit

HERMES = 'Let me see <tool_call>{"name": "f", "arguments": {}}</tool_call>'


def _split(marker: str, chunks: list[str]) -> tuple[list[str], str]:
    split = CallSplit(marker)
    contents, call = [], ""
    for i, chunk in enumerate(chunks):
        content, more = split.feed(chunk, i == len(chunks) - 1)
        contents.append(content)
        call += more
    return contents, call


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, len(HERMES)])
def test_the_marker_opens_the_calls_in_any_chunks(size: int) -> None:
    chunks = [HERMES[i : i + size] for i in range(0, len(HERMES), size)]
    contents, call = _split("<tool_call>", chunks)
    assert "".join(contents) == "Let me see "
    assert call == '{"name": "f", "arguments": {}}</tool_call>'
    # no piece of the marker ever went out as content
    assert all("<" not in c for c in contents)


def test_a_held_prefix_that_is_not_the_marker_goes_out_as_content() -> None:
    contents, call = _split("<tool_call>", ["a <to", "ol> b <tool", "_ca"])
    assert contents == ["a ", "<tool> b ", "<tool_ca"]  # the last chunk flushes what was held
    assert call == ""


@pytest.mark.parametrize(
    ("chunks", "content", "call"),
    [
        (["", '{"na', 'me": "f"}'], "", '{"name": "f"}'),
        (["Hi", " {x}"], "Hi {x}", ""),
        ([" ", '{"name"'], ' {"name"', ""),  # the grammar's text branch: it did not open with "{"
    ],
)
def test_without_a_marker_a_call_is_an_answer_that_opens_with_a_brace(
    chunks: list[str], content: str, call: str
) -> None:
    contents, got = _split("", chunks)
    assert "".join(contents) == content
    assert got == call
