"""The embedded default model: a tiny seeded Pixtral-style VLM written as a Hugging Face checkpoint.

It needs no download: the tokenizer is the real Pixtral one (``tekken_240911.json``, 131,072 tokens,
shipped inside mistral-common) converted with transformers' converter, whose generated chat template
places ``[IMG]`` for image parts. The weights are random but seeded, so the same seed writes the same
bytes. The folder is then loaded by the same code that loads a user's checkpoint.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vision.written_once import written_once

__all__ = [
    "DEFAULT_SEED",
    "EMBEDDED_SHAPE",
    "PixtralShape",
    "pixtral_config",
    "ensure_default_checkpoint",
    "tekken_tokenizer_path",
    "write_default_checkpoint",
    "write_pixtral_checkpoint",
]

DEFAULT_SEED = 1234
_FORMAT_VERSION = "1"  # bump when the architecture below changes, so old caches are rebuilt
IMAGE_LONGEST_EDGE = 512
PATCH_SIZE = 16


def tekken_tokenizer_path() -> str:
    """Path of the Pixtral tokenizer file that mistral-common ships."""
    import mistral_common

    return os.path.join(os.path.dirname(mistral_common.__file__), "data", "tekken_240911.json")


@dataclass(frozen=True, slots=True)
class PixtralShape:
    """The sizes of a Llava-layout model: a Pixtral vision tower and a Mistral decoder (tekken vocabulary)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rope_theta: float
    max_positions: int
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    vision_intermediate: int
    image_size: int


# the embedded default: 2 layers of width 64 on each side
EMBEDDED_SHAPE = PixtralShape(
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    head_dim=16,
    intermediate=192,
    rope_theta=1_000_000.0,
    max_positions=32_768,
    vision_hidden=64,
    vision_layers=2,
    vision_heads=4,
    vision_intermediate=128,
    image_size=IMAGE_LONGEST_EDGE,
)


def pixtral_config(shape: PixtralShape) -> Any:
    """The transformers ``LlavaConfig`` of ``shape``."""
    from transformers import LlavaConfig, MistralConfig, PixtralVisionConfig

    vision = PixtralVisionConfig(  # type: ignore[call-arg]
        hidden_size=shape.vision_hidden,
        intermediate_size=shape.vision_intermediate,
        num_hidden_layers=shape.vision_layers,
        num_attention_heads=shape.vision_heads,
        head_dim=shape.vision_hidden // shape.vision_heads,
        num_channels=3,
        image_size=shape.image_size,
        patch_size=PATCH_SIZE,
        rope_theta=10_000.0,
    )
    text = MistralConfig(  # type: ignore[call-arg]
        vocab_size=131_072,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_positions,
        rope_theta=shape.rope_theta,
        rms_norm_eps=1e-5,
        sliding_window=None,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=10,  # "[IMG]" in tekken
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        multimodal_projector_bias=True,
        tie_word_embeddings=False,
    )


def write_default_checkpoint(folder: Path, *, seed: int = DEFAULT_SEED) -> None:
    """Write config, safetensors weights, tokenizer and image processor files into ``folder``."""
    write_pixtral_checkpoint(folder, EMBEDDED_SHAPE, seed=seed)
    (folder / "EMBEDDED_DEFAULT").write_text(f"seed={seed} format={_FORMAT_VERSION}\n")


def write_pixtral_checkpoint(
    folder: Path, shape: PixtralShape, *, seed: int, device: str = "cpu", dtype: Any = None
) -> int:
    """Write a Llava checkpoint of ``shape`` with seeded random weights (the tekken tokenizer, a
    Pixtral image processor) into ``folder``; its parameter count.

    ``dtype`` (a torch dtype; None: fp32) is the one the weights are drawn and written in; ``device``
    where they are drawn (a GPU draws 8B parameters in a second, the CPU takes minutes).
    """
    import torch
    from transformers import LlavaForConditionalGeneration, PixtralImageProcessor
    from transformers.integrations.mistral import convert_tekken_tokenizer

    config = pixtral_config(shape)
    default_dtype = torch.get_default_dtype()
    if dtype is not None:
        config.dtype = str(dtype).removeprefix("torch.")
        torch.set_default_dtype(dtype)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    try:
        with torch.device(device):
            model = LlavaForConditionalGeneration(config).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="5GB")
    convert_tekken_tokenizer(tekken_tokenizer_path()).save_pretrained(folder)
    processor = PixtralImageProcessor(
        size={"longest_edge": shape.image_size}, patch_size={"height": PATCH_SIZE, "width": PATCH_SIZE}
    )
    processor.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def ensure_default_checkpoint(cache_dir: Path, *, seed: int = DEFAULT_SEED) -> Path:
    """Return the embedded checkpoint folder under ``cache_dir``, writing it once if missing.

    The folder is built aside and renamed in (``vision.written_once``): concurrent processes and
    interrupted writes never leave a half-written checkpoint behind.
    """
    target = Path(cache_dir) / f"embedded-pixtral-tiny-s{seed}-v{_FORMAT_VERSION}"
    return written_once(target, "EMBEDDED_DEFAULT", lambda folder: write_default_checkpoint(folder, seed=seed))
