"""What every checkpoint needs before its family matters: the generation prompt, a tokenizer without
image tokens or unk, stop ids from generation_config.json, an image processor saved by a processor."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from pipeline import PipelineConfig
from pipeline.core.pipeline import Pipeline
from pipeline.engine.factory import build_llm_engine
from pipeline.errors import InvalidRequest
from pipeline.protocol.request import parse_chat_request
from stages.template import TemplateStage
from tests.images import data_url, encode, make_image
from vision.checkpoint import Checkpoint

FamilyDir = Callable[[str], Path]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]


def small_config(model: Path, **overrides: Any) -> PipelineConfig:
    kwargs: dict[str, Any] = {
        "model": str(model),
        "device": "cpu",
        "max_running_seqs": 4,
        "num_kv_blocks": 64,
        "max_model_len": 512,
        "engine_mode": "thread",
        **overrides,
    }
    return PipelineConfig(**kwargs)


@pytest.mark.parametrize("family", ["llama3.0", "qwen3"])
async def test_the_chat_prompt_ends_with_the_assistant_header(family: str, family_dir: FamilyDir) -> None:
    tokenizer = Checkpoint(family_dir(family)).tokenizer
    stage = TemplateStage(tokenizer, None, max_prompt_tokens=200, threads=1)
    ids = await stage.run(parse_chat_request({"messages": MESSAGES}).messages, [])
    assert ids == tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    header = "<|start_header_id|>assistant<|end_header_id|>\n\n" if family == "llama3.0" else "<|im_start|>assistant\n"
    assert tokenizer.decode(ids).endswith(header)


async def test_a_model_without_images_refuses_image_parts(family_dir: FamilyDir) -> None:
    stage = TemplateStage(Checkpoint(family_dir("llama3.0")).tokenizer, None, max_prompt_tokens=200, threads=1)
    request = parse_chat_request(
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]}
    )
    with pytest.raises(InvalidRequest, match="takes no images") as info:
        stage.render(request.messages, [object()])  # type: ignore[list-item]
    assert info.value.field == "messages"


async def test_a_text_checkpoint_without_unk_serves_what_transformers_generates(family_dir: FamilyDir) -> None:
    """Llama 3 tokenizers have no unk token and no [IMG_BREAK]: the pipeline starts, and its greedy
    chat answer is transformers' own on the prompt with the generation prompt."""
    from transformers import AutoModelForCausalLM

    folder = family_dir("llama3.0")
    checkpoint = Checkpoint(folder)
    assert checkpoint.tokenizer.unk_token_id is None
    prompt = checkpoint.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    expected = out[0, len(prompt) :].tolist()
    with anyio.fail_after(120):
        async with Pipeline(small_config(folder)) as pipe:
            result = await (await pipe.submit({"messages": MESSAGES, "max_tokens": 12, "temperature": 0})).result()
            image = {"type": "image_url", "image_url": {"url": data_url(encode(make_image(seed=1)))}}
            with pytest.raises(InvalidRequest, match="takes no images"):
                await (await pipe.submit({"messages": [{"role": "user", "content": [image]}]})).result()
    assert result.token_ids == expected[: len(result.token_ids)]
    if result.finish_reason == "length":
        assert len(result.token_ids) == 12


def test_stop_ids_include_the_generation_config_eos_list(family_dir: FamilyDir) -> None:
    checkpoint = Checkpoint(family_dir("llama3.0"))
    tokenizer = checkpoint.tokenizer
    end_of_text, eom, eot = (
        tokenizer.convert_tokens_to_ids(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")
    )
    assert tokenizer.eos_token_id == end_of_text  # the tokenizer alone knows only the end of text
    assert checkpoint.stop_token_ids == [end_of_text, eom, eot]
    assert sorted(checkpoint.tokenizer_info.stop_token_ids) == sorted([end_of_text, eom, eot])
    engine = build_llm_engine(checkpoint, small_config(checkpoint.path), device="cpu")
    assert sorted(engine.requests.eos_token_ids) == sorted([end_of_text, eom, eot])
    qwen = Checkpoint(family_dir("qwen3"))  # an eos list whose first entry is the tokenizer's own
    assert qwen.stop_token_ids == [qwen.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]


def test_the_image_processor_saved_inside_processor_config_is_found(checkpoint: Checkpoint, tmp_path: Path) -> None:
    """transformers 5's ``processor.save_pretrained`` writes no preprocessor_config.json."""
    from transformers import PixtralImageProcessor, PixtralProcessor

    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(checkpoint.path / name, tmp_path / name)
    image_processor = PixtralImageProcessor(size={"longest_edge": 256}, patch_size={"height": 16, "width": 16})
    PixtralProcessor(image_processor=image_processor, tokenizer=checkpoint.tokenizer).save_pretrained(tmp_path)
    assert not (tmp_path / "preprocessor_config.json").exists()
    found = Checkpoint(tmp_path).image_processor
    assert isinstance(found, PixtralImageProcessor) and found.size["longest_edge"] == 256
