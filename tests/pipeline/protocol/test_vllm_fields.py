"""vLLM's request fields at admission: their bounds, their defaults and the checkpoint's own defaults.

What each field does to the answer is tested where it acts: the engine's sampling
(tests/sampling/), the template stage (tests/stages/) and the server (tests/pipeline/api/).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest

from pipeline.errors import InvalidRequest
from pipeline.protocol.completion_request import parse_completion_request
from pipeline.protocol.request import parse_chat_request
from pipeline.protocol.sampling_defaults import SamplingDefaults, read_generation_config

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**extra: Any) -> dict[str, Any]:
    return {"messages": MESSAGES, **extra}


def refusal(body: dict[str, Any], **options: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        parse_chat_request(body, **options)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"stop_token_ids": [1, 100]}, "stop_token_ids[1]"),
        ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [3, 100]}, "allowed_token_ids[1]"),
        ({"bad_words": [""]}, "bad_words[0]"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 65}, "truncate_prompt_tokens"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"top_k": -2}, "top_k"),
        ({"chat_template_kwargs": []}, "chat_template_kwargs"),
        ({"chat_template": ""}, "chat_template"),
    ],
    ids=lambda v: json.dumps(v) if isinstance(v, dict) else v,
)
def test_a_value_out_of_bounds_is_a_400_naming_its_field(extra: dict[str, Any], field: str) -> None:
    error = refusal(chat(**extra), vocab_size=100, max_prompt_tokens=64)
    assert error.field == field


def test_unset_fields_leave_sampling_as_openai_defines_it() -> None:
    sampling = parse_chat_request(chat()).sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (1.0, 1.0, 0)
    assert (sampling.repetition_penalty, sampling.min_p, sampling.min_tokens) == (1.0, 0.0, 0)
    assert sampling.stop_token_ids == () and sampling.allowed_token_ids is None and sampling.bad_words_ids == ()
    assert sampling.skip_special_tokens and sampling.spaces_between_special_tokens
    assert not sampling.include_stop_str_in_output


def test_top_k_minus_one_is_vllms_spelling_of_off() -> None:
    assert parse_chat_request(chat(top_k=-1)).sampling.top_k == 0


DEFAULTS = SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, min_p=0.05, repetition_penalty=1.05, max_tokens=40)


def test_the_checkpoints_defaults_fill_only_the_fields_a_request_leaves_unset() -> None:
    unset = parse_chat_request(chat(), defaults=DEFAULTS).sampling
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p) == (0.7, 0.8, 20, 0.05)
    assert (unset.repetition_penalty, unset.max_tokens) == (1.05, 40)
    given = parse_chat_request(
        chat(temperature=0, top_p=1, top_k=0, min_p=0, repetition_penalty=1, max_tokens=5), defaults=DEFAULTS
    ).sampling
    assert (given.temperature, given.top_p, given.top_k, given.min_p) == (0.0, 1.0, 0, 0.0)
    assert (given.repetition_penalty, given.max_tokens) == (1.0, 5)
    (completion,) = parse_completion_request({"prompt": "hi"}, defaults=DEFAULTS)
    assert completion.sampling.temperature == 0.7 and completion.sampling.max_tokens == 40


def test_generation_config_json_is_read_as_vllm_reads_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # what Qwen2.5-7B-Instruct ships, plus a value out of the API's bounds
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": 151643,
                "do_sample": True,
                "eos_token_id": [151645, 151643],
                "pad_token_id": 151643,
                "repetition_penalty": 1.05,
                "temperature": 0.7,
                "top_p": 0.8,
                "top_k": 20,
                "min_p": 7,
                "transformers_version": "4.37.0",
            }
        )
    )
    with caplog.at_level(logging.WARNING):
        defaults = read_generation_config(tmp_path)
    assert defaults == SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
    assert "min_p=7" in caplog.text
    assert read_generation_config(tmp_path / "missing") == SamplingDefaults()
    assert read_generation_config(None) == SamplingDefaults()
    (tmp_path / "generation_config.json").write_text("{not json")
    assert read_generation_config(tmp_path) == SamplingDefaults()


def test_template_options_follow_vllms_rules() -> None:
    assert parse_chat_request(chat()).template.add_generation_prompt
    opened = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    request = parse_chat_request({"messages": opened, "continue_final_message": True})
    assert request.template.continue_final_message and not request.template.add_generation_prompt
    # the assistant's turn last, without a new header: accepted when asked for
    assert not parse_chat_request({"messages": opened, "add_generation_prompt": False}).template.add_generation_prompt
    assert refusal({"messages": opened}).field == "messages[1].role"
    assert refusal({"messages": MESSAGES, "continue_final_message": True}).field == "messages[0].role"
    both = {"messages": opened, "continue_final_message": True, "add_generation_prompt": True}
    assert refusal(both).field == "add_generation_prompt"
    kwargs = parse_chat_request(chat(chat_template_kwargs={"enable_thinking": False, "x": [1]})).template.kwargs
    assert kwargs == {"enable_thinking": False, "x": [1]}


def test_truncate_prompt_tokens_counts_the_tokens_kept() -> None:
    assert (
        parse_chat_request(chat(truncate_prompt_tokens=-1), max_prompt_tokens=64).template.truncate_prompt_tokens == 64
    )
    assert parse_chat_request(chat(truncate_prompt_tokens=5), max_prompt_tokens=64).template.truncate_prompt_tokens == 5
    (request,) = parse_completion_request({"prompt": [1, 2, 3], "truncate_prompt_tokens": 2})
    assert request.template.truncate_prompt_tokens == 2


class WordTokenizer:
    """Whole words, a leading space its own token: what the bad-words rule asks of a vocabulary."""

    vocab = {"bad": 1, " bad": 2, "very": 3, " very": 4}

    def encode(self, text: str) -> list[int]:
        return [self.vocab[word] for word in re.findall(r" ?\w+", text)]


def test_bad_words_are_banned_as_written_and_after_a_space() -> None:
    words = WordTokenizer()
    sampling = parse_chat_request(chat(bad_words=["bad", " very bad"]), encode=words.encode).sampling
    # "bad" -> (1,), " bad" -> (2,): both; "very bad" -> (3, 2), " very bad" -> (4, 2): both
    assert sampling.bad_words_ids == ((1,), (2,), (3, 2), (4, 2))
    assert refusal(chat(bad_words=["bad"])).field == "bad_words"  # no tokenizer to read them with


def test_a_requests_own_chat_template_needs_the_servers_trust() -> None:
    body = chat(chat_template="{{ messages[0]['content'] }}")
    assert refusal(body, trust_request_chat_template=False).field == "chat_template"
    assert parse_chat_request(body).template.chat_template == "{{ messages[0]['content'] }}"
