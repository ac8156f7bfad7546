"""Special tokens in the text: dropped or written as transformers' ``decode`` does, on the embedded
tokenizer (1,000 special control tokens, four of them named) and a Qwen-style one whose
``<|vision_start|>`` is special without being named; in the engine, with allowed_token_ids."""

from __future__ import annotations

from typing import Any

import pytest
import xgrammar as xgr

from sampling.detokenizer import Detokenizer, TokenBytes
from tests.models.checkpoints import build_tokenizer
from tests.sampling.conftest import NewEngine
from tests.sampling.helpers import add, prompt, run_all

TEXT = 'Hello world, café ünïcode 日本 {"a": 1}'


@pytest.fixture(scope="module")
def qwen_style() -> tuple[Any, TokenBytes]:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]
    tokenizer = build_tokenizer(specials, chat_template="", bos=None, eos="<|im_end|>")
    info = xgr.TokenizerInfo.from_huggingface(tokenizer)
    return tokenizer, TokenBytes.from_tokenizer(info, tokenizer)


def _detokenize(token_bytes: TokenBytes, ids: list[int], skip_special_tokens: bool) -> str:
    detokenizer = Detokenizer(token_bytes, skip_special_tokens=skip_special_tokens)
    return "".join(detokenizer.add(t) for t in ids) + detokenizer.flush()


def _with_specials(tokenizer: Any, specials: list[int]) -> list[int]:
    """TEXT's ids with ``specials`` around and between them, two in a row too."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    third = len(ids) // 3
    return [specials[0], *ids[:third], specials[1], specials[2], *ids[third:], specials[0]]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_embedded_tokenizer_writes_what_decode_writes(
    hf_tokenizer: Any, token_bytes: TokenBytes, skip_special_tokens: bool
) -> None:
    unnamed = 3  # [INST]: special in added_tokens_decoder, not in all_special_ids
    assert unnamed not in hf_tokenizer.all_special_ids and hf_tokenizer.added_tokens_decoder[unnamed].special
    ids = _with_specials(hf_tokenizer, [1, unnamed, 4])
    expected = hf_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert _detokenize(token_bytes, ids, skip_special_tokens) == expected
    assert ("[INST]" in expected) is not skip_special_tokens


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_an_unnamed_special_token_is_dropped_as_decode_drops_it(
    qwen_style: tuple[Any, TokenBytes], skip_special_tokens: bool
) -> None:
    tokenizer, token_bytes = qwen_style
    ids_of = tokenizer.convert_tokens_to_ids
    vision_start = ids_of("<|vision_start|>")
    assert vision_start not in tokenizer.all_special_ids
    ids = _with_specials(tokenizer, [ids_of("<|im_start|>"), vision_start, ids_of("<|vision_end|>")])
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert _detokenize(token_bytes, ids, skip_special_tokens) == expected
    assert ("<|vision_start|><|vision_end|>" in expected) is not skip_special_tokens


@pytest.mark.parametrize("spaces_between_special_tokens", [True, False])
def test_the_engine_writes_special_tokens_only_when_asked(
    new_engine: NewEngine, hf_tokenizer: Any, spaces_between_special_tokens: bool
) -> None:
    """Sampled among two special tokens and two text tokens (allowed_token_ids): the text is
    transformers' decode of the tokens, with or without the specials; a byte-level decoder puts no
    space between special tokens, so ``spaces_between_special_tokens`` changes nothing."""
    text_ids = hf_tokenizer.encode(" fox jumps", add_special_tokens=False)[:2]
    allowed = (3, 4, *text_ids)
    engine = new_engine()
    common: dict[str, Any] = {"max_tokens": 24, "seed": 3, "temperature": 1.0, "allowed_token_ids": allowed}
    ids = prompt(hf_tokenizer, "specials")
    add(
        engine,
        "written",
        ids,
        skip_special_tokens=False,
        spaces_between_special_tokens=spaces_between_special_tokens,
        **common,
    )
    add(engine, "skipped", ids, **common)
    outputs = run_all(engine)
    written, skipped = outputs[("written", 0)], outputs[("skipped", 0)]
    assert written.token_ids == skipped.token_ids and set(written.token_ids) <= set(allowed)
    assert {3, 4} <= set(written.token_ids) and set(text_ids) & set(written.token_ids)
    assert written.text == hf_tokenizer.decode(written.token_ids, skip_special_tokens=False)
    assert skipped.text == hf_tokenizer.decode(skipped.token_ids, skip_special_tokens=True)
    tokens = written.token_ids
    assert any(a in (3, 4) and b in (3, 4) for a, b in zip(tokens, tokens[1:], strict=False))  # two in a row
