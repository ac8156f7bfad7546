"""Random-weight checkpoints in the shapes of released models, for measuring on a GPU.

The embedded model is tiny, so its figures say what the host costs, not what a real model's forward
costs beside it. ``python -m pipeline checkpoint --preset pixtral-7b DIR`` writes a Llava-layout
checkpoint (Pixtral vision tower, Mistral decoder, the tekken tokenizer) whose layers have a released
model's sizes and whose weights are seeded random numbers in bf16. Nothing is downloaded; the folder
is loaded like any user's checkpoint (``--model DIR``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vision.default_checkpoint import write_pixtral_preprocessing

__all__ = ["PRESETS", "Preset", "sized_config", "write_sized_checkpoint"]


@dataclass(frozen=True, slots=True)
class Preset:
    """A decoder's and a vision tower's sizes."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    rope_theta: float
    vision_hidden: int = 1024  # Pixtral-12B's tower
    vision_layers: int = 24
    vision_heads: int = 16
    vision_intermediate: int = 4096
    image_size: int = 1024


PRESETS: dict[str, Preset] = {
    # Mistral 7B's decoder with the tekken vocabulary (131,072 tokens): 8.0B parameters with the tower
    "pixtral-7b": Preset(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, rope_theta=1e6),
    # Pixtral 12B's shape: 12.7B parameters
    "pixtral-12b": Preset(hidden=5120, layers=40, heads=32, kv_heads=8, intermediate=14336, rope_theta=1e9),
}

_PATCH_SIZE = 16


def _config(preset: Preset) -> Any:
    from transformers import LlavaConfig, MistralConfig, PixtralVisionConfig

    vision = PixtralVisionConfig(  # type: ignore[call-arg]
        hidden_size=preset.vision_hidden,
        intermediate_size=preset.vision_intermediate,
        num_hidden_layers=preset.vision_layers,
        num_attention_heads=preset.vision_heads,
        head_dim=preset.vision_hidden // preset.vision_heads,
        num_channels=3,
        image_size=preset.image_size,
        patch_size=_PATCH_SIZE,
        rope_theta=10_000.0,
    )
    text = MistralConfig(  # type: ignore[call-arg]
        vocab_size=131_072,
        hidden_size=preset.hidden,
        intermediate_size=preset.intermediate,
        num_hidden_layers=preset.layers,
        num_attention_heads=preset.heads,
        num_key_value_heads=preset.kv_heads,
        head_dim=128,
        max_position_embeddings=131_072,
        rope_theta=preset.rope_theta,
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


def sized_config(preset: str | Preset) -> Any:
    """The transformers ``LlavaConfig`` of a preset (by name or given)."""
    return _config(PRESETS[preset] if isinstance(preset, str) else preset)


def write_sized_checkpoint(folder: Path, preset: str | Preset, *, device: str = "cpu", seed: int = 0) -> int:
    """Write the preset's checkpoint into ``folder``; its parameter count.

    The weights are drawn on ``device`` (a GPU draws 8B in a second; the CPU takes minutes) and written
    in bf16, the dtype the engine runs on a GPU.
    """
    import torch
    from transformers import LlavaForConditionalGeneration

    sizes = PRESETS[preset] if isinstance(preset, str) else preset
    config = sized_config(sizes)
    config.dtype = "bfloat16"
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    with torch.device(device):
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = LlavaForConditionalGeneration(config).eval()
        finally:
            torch.set_default_dtype(default_dtype)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="5GB")
    write_pixtral_preprocessing(folder, longest_edge=sizes.image_size, patch_size=_PATCH_SIZE)
    return sum(p.numel() for p in model.parameters())


def run(args: Any) -> int:
    """``python -m pipeline checkpoint``: write, and say what was written."""
    started = time.perf_counter()
    count = write_sized_checkpoint(Path(args.folder), args.preset, device=args.device, seed=args.seed)
    print(f"{args.folder}: {args.preset}, {count / 1e9:.2f}B parameters, {time.perf_counter() - started:.0f} s")
    return 0
