"""Random-weight checkpoints in the shapes of released models, for measuring on a GPU.

The embedded model is tiny, so its figures say what the host costs, not what a real model's forward
costs beside it. ``python -m pipeline checkpoint --preset pixtral-7b DIR`` writes a Llava-layout
checkpoint (Pixtral vision tower, Mistral decoder, the tekken tokenizer) whose layers have a released
model's sizes and whose weights are seeded random numbers in bf16. Nothing is downloaded; the folder
is loaded like any user's checkpoint (``--model DIR``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from vision.default_checkpoint import PATCH_SIZE, PixtralShape, pixtral_config, write_pixtral_preprocessing

__all__ = ["PRESETS", "sized_config", "write_sized_checkpoint"]


def _pixtral_sized(hidden: int, layers: int, rope_theta: float) -> PixtralShape:
    """A Mistral decoder of 32 heads (8 for keys and values, 128 wide) beside Pixtral-12B's tower."""
    return PixtralShape(
        hidden=hidden,
        layers=layers,
        heads=32,
        kv_heads=8,
        head_dim=128,
        intermediate=14336,
        rope_theta=rope_theta,
        max_positions=131_072,
        vision_hidden=1024,
        vision_layers=24,
        vision_heads=16,
        vision_intermediate=4096,
        image_size=1024,
    )


PRESETS: dict[str, PixtralShape] = {
    # Mistral 7B's decoder with the tekken vocabulary (131,072 tokens): 8.48B parameters with the tower
    "pixtral-7b": _pixtral_sized(hidden=4096, layers=32, rope_theta=1e6),
    # Pixtral 12B's shape: 12.7B parameters
    "pixtral-12b": _pixtral_sized(hidden=5120, layers=40, rope_theta=1e9),
}


def sized_config(preset: str | PixtralShape) -> Any:
    """The transformers ``LlavaConfig`` of a preset (by name or given)."""
    return pixtral_config(PRESETS[preset] if isinstance(preset, str) else preset)


def write_sized_checkpoint(folder: Path, preset: str | PixtralShape, *, device: str = "cpu", seed: int = 0) -> int:
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
    write_pixtral_preprocessing(folder, longest_edge=sizes.image_size, patch_size=PATCH_SIZE)
    return sum(p.numel() for p in model.parameters())


def run(args: Any) -> int:
    """``python -m pipeline checkpoint``: write, and say what was written."""
    started = time.perf_counter()
    count = write_sized_checkpoint(Path(args.folder), args.preset, device=args.device, seed=args.seed)
    print(f"{args.folder}: {args.preset}, {count / 1e9:.2f}B parameters, {time.perf_counter() - started:.0f} s")
    return 0
