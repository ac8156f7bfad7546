"""Families through the HTTP server and the ``openai`` client, as a user runs ``serve --model DIR``:
the greedy answer's tokens (their bytes, from the log probabilities) are transformers' own."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest
import torch

from pipeline import PipelineConfig
from pipeline.api.server import create_app
from pipeline.core.pipeline import Pipeline
from pipeline.engine.client import ProcessEngine
from tests.images import data_url, encode, make_image
from tests.servers import serving

FamilyDir = Callable[[str], Path]
MAX_TOKENS = 10


def _expected(folder: Path, parts: list[dict[str, Any]], images: list[Any]) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    if images:
        processor = AutoProcessor.from_pretrained(folder)
        tokenizer = processor.tokenizer
    else:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
    )
    if images:
        inputs = processor(text=text, images=images, return_tensors="pt")
        model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    else:
        inputs = {"input_ids": torch.tensor([tokenizer.encode(text, add_special_tokens=False)])}
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return list(out[0, inputs["input_ids"].shape[1] :].tolist())


@pytest.mark.parametrize(
    ("family", "with_image", "engine_mode", "placement"),
    [
        ("qwen3", False, "thread", "auto"),
        ("gemma3", False, "thread", "auto"),
        ("mistral3", True, "thread", "auto"),
        ("gemma3-vlm", False, "thread", "auto"),
        ("gemma3-vlm", True, "thread", "auto"),
        ("qwen2.5-vl", True, "thread", "auto"),
        ("qwen3-vl", True, "thread", "auto"),
        # the engine in its own process: embeddings, M-RoPE positions and DeepStack rows cross to it
        ("qwen3-vl", True, "process", "auto"),
        # the vision encoder there too: the pixels cross, and the DeepStack rows are split off there
        ("qwen3-vl", True, "process", "engine"),
    ],
)
async def test_the_served_answer_is_transformers_own(
    family: str, with_image: bool, engine_mode: str, placement: str, family_dir: FamilyDir
) -> None:
    folder = family_dir(family)
    image = make_image(96, 64, seed=7)
    parts: list[dict[str, Any]] = [{"type": "text", "text": "Describe the quick brown fox."}]
    content: list[dict[str, Any]] = list(parts)
    if with_image:
        parts.append({"type": "image"})
        content.append({"type": "image_url", "image_url": {"url": data_url(encode(image))}})
    expected = _expected(folder, parts, [image] if with_image else [])
    config = PipelineConfig(
        model=str(folder),
        device="cpu",
        max_running_seqs=4,
        num_kv_blocks=64,
        max_model_len=512,
        prep_workers=1,
        engine_mode=engine_mode,
        vision_encoder_placement=placement,
    )
    with anyio.fail_after(180):
        async with Pipeline(config) as pipe, serving(create_app(pipe)) as base:
            client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
            try:
                reply = await client.chat.completions.create(
                    model=pipe.model_name,
                    messages=[{"role": "user", "content": content}],  # type: ignore[list-item]
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    logprobs=True,
                )
            finally:
                await client.close()
            table = pipe.token_table
            if engine_mode == "process":  # the embeddings and DeepStack rows crossed in shared memory
                engine = pipe.engine
                assert isinstance(engine, ProcessEngine)
                assert (engine.num_arena_adds, engine.num_inline_adds) == (1, 0)
                if placement == "engine":  # the pixels, encoded over there
                    assert pipe.encoder is None and engine.images is not None and engine.images.num_sent == 1
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    served = [bytes(entry.bytes or []) for entry in logprobs.content]
    assert len(served) >= len(expected) - 1  # every token but an ending eos
    assert served == [table[t] for t in expected[: len(served)]]
    assert reply.usage is not None and reply.usage.completion_tokens == len(expected)
