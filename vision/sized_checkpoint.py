"""Random-weight checkpoints in the shapes of released models, for measuring on a GPU.

The embedded model is tiny, so its figures say what the host costs, not what a real model's forward
costs beside it. ``python -m pipeline checkpoint --preset pixtral-7b DIR`` writes a Llava-layout
checkpoint (Pixtral vision tower, Mistral decoder, the tekken tokenizer) whose layers have a released
model's sizes (these presets) and whose weights are seeded random numbers in bf16
(``write_pixtral_checkpoint``). Nothing is downloaded; the folder
is loaded like any user's checkpoint (``--model DIR``).
"""

from __future__ import annotations

from vision.default_checkpoint import PixtralShape

__all__ = ["PRESETS"]


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
