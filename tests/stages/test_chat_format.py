"""Content-format detection, the conversation as a template reads it, and prompt truncation.

The Jinja inputs here are single expressions, each the shape one detection rule looks for; whole
templates as their authors ship them are tested in test_real_templates.py.
"""

from __future__ import annotations

from typing import Any

import pytest

import stages.chat_format as chat_format
from pipeline.errors import InvalidRequest
from pipeline.protocol.request import parse_chat_request
from stages.chat_format import ContentFormats, detect_content_format
from stages.chat_messages import image_placeholder_of, to_template_messages
from stages.template_options import template_kwargs, truncate_prompt
from tests.models.checkpoints import build_tokenizer
from vision.image_text import ImageText
from vision.preprocess import ImageTokenIds

IMG = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


@pytest.mark.parametrize(
    "source",
    [
        "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}",
        "{% set rest = messages[1:] %}{% for m in rest %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
        "{{ messages[0]['content'][0]['text'] }}",
        "{% for m in messages %}{{ m['content'] | selectattr('type', 'equalto', 'text') | join }}{% endfor %}",
        "{% for m in messages %}{% set c = m['content'] %}{% for p in c %}{{ p }}{% endfor %}{% endfor %}",
        "{% for m in messages %}{% for p in m['content'] | sort(attribute='type') %}{{ p }}{% endfor %}{% endfor %}",
    ],
    ids=["loop", "renamed-list", "indexed-part", "filtered-parts", "renamed-content", "sorted-parts"],
)
def test_reading_parts_is_the_openai_format(source: str) -> None:
    assert detect_content_format(source) == "openai"


@pytest.mark.parametrize(
    "source",
    [
        "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] | trim }}{% endfor %}",
        "{% for m in messages %}{% for line in m.content.split('\\n') %}{{ line }}{% endfor %}{% endfor %}",
        "{% for m in messages %}{% if m.content is string %}{{ m.content[0] }}{% endif %}{% endfor %}",
        "{% for tool in tools %}{% for p in tool['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}",
    ],
    ids=["concatenated", "split-lines", "first-character", "not-a-message"],
)
def test_text_use_is_the_string_format(source: str) -> None:
    assert detect_content_format(source) == "string"


def test_a_template_that_does_not_parse_is_refused() -> None:
    with pytest.raises(ValueError, match="not valid Jinja"):
        detect_content_format("{% for m in messages %}")
    assert ContentFormats("string").of("{% for m in messages %}") == "string"  # a forced format reads nothing


def test_formats_are_detected_once_per_template_within_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def counting(template: str) -> str:
        seen.append(template)
        return "openai"

    monkeypatch.setattr(chat_format, "detect_content_format", counting)
    formats = ContentFormats(max_templates=2)
    for template in ["a", "a", "b", "a", "c", "b"]:
        assert formats.of(template) == "openai"
    assert seen == ["a", "b", "c", "b"]  # "b" was the least recently used when "c" came
    assert formats.of(None) == "string"  # no template: vLLM gives it strings
    with pytest.raises(ValueError, match="content format must be one of"):
        ContentFormats("parts")


def test_a_string_template_gets_each_message_as_one_string() -> None:
    request = parse_chat_request(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "first"}, IMG, {"type": "text", "text": "last"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
            ],
            "add_generation_prompt": False,
        }
    )
    assert to_template_messages(request.messages, "string", "[IMG]") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first\n[IMG]\nlast"},
        {"role": "assistant", "content": "ok"},
    ]
    assert to_template_messages(request.messages, "openai")[1]["content"] == [
        {"type": "text", "text": "first"},
        {"type": "image"},
        {"type": "text", "text": "last"},
    ]
    with pytest.raises(InvalidRequest) as info:
        to_template_messages(request.messages, "string", None)
    assert info.value.field == "messages[1].content" and "image" in info.value.message


@pytest.mark.parametrize("content_format", ["string", "openai"])
def test_calls_and_results_are_as_templates_take_them(content_format: Any) -> None:
    call = {"id": "abc123def", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    odd = {"id": "zyx987wvu", "type": "function", "function": {"name": "g", "arguments": "not json"}}
    request = parse_chat_request(
        {
            "messages": [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": None, "tool_calls": [call, odd]},
                {"role": "tool", "tool_call_id": "abc123def", "content": [{"type": "text", "text": "done"}]},
            ]
        }
    )
    _, calls, result = to_template_messages(request.messages, content_format)
    assert calls == {
        "role": "assistant",
        "content": None,  # no text: transformers leaves the key out, as the client did
        "tool_calls": [
            {"id": "abc123def", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
            {"id": "zyx987wvu", "type": "function", "function": {"name": "g", "arguments": "not json"}},
        ],
    }
    assert result == {"role": "tool", "content": "done", "tool_call_id": "abc123def"}


def test_the_image_placeholder_is_what_the_models_template_writes(hf_tokenizer: Any) -> None:
    assert image_placeholder_of(hf_tokenizer, ImageTokenIds.from_tokenizer(hf_tokenizer, 10), None) == "[IMG]"
    assert image_placeholder_of(hf_tokenizer, None, None) is None
    gemma = ImageText("<start_of_image>", 5, "\n\n<start_of_image><image_soft_token><end_of_image>\n\n", 1)
    assert image_placeholder_of(hf_tokenizer, ImageTokenIds(6, None, None), gemma) == "<start_of_image>"
    specials = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
    qwen = build_tokenizer(specials, chat_template="", bos=None, eos="<|im_end|>")
    pad = ImageTokenIds(qwen.convert_tokens_to_ids("<|image_pad|>"), None, None)
    assert image_placeholder_of(qwen, pad, None) == "<|vision_start|><|image_pad|><|vision_end|>"


def test_template_variables_may_not_replace_the_calls_own_arguments() -> None:
    assert template_kwargs({"enable_thinking": False}, {"messages"}) == {"enable_thinking": False}
    with pytest.raises(InvalidRequest) as info:
        template_kwargs({"enable_thinking": False, "messages": []}, {"messages"})
    assert info.value.field == "chat_template_kwargs.messages"


def test_truncation_keeps_the_last_tokens_and_whole_images() -> None:
    ids = [1, 2, 3, 9, 7, 7, 8, 4, 5]  # 9: an image's opening marker, 7: its image tokens, 8: its end
    spans = {7, 8, 9}
    assert truncate_prompt(ids, None, 100, 7, spans) == ids
    assert truncate_prompt(ids, 100, 100, 7, spans) == ids
    assert truncate_prompt(ids, 6, 100, 7, spans) == [9, 7, 7, 8, 4, 5]
    assert truncate_prompt(ids, -1, 7, 7, spans) == [3, 9, 7, 7, 8, 4, 5]  # -1: as many as a prompt may hold
    assert truncate_prompt(ids, 2, 100, None, set()) == [4, 5]  # a model without images
    for keep, max_tokens in [(5, 100), (2, 100), (-1, 4), (0, 100), (-2, 100)]:
        with pytest.raises(InvalidRequest) as info:
            truncate_prompt(ids, keep, max_tokens, 7, spans)
        assert info.value.field == "truncate_prompt_tokens"
    with pytest.raises(InvalidRequest, match="image's span starts 6 tokens from the end"):
        truncate_prompt(ids, 5, 100, 7, spans)  # between the marker and its image tokens
