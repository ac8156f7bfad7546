"""The embedded default model (Llava with a Pixtral tower, the real tekken tokenizer) served by both
implementations: an answer about two images equals transformers' own ``generate`` on the inputs the
checkpoint's own processor builds."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch

from pipeline import PipelineConfig
from pipeline.core.pipeline import Pipeline
from tests.images import data_url, encode, image_request, make_image
from vision.checkpoint import Checkpoint

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def expected(checkpoint: Checkpoint) -> tuple[list[int], list[int]]:
    """The prompt ids and greedy answer of transformers' Llava with the Pixtral processor."""
    from transformers import LlavaForConditionalGeneration, PixtralProcessor

    images = [make_image(96, 64, seed=1), make_image(40, 80, seed=2)]
    processor = PixtralProcessor(image_processor=checkpoint.image_processor, tokenizer=checkpoint.tokenizer)
    parts: list[dict[str, Any]] = [{"type": "text", "text": "Describe."}, {"type": "image"}, {"type": "image"}]
    text = checkpoint.tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
    )
    inputs = processor(text=text, images=images, return_tensors="pt")
    model = LlavaForConditionalGeneration.from_pretrained(checkpoint.path).eval()
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("impl", ["native", "transformers"])
async def test_an_image_answer_equals_transformers_generate(impl: str, expected: tuple[list[int], list[int]]) -> None:
    prompt, answer = expected
    urls = [data_url(encode(make_image(96, 64, seed=1))), data_url(encode(make_image(40, 80, seed=2)))]
    body = image_request(urls, max_tokens=MAX_TOKENS, temperature=0)
    config = PipelineConfig(
        model_impl=impl,
        device="cpu",
        preparation_mode="thread",
        max_running_seqs=4,
        num_kv_blocks=64,
        max_model_len=512,
    )
    with anyio.fail_after(180):
        async with Pipeline(config) as pipe:
            assert (await pipe.prepare(body)).prompt_token_ids == prompt
            result = await (await pipe.submit(body)).result()
    assert result.token_ids == answer
