"""Tiny Qwen2.5-VL and Qwen3-VL checkpoints: a dynamic-resolution tower (flattened patches and a
grid per image), M-RoPE in the decoder, and (Qwen3-VL) DeepStack features added to the first layers.

Each is a normal Hugging Face folder written with transformers' own classes under a fixed seed, with
the family's processor (``Qwen2VLImageProcessor`` under a small ``max_pixels``: a few dozen patches
per image) saved beside it by ``processor.save_pretrained``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.models.checkpoints import _TEXT, CHATML_TEMPLATE, INIT_RANGE, SEED, _text_dims, build_tokenizer

__all__ = ["QWEN_VL_SPECIALS", "QWEN_VL_TEMPLATE", "build_qwen2_5_vl", "build_qwen3_vl"]

QWEN_VL_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# a message's text with each image part where Qwen's template writes it
_VL_TEXT = (
    "{% if m['content'] is string %}{% set text = m['content'] %}{% elif m['content'] %}"
    "{% set ns = namespace(t='') %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{% set ns.t = ns.t + p['text'] %}"
    "{% elif p['type'] == 'image' %}{% set ns.t = ns.t + '<|vision_start|><|image_pad|><|vision_end|>' %}"
    "{% endif %}{% endfor %}{% set text = ns.t %}{% else %}{% set text = '' %}{% endif %}"
)
QWEN_VL_TEMPLATE = CHATML_TEMPLATE.replace(_TEXT, _VL_TEXT)
# patch 14 (16 for Qwen3-VL) merged 2 x 2: at most 16 tokens (64 patches) per image
MAX_PATCHES = 64


def _image_processor(patch: int) -> Any:
    from transformers import Qwen2VLImageProcessor

    factor = patch * 2
    return Qwen2VLImageProcessor(
        patch_size=patch,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=factor * factor * 2,
        max_pixels=patch * patch * MAX_PATCHES,
    )


def _save(model: Any, processor: Any, tokenizer: Any, folder: Path) -> Path:
    from transformers import GenerationConfig

    ends = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    model.generation_config = GenerationConfig(eos_token_id=ends)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def _randomise_biases(model: Any) -> None:
    """transformers starts biases at zero: make them matter."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, INIT_RANGE)


def _text(ids: dict[str, int], interleaved: bool) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [2, 3, 3]}
    if interleaved:
        rope["mrope_interleaved"] = True
    return {**_text_dims(), "rope_parameters": rope, "bos_token_id": None, "eos_token_id": ids["<|im_end|>"]}


def _build(
    folder: Path, classes: tuple[Any, Any, Any, Any], *, patch: int, interleaved: bool, tower: dict[str, Any]
) -> Path:
    """A Qwen-VL checkpoint from its (config, model, processor, video processor) classes: the shared
    tokenizer, a tower of ``patch``-pixel patches merged 2 x 2 with the family's own ``tower`` keys,
    and the decoder under M-RoPE (``interleaved``: Qwen3-VL's layout of the three sections)."""
    import torch

    config_class, model_class, processor_class, video_class = classes
    tokenizer = build_tokenizer(QWEN_VL_SPECIALS, chat_template=QWEN_VL_TEMPLATE, bos=None, eos="<|im_end|>")
    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in QWEN_VL_SPECIALS}
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": patch,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        **tower,
        "out_hidden_size": 64,
        "initializer_range": INIT_RANGE,
    }
    config = config_class(
        text_config=_text(ids, interleaved=interleaved),
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(SEED)
    model = model_class(config).eval()
    _randomise_biases(model)
    processor = processor_class(
        image_processor=_image_processor(patch), tokenizer=tokenizer, video_processor=video_class()
    )
    return _save(model, processor, tokenizer, folder)


def build_qwen2_5_vl(folder: Path) -> Path:
    """Qwen2.5-VL: a windowed-attention tower whose patch merger joins 2 x 2 patches into one token,
    a Qwen2 decoder (q/k/v biases) under M-RoPE, and Qwen's processor."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLVideoProcessor,
    )

    classes = (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor, Qwen2VLVideoProcessor)
    # windows of 2 x 2 merged tokens: the first block's attention is windowed
    tower = {"window_size": 56, "fullatt_block_indexes": [1]}
    return _build(folder, classes, patch=14, interleaved=False, tower=tower)


def build_qwen3_vl(folder: Path) -> Path:
    """Qwen3-VL: a tower with learned position embeddings whose first layers also feed DeepStack
    features into the decoder's first layers, a Qwen3 decoder (qk-norm) under interleaved M-RoPE."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor, Qwen3VLVideoProcessor

    classes = (Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor, Qwen3VLVideoProcessor)
    tower = {"num_position_embeddings": 64, "deepstack_visual_indexes": [0, 1]}
    return _build(folder, classes, patch=16, interleaved=True, tower=tower)
