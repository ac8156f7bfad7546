"""Chat templates as their authors ship them (tests/data/chat_templates, sources in its SOURCES.md),
rendered through the template stage and compared, token for token, with transformers'
``apply_chat_template`` on the same conversation.

Each template is set as the chat template of a small BPE tokenizer with its family's special tokens
(both sides tokenize the same text, so any vocabulary compares fairly); ``bos_token``,
``eos_token``, ``raise_exception`` and ``strftime_now`` reach the template as transformers gives them.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
import pytest

from pipeline.errors import InvalidRequest
from pipeline.protocol.request import parse_chat_request
from pipeline.types import TemplateOptions
from stages.chat_format import detect_content_format
from stages.template import TemplateStage
from tests.models.checkpoints import build_tokenizer

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"


@dataclass(frozen=True)
class Family:
    specials: tuple[str, ...]
    bos: str | None
    eos: str
    unk: str | None = None


CHATML = Family(("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>"), None, "<|im_end|>")
QWEN_VL = Family((*CHATML.specials, "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"), None, "<|im_end|>")
HERMES = Family((*CHATML.specials, "<|begin_of_text|>"), "<|begin_of_text|>", "<|im_end|>")
LLAMA3 = Family(
    (
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|python_tag|>",
        "<|image|>",
    ),
    "<|begin_of_text|>",
    "<|eot_id|>",
)
LLAMA4 = Family(
    ("<|begin_of_text|>", "<|header_start|>", "<|header_end|>", "<|eot|>", "<|python_start|>", "<|python_end|>"),
    "<|begin_of_text|>",
    "<|eot|>",
)
GRANITE = Family(("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"), None, "<|end_of_text|>")
DEEPSEEK = Family(
    ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"),
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
)
PHI = Family(("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"), None, "<|endoftext|>")
ZEPHYR = Family(("<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"), "<s>", "</s>", unk="<unk>")
MISTRAL = Family(
    (
        "<unk>",
        "<s>",
        "</s>",
        "[INST]",
        "[/INST]",
        "[AVAILABLE_TOOLS]",
        "[/AVAILABLE_TOOLS]",
        "[TOOL_CALLS]",
        "[TOOL_RESULTS]",
        "[/TOOL_RESULTS]",
        "[SYSTEM_PROMPT]",
        "[/SYSTEM_PROMPT]",
        "[CALL_ID]",
        "[ARGS]",
        "[TOOL_CONTENT]",
    ),
    "<s>",
    "</s>",
    unk="<unk>",
)
GEMMA = Family(("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>"), "<bos>", "<eos>")

# the conversations each template meets (the tool round only where the template takes tools)
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {"id": "abc123def", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "user": [{"role": "user", "content": "What is the capital of France?"}],
    "system": [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    "turns": [
        {"role": "user", "content": "Hello there!"},
        {"role": "assistant", "content": "Hello. How can I help you today?"},
        {"role": "user", "content": "Name a colour."},
    ],
    # the assistant's turn of calls as clients echo it back: content null, or an empty string
    "tools": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "abc123def", "content": "sunny, 21 C"},
    ],
    "tools-empty": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "abc123def", "content": "sunny, 21 C"},
    ],
}
# the assistant's turn left open for the answer to continue
OPEN_TURN = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital is"},
]


@dataclass(frozen=True)
class Shipped:
    file: str
    family: Family
    content_format: str  # what its author wrote it for
    # the conversations it refuses (transformers' own rendering raises): ours must refuse them too
    refuses: frozenset[str] = field(default_factory=frozenset)


HERMES_REFUSES = frozenset({"user", "system", "turns", "done", "open"})  # the tool-use template, without tools
SHIPPED = [
    Shipped("HuggingFaceTB-SmolLM2-Instruct.jinja", CHATML, "string"),
    Shipped("HuggingFaceH4-zephyr-7b-beta.jinja", ZEPHYR, "string"),
    Shipped("Qwen-Qwen2.5-7B-Instruct.jinja", CHATML, "string"),
    # content null on the calls' turn: the template reads message.content
    Shipped("Qwen-Qwen3-0.6B.jinja", CHATML, "string", frozenset({"tools"})),
    Shipped("meta-llama-Llama-3.1-8B-Instruct.jinja", LLAMA3, "string"),
    Shipped("meta-llama-Llama-3.2-3B-Instruct.jinja", LLAMA3, "string"),
    Shipped("meta-llama-Llama-3.3-70B-Instruct.jinja", LLAMA3, "string"),
    Shipped("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", HERMES, "string", HERMES_REFUSES),
    Shipped("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", HERMES, "string", HERMES_REFUSES),
    Shipped("ibm-granite-granite-3.3-2B-Instruct.jinja", GRANITE, "string", frozenset({"tools"})),
    Shipped("deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", DEEPSEEK, "string"),
    Shipped("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", DEEPSEEK, "string"),
    Shipped("microsoft-Phi-3.5-mini-instruct.jinja", PHI, "string"),
    Shipped("microsoft-Phi-4-mini-instruct.jinja", PHI, "string"),
    Shipped("mistralai-Mistral-7B-Instruct-v0.3.jinja", MISTRAL, "string"),
    Shipped("mistralai-Mistral-Nemo-Instruct-2407.jinja", MISTRAL, "string"),
    Shipped("mistralai-Mistral-Small-3.2-24B-Instruct-2506.jinja", MISTRAL, "openai"),
    Shipped("google-gemma-2-2b-it.jinja", GEMMA, "string", frozenset({"system"})),  # "System role not supported"
    Shipped("google-gemma-3-1b-it.jinja", GEMMA, "openai"),
    Shipped("Qwen-Qwen2.5-VL-7B-Instruct.jinja", QWEN_VL, "openai"),
    Shipped("meta-llama-Llama-3.2-11B-Vision-Instruct.jinja", LLAMA3, "openai"),
    Shipped("meta-llama-Llama-4-Scout-17B-16E-Instruct.jinja", LLAMA4, "openai"),
]
BY_FILE = {s.file: s for s in SHIPPED}


def template_of(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")


@functools.cache
def tokenizer_of(name: str) -> Any:
    family = BY_FILE[name].family
    return build_tokenizer(
        list(family.specials), chat_template=template_of(name), bos=family.bos, eos=family.eos, unk=family.unk
    )


def takes_tools(name: str) -> bool:
    ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template_of(name))
    return "tools" in jinja2.meta.find_undeclared_variables(ast)


def stage_of(name: str, **kwargs: Any) -> TemplateStage:
    return TemplateStage(tokenizer_of(name), None, max_prompt_tokens=4000, threads=1, **kwargs)


def as_sent(conversation: list[dict[str, Any]], content_format: str) -> list[dict[str, Any]]:
    """``conversation`` as the template's format takes it: an openai-format template gets each text
    as one text part; a call's arguments are an object, as templates expect them."""
    out = copy.deepcopy(conversation)
    for message in out:
        if content_format == "openai" and isinstance(message["content"], str) and message["role"] != "tool":
            message["content"] = [{"type": "text", "text": message["content"]}]
        for call in message.get("tool_calls", ()):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


def transformers_ids(name: str, conversation: list[dict[str, Any]], **kwargs: Any) -> list[int] | Exception:
    kwargs = {"add_generation_prompt": True, **kwargs}
    try:
        return list(tokenizer_of(name).apply_chat_template(conversation, tokenize=True, return_dict=False, **kwargs))
    except Exception as exc:  # the template's own refusal (raise_exception) or a type error in it
        return exc


def ours(stage: TemplateStage, body: dict[str, Any], options: TemplateOptions | None = None) -> list[int]:
    request = parse_chat_request(body)
    tools = request.tools.tools if request.tools is not None else ()
    return stage.render(request.messages, [], tools, options=options or request.template)


def assert_same(stage: TemplateStage, body: dict[str, Any], expected: list[int] | Exception) -> None:
    if isinstance(expected, Exception):
        with pytest.raises(InvalidRequest) as info:
            ours(stage, body)
        assert info.value.field == "messages" and "rejected" in info.value.message
    else:
        assert ours(stage, body) == expected


@pytest.mark.parametrize("shipped", SHIPPED, ids=lambda s: s.file.removesuffix(".jinja"))
def test_the_format_detected_is_the_one_its_author_wrote_for(shipped: Shipped) -> None:
    assert detect_content_format(template_of(shipped.file)) == shipped.content_format
    assert stage_of(shipped.file).content_format == shipped.content_format


@pytest.mark.parametrize("shipped", SHIPPED, ids=lambda s: s.file.removesuffix(".jinja"))
def test_string_conversations_render_as_transformers_renders_them(shipped: Shipped) -> None:
    name, stage = shipped.file, stage_of(shipped.file)
    names = [n for n in CONVERSATIONS if takes_tools(name) or not n.startswith("tools")]
    refused = set()
    for conversation in names:
        tools = [TOOL] if conversation.startswith("tools") else None
        messages = CONVERSATIONS[conversation]
        expected = transformers_ids(name, as_sent(messages, shipped.content_format), tools=tools)
        refused |= {conversation} if isinstance(expected, Exception) else set()
        assert_same(stage, {"messages": messages, **({"tools": tools} if tools else {})}, expected)
    # the prompt of a finished conversation: no assistant header
    done = CONVERSATIONS["turns"][:2]
    expected = transformers_ids(name, as_sent(done, shipped.content_format), add_generation_prompt=False)
    refused |= {"done"} if isinstance(expected, Exception) else set()
    assert_same(stage, {"messages": done, "add_generation_prompt": False}, expected)
    # the assistant's turn left open: transformers cuts the prompt where the turn's text ends
    expected = transformers_ids(
        name, as_sent(OPEN_TURN, shipped.content_format), add_generation_prompt=False, continue_final_message=True
    )
    refused |= {"open"} if isinstance(expected, Exception) else set()
    body = {"messages": OPEN_TURN, "add_generation_prompt": False, "continue_final_message": True}
    assert_same(stage, body, expected)
    assert refused == shipped.refuses


@pytest.mark.parametrize("shipped", SHIPPED, ids=lambda s: s.file.removesuffix(".jinja"))
def test_text_parts_render_as_the_template_takes_them(shipped: Shipped) -> None:
    """A string-format template gets the parts joined with "\\n" (as vLLM joins them); an
    openai-format template gets the parts themselves."""
    name, stage = shipped.file, stage_of(shipped.file)
    tools = {"tools": [TOOL]} if takes_tools(name) else {}  # Hermes' tool-use template takes tools only
    parts = [{"type": "text", "text": "Name a colour."}, {"type": "text", "text": "One word, please."}]
    body = {"messages": [{"role": "user", "content": parts}], **tools}
    if shipped.content_format == "string":
        joined = {"messages": [{"role": "user", "content": "Name a colour.\nOne word, please."}], **tools}
        expected = transformers_ids(name, joined["messages"], tools=tools.get("tools"))
        assert ours(stage, body) == ours(stage, joined) == expected
    else:
        assert ours(stage, body) == transformers_ids(name, body["messages"], tools=tools.get("tools"))


def test_a_forced_format_overrides_the_templates_own() -> None:
    vl, smol = "Qwen-Qwen2.5-VL-7B-Instruct.jinja", "HuggingFaceTB-SmolLM2-Instruct.jinja"
    body = {"messages": CONVERSATIONS["turns"]}
    stage = stage_of(vl, content_format="string")
    assert stage.content_format == "string"
    assert ours(stage, body) == transformers_ids(vl, CONVERSATIONS["turns"])  # its string branch
    # a template written for strings, given parts, fails: the reason "auto" reads the template
    stage = stage_of(smol, content_format="openai")
    with pytest.raises(InvalidRequest, match="rejected the conversation") as info:
        ours(stage, body)
    assert info.value.field == "messages"
    with pytest.raises(ValueError, match="content format must be one of"):
        stage_of(smol, content_format="parts")


def test_a_start_template_replaces_the_tokenizers() -> None:
    smol, llama = "HuggingFaceTB-SmolLM2-Instruct.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja"
    gemma = "google-gemma-3-1b-it.jinja"
    stage = TemplateStage(tokenizer_of(smol), None, max_prompt_tokens=4000, threads=1, chat_template=template_of(llama))
    assert stage.content_format == "string"
    conversation = CONVERSATIONS["system"]
    expected = transformers_ids(smol, conversation, chat_template=template_of(llama))
    assert ours(stage, {"messages": conversation}) == expected
    stage = TemplateStage(tokenizer_of(smol), None, max_prompt_tokens=4000, threads=1, chat_template=template_of(gemma))
    assert stage.content_format == "openai"
    with pytest.raises(ValueError, match="not valid Jinja"):
        TemplateStage(tokenizer_of(smol), None, max_prompt_tokens=4000, threads=1, chat_template="{% if %}")


def test_a_request_template_is_rendered_in_its_own_format() -> None:
    smol, vision = "HuggingFaceTB-SmolLM2-Instruct.jinja", "meta-llama-Llama-3.2-11B-Vision-Instruct.jinja"
    stage = stage_of(smol)
    conversation = CONVERSATIONS["turns"]
    for name in (vision, "Qwen-Qwen2.5-7B-Instruct.jinja"):
        template = template_of(name)
        sent = as_sent(conversation, BY_FILE[name].content_format)
        expected = transformers_ids(smol, sent, chat_template=template)
        assert ours(stage, {"messages": conversation, "chat_template": template}) == expected
    assert stage.formats.of(template_of(vision)) == "openai" and stage.content_format == "string"
    with pytest.raises(InvalidRequest) as info:
        ours(stage, {"messages": conversation, "chat_template": "{% for m in messages %}"})
    assert info.value.field == "chat_template"


def test_template_kwargs_reach_the_template() -> None:
    qwen3, llama = "Qwen-Qwen3-0.6B.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja"
    conversation = CONVERSATIONS["user"]
    body = {"messages": conversation, "chat_template_kwargs": {"enable_thinking": False}}
    ids = ours(stage_of(qwen3), body)
    assert ids == transformers_ids(qwen3, conversation, enable_thinking=False)
    assert tokenizer_of(qwen3).decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    body = {"messages": conversation, "chat_template_kwargs": {"date_string": "01 Jan 2030"}}
    ids = ours(stage_of(llama), body)
    assert ids == transformers_ids(llama, conversation, date_string="01 Jan 2030")
    assert "Today Date: 01 Jan 2030" in tokenizer_of(llama).decode(ids)


@pytest.mark.parametrize(
    "name", ["messages", "tools", "chat_template", "add_generation_prompt", "continue_final_message", "tokenize"]
)
def test_template_kwargs_may_not_replace_the_calls_arguments(name: str) -> None:
    stage = stage_of("Qwen-Qwen3-0.6B.jinja")
    request = parse_chat_request({"messages": CONVERSATIONS["user"]})
    with pytest.raises(InvalidRequest) as info:
        stage.render(request.messages, [], options=TemplateOptions(kwargs={name: None}))
    assert info.value.field == f"chat_template_kwargs.{name}"


def test_an_open_turn_and_a_new_one_are_refused_together() -> None:
    stage = stage_of("Qwen-Qwen2.5-7B-Instruct.jinja")
    request = parse_chat_request({"messages": CONVERSATIONS["user"]})
    options = TemplateOptions(add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(InvalidRequest) as info:
        stage.render(request.messages, [], options=options)
    assert info.value.field == "continue_final_message"


def test_truncation_keeps_the_prompts_last_tokens() -> None:
    name = "meta-llama-Llama-3.1-8B-Instruct.jinja"
    stage = stage_of(name)
    request = parse_chat_request({"messages": CONVERSATIONS["turns"]})
    full = stage.render(request.messages, [])
    for keep, expected in [(10, full[-10:]), (len(full), full), (len(full) + 5, full)]:
        assert stage.render(request.messages, [], options=TemplateOptions(truncate_prompt_tokens=keep)) == expected
    stage.max_prompt_tokens = 20
    assert stage.render(request.messages, [], options=TemplateOptions(truncate_prompt_tokens=-1)) == full[-20:]
    with pytest.raises(InvalidRequest) as info:
        stage.render(request.messages, [], options=TemplateOptions(truncate_prompt_tokens=0))
    assert info.value.field == "truncate_prompt_tokens"
