from __future__ import annotations

from typing import Any

import pytest
import torch

from pipeline.errors import InvalidRequest, PromptTooLong
from pipeline.protocol.request import parse_chat_request
from pipeline.types import TemplateOptions
from stages.template import TemplateStage
from vision.preprocess import ImageTokenIds, PreparedImage, expand_image_tokens


def image(rows: int, cols: int) -> PreparedImage:
    return PreparedImage(torch.zeros(3, rows * 16, cols * 16), (1, rows, cols))


@pytest.fixture
def stage(hf_tokenizer: Any) -> TemplateStage:
    return TemplateStage(hf_tokenizer, ImageTokenIds.from_tokenizer(hf_tokenizer, 10), max_prompt_tokens=200, threads=1)


IMG = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


async def test_multi_turn_with_system_and_two_images(stage: TemplateStage, hf_tokenizer: Any) -> None:
    request = parse_chat_request(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "first"}, IMG]},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": [IMG, {"type": "text", "text": "second"}]},
            ]
        }
    )
    ids = await stage.run(request.messages, [image(2, 3), image(1, 2)])
    text = hf_tokenizer.decode(ids)
    assert text.startswith("<s>") and "Be brief." in text and text.index("first") < text.index("second")
    assert ids.count(10) == 2 * 3 + 1 * 2
    # layout: rows of [IMG] closed by [IMG_BREAK], the last row of an image closed by [IMG_END]
    assert ids.count(12) == 1 + 0 and ids.count(13) == 2
    first = ids.index(10)
    assert ids[first : first + 8] == [10, 10, 10, 12, 10, 10, 10, 13]


async def test_prompt_length_cap(stage: TemplateStage) -> None:
    request = parse_chat_request({"messages": [{"role": "user", "content": "word " * 300}]})
    with pytest.raises(PromptTooLong) as info:
        await stage.run(request.messages, [])
    assert info.value.status == 400 and "200" in info.value.message


@pytest.mark.parametrize("raw", [False, True], ids=["messages", "prompt"])
async def test_a_text_no_prompt_could_hold_is_refused_untokenized(
    stage: TemplateStage, hf_tokenizer: Any, monkeypatch: pytest.MonkeyPatch, raw: bool
) -> None:
    # no token writes more characters than the longest vocabulary entry; 4x room for a normalizer
    bound = 200 * max(map(len, hf_tokenizer.get_vocab())) * 4
    text = "a" * (bound + 1)
    messages = () if raw else parse_chat_request({"messages": [{"role": "user", "content": text}]}).messages

    def encode(*args: Any, **kwargs: Any) -> list[int]:
        raise AssertionError("tokenized")

    monkeypatch.setattr(hf_tokenizer, "encode", encode)
    with pytest.raises(PromptTooLong) as info:
        await stage.run(messages, [], prompt=text if raw else None)
    assert info.value.field == ("prompt" if raw else "messages") and "characters" in info.value.message
    monkeypatch.undo()
    # under the bound, the text is tokenized and its tokens counted
    with pytest.raises(PromptTooLong) as info:
        await stage.run((), [], prompt="a" * (bound // 2))
    assert "characters" not in info.value.message and "tokens; at most 200" in info.value.message


async def test_placeholder_count_must_match(stage: TemplateStage, hf_tokenizer: Any) -> None:
    """Typed "[IMG]" is text; where control tokens are allowed it is the image token, with no image for it."""
    request = parse_chat_request({"messages": [{"role": "user", "content": "sneaky [IMG] text"}]})
    assert 10 not in await stage.run(request.messages, [])
    layout = ImageTokenIds.from_tokenizer(hf_tokenizer, 10)
    allowed = TemplateStage(hf_tokenizer, layout, max_prompt_tokens=200, threads=1, sanitize_control_tokens=False)
    with pytest.raises(InvalidRequest) as info:
        await allowed.run(request.messages, [])
    assert info.type is InvalidRequest and info.value.field == "messages"
    assert allowed.limiter.borrowed_tokens == 0


async def test_tools_calls_and_results_render_in_the_mistral_format(stage: TemplateStage, hf_tokenizer: Any) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    call = {"id": "call_long_id_from_elsewhere", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    request = parse_chat_request(
        {
            "messages": [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": "done"},
            ],
            "tools": [tool],
        }
    )
    assert request.tools is not None and request.tools.mode == "auto"
    stage.max_prompt_tokens = 1000
    text = hf_tokenizer.decode(await stage.run(request.messages, [], request.tools.tools))
    assert text.index("[AVAILABLE_TOOLS]") < text.index("[INST]go[/INST]") < text.index("[TOOL_CALLS]")
    call_id = request.messages[1].tool_calls[0][0]
    assert len(call_id) == 9 and request.messages[2].tool_call_id == call_id  # the call and its result still match
    assert f'{{"name": "f", "arguments": {{"a": 1}}, "id": "{call_id}"}}' in text
    assert f'[TOOL_RESULTS]{{"content": "done", "call_id": "{call_id}"}}[/TOOL_RESULTS]' in text
    assert stage.marker_token("[TOOL_CALLS]") == 9


async def test_raw_prompts_skip_the_template(stage: TemplateStage, hf_tokenizer: Any) -> None:
    assert await stage.run((), [], prompt=[1, 2000, 3000]) == [1, 2000, 3000]
    assert await stage.run((), [], prompt="hello") == [1, *hf_tokenizer.encode("hello", add_special_tokens=False)]
    assert await stage.run((), [], prompt="") == [1]  # never an empty prompt
    with pytest.raises(InvalidRequest) as info:
        await stage.run((), [], prompt=[1, 10**9])
    assert info.type is InvalidRequest and info.value.field == "prompt"


async def test_a_string_format_template_gets_each_image_as_its_placeholder(hf_tokenizer: Any) -> None:
    """Forced to strings, the Pixtral template gets "[IMG]" inside the message's text, expanded as the
    template's own [IMG] is."""
    layout = ImageTokenIds.from_tokenizer(hf_tokenizer, 10)
    stage = TemplateStage(hf_tokenizer, layout, max_prompt_tokens=200, threads=1, content_format="string")
    assert stage.content_format == "string" and stage.image_placeholder == "[IMG]"
    content = [{"type": "text", "text": "first"}, IMG, {"type": "text", "text": "second"}]
    request = parse_chat_request({"messages": [{"role": "user", "content": content}]})
    images = [image(2, 3)]
    text = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "first\n[IMG]\nsecond"}], tokenize=False, add_generation_prompt=True
    )
    expected = expand_image_tokens(hf_tokenizer.encode(text, add_special_tokens=False), images, layout)
    assert await stage.run(request.messages, images) == expected
    assert expected.count(10) == 6


async def test_truncation_never_cuts_an_image(stage: TemplateStage) -> None:
    request = parse_chat_request(
        {"messages": [{"role": "user", "content": [IMG, {"type": "text", "text": "describe it in a few words"}]}]}
    )
    images = [image(2, 3)]
    full = await stage.run(request.messages, images)
    after = len(full) - (full.index(13) + 1)  # the tokens after the image's [IMG_END]
    kept = await stage.run(request.messages, images, options=TemplateOptions(truncate_prompt_tokens=after + 8))
    assert kept == full[-(after + 8) :] and kept.count(10) == 6
    with pytest.raises(InvalidRequest) as info:
        await stage.run(request.messages, images, options=TemplateOptions(truncate_prompt_tokens=after + 3))
    assert info.value.field == "truncate_prompt_tokens" and f"starts {after + 8} tokens from the end" in str(info.value)
    assert stage.limiter.borrowed_tokens == 0
