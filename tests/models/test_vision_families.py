"""Vision-language families through the adapter and the model's own ``get_image_features``: greedy
answers equal to transformers' own ``generate`` on the inputs the checkpoint's own processor builds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from pipeline import PipelineConfig
from pipeline.core.pipeline import Pipeline
from tests.images import data_url, encode, image_request, make_image
from vision.checkpoint import Checkpoint

FamilyDir = Callable[[str], Path]
MAX_TOKENS = 12
IMAGES = [(96, 64, 1), (40, 80, 2)]


def _reference(folder: Path, parts: list[dict[str, Any]], images: list[Any]) -> tuple[list[int], list[int]]:
    """The prompt the checkpoint's own processor builds, and transformers' greedy answer to it."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
    )
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    ("family", "preparation_mode", "impl"),
    # every family in thread mode; in process mode (a worker encodes, its rows cross to the serving
    # process: the same for every family) one of each kind: 1-D positions, bidirectional image
    # spans, M-RoPE positions with DeepStack rows
    [
        ("mistral3", "thread", "auto"),
        ("llava-clip", "thread", "transformers"),
        ("llava-clip", "process", "native"),
        ("gemma3-vlm", "thread", "auto"),
        ("gemma3-vlm", "process", "transformers"),
        ("qwen2.5-vl", "thread", "auto"),
        ("qwen3-vl", "thread", "auto"),
        ("qwen3-vl", "process", "auto"),
    ],
)
async def test_answers_about_two_images_and_text_are_transformers_own(
    family: str, preparation_mode: str, impl: str, family_dir: FamilyDir
) -> None:
    folder = family_dir(family)
    assert not (folder / "preprocessor_config.json").exists()  # the processor saved inside processor_config.json
    images = [make_image(w, h, seed=s) for w, h, s in IMAGES]
    parts = [{"type": "text", "text": "Describe."}, {"type": "image"}, {"type": "image"}]
    image_prompt, image_answer = _reference(folder, parts, images)
    text_prompt, text_answer = _reference(folder, [{"type": "text", "text": "Hello world"}], [])
    body = image_request([data_url(encode(image)) for image in images], max_tokens=MAX_TOKENS, temperature=0)
    config = PipelineConfig(
        model=str(folder),
        model_impl=impl,
        device="cpu",
        preparation_mode=preparation_mode,
        prep_workers=1,
        max_running_seqs=4,
        num_kv_blocks=64,
        max_model_len=512,
        engine_mode="thread",
    )
    with anyio.fail_after(180):
        async with Pipeline(config) as pipe:
            assert (await pipe.prepare(body)).prompt_token_ids == image_prompt
            answer = await (await pipe.submit(body)).result()
            text = {
                "messages": [{"role": "user", "content": "Hello world"}],
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
            }
            assert (await pipe.prepare(text)).prompt_token_ids == text_prompt
            text_result = await (await pipe.submit(text)).result()
    assert answer.token_ids == image_answer
    assert text_result.token_ids == text_answer
    assert Checkpoint(folder).image_processor is not None


@pytest.mark.parametrize("feature_layer", [-1, -2])
def test_the_encoder_gives_the_models_own_image_features(
    feature_layer: int, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """The default model's layout, with the tower's last layer (the fast path) or another one."""
    import shutil

    from transformers import AutoConfig, LlavaForConditionalGeneration

    from vision.encoder import VisionEncoder
    from vision.preprocess import preprocess_image

    config = AutoConfig.from_pretrained(checkpoint.path, vision_feature_layer=feature_layer)
    model = LlavaForConditionalGeneration.from_pretrained(checkpoint.path, config=config).eval()
    model.save_pretrained(tmp_path)
    shutil.copy(checkpoint.path / "preprocessor_config.json", tmp_path / "preprocessor_config.json")
    prepared = preprocess_image(checkpoint.image_processor, make_image(96, 64, seed=4))
    assert prepared.pixel_values is not None
    ours = VisionEncoder(Checkpoint(tmp_path)).encode([prepared])[0]
    with torch.inference_mode():
        sizes = torch.tensor([prepared.pixel_values.shape[1:]])
        expected = model.get_image_features(pixel_values=prepared.pixel_values[None], image_sizes=sizes).pooler_output[
            0
        ]
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)
