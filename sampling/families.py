"""The model registry: per architecture, what preparation and the scheduler must know.

A family is a row here plus its parity test (tests/models/); the model itself is the checkpoint's
own transformers class run through the adapter (sampling/hf_adapter.py). Rows say how positions
are formed, whether an image span must stay in one prefill chunk, which extra per-token prefill
inputs the model takes, and how the model writes tool calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from sampling.hf_adapter import HFModelRunner, UnsupportedModel
from sampling.model_runner import ModelRunner
from sampling.paged_runner import PagedRunner
from vision.checkpoint import Checkpoint

__all__ = ["FAMILIES", "Family", "ModelImpl", "build_runner", "family_of"]

ModelImpl = Literal["auto", "transformers", "native"]


@dataclass(frozen=True, slots=True)
class Family:
    """What preparation and the scheduler must know of one architecture."""

    name: str
    position_scheme: Literal["1d", "mrope"] = "1d"  # mrope: 3 x L positions computed in preparation
    atomic_image_spans: bool = False  # image tokens attend bidirectionally: never split across chunks
    extra_prefill_inputs: tuple[str, ...] = ()  # per-token inputs beside the embeddings (DeepStack)
    tool_call_format: Literal["mistral", "hermes", "llama3_json"] | None = None
    # the hand-written decoder (sampling/model.py) runs it too, when its RoPE is the default one
    native: bool = False
    # the vision towers (their config's model_type) preparation and the encoder handle for it
    vision_towers: tuple[str, ...] = ()


FAMILIES: dict[str, Family] = {
    "MistralForCausalLM": Family("Mistral", tool_call_format="mistral", native=True),
    "LlamaForCausalLM": Family("Llama", tool_call_format="llama3_json", native=True),
    "Qwen2ForCausalLM": Family("Qwen2", tool_call_format="hermes"),
    "Qwen3ForCausalLM": Family("Qwen3", tool_call_format="hermes"),
    "Gemma2ForCausalLM": Family("Gemma 2"),
    "Gemma3ForCausalLM": Family("Gemma 3 (text)"),
    # Pixtral tower: rows of [IMG] closed by [IMG_BREAK]/[IMG_END]; CLIP: <image> once per patch
    "LlavaForConditionalGeneration": Family(
        "Llava", tool_call_format="mistral", native=True, vision_towers=("pixtral", "clip_vision_model")
    ),
    # Pixtral tower + patch merger: the Pixtral layout over merged patches
    "Mistral3ForConditionalGeneration": Family("Mistral 3", tool_call_format="mistral", vision_towers=("pixtral",)),
    # SigLIP tower, patches average-pooled to mm_tokens_per_image; image tokens attend bidirectionally
    "Gemma3ForConditionalGeneration": Family(
        "Gemma 3", atomic_image_spans=True, vision_towers=("siglip_vision_model",)
    ),
    # dynamic resolution: flattened patches and a grid per image, merged 2 x 2; M-RoPE positions
    "Qwen2_5_VLForConditionalGeneration": Family(
        "Qwen2.5-VL", position_scheme="mrope", tool_call_format="hermes", vision_towers=("qwen2_5_vl_vision",)
    ),
    # and DeepStack: the tower's features of some layers added after the decoder's first layers
    "Qwen3VLForConditionalGeneration": Family(
        "Qwen3-VL",
        position_scheme="mrope",
        extra_prefill_inputs=("deepstack_visual_embeds",),
        tool_call_format="hermes",
        vision_towers=("qwen3_vl_vision",),
    ),
}


def _architecture(checkpoint: Checkpoint) -> str:
    names = getattr(checkpoint.config, "architectures", None) or [type(checkpoint.config).__name__]
    return str(names[0])


def family_of(checkpoint: Checkpoint) -> Family:
    """The registry row of ``checkpoint``'s architecture.

    :raises UnsupportedModel: naming the architecture and what is missing for it.
    """
    arch = _architecture(checkpoint)
    family = FAMILIES.get(arch)
    if family is None:
        raise UnsupportedModel(
            f"architecture {arch} is not supported: it has no row in the model registry (sampling/families.py), "
            f"which says how its positions, image spans and tool calls work; supported: {', '.join(sorted(FAMILIES))}"
        )
    if checkpoint.vision_config is not None:
        tower = checkpoint.vision_config.model_type
        if tower not in family.vision_towers:
            raise UnsupportedModel(
                f"architecture {arch} with a {tower} vision tower: its image preparation is missing "
                f"(supported towers: {', '.join(family.vision_towers) or 'none'})"
            )
        if (
            tower == "clip_vision_model"
            and getattr(checkpoint.config, "vision_feature_select_strategy", None) != "default"
        ):
            raise UnsupportedModel(f"architecture {arch}: a CLIP tower that keeps its CLS token is not supported")
        if getattr(checkpoint.image_processor, "do_pan_and_scan", False):
            raise UnsupportedModel(f"architecture {arch}: pan and scan (do_pan_and_scan) is not supported")
    return family


def _native_fits(checkpoint: Checkpoint) -> bool:
    """Whether the hand-written decoder computes exactly what the checkpoint's model does."""
    text: Any = checkpoint.text_config
    rope = getattr(text, "rope_parameters", None) or {}
    return (
        rope.get("rope_type", "default") == "default"
        and not getattr(text, "attention_bias", False)
        and not getattr(text, "mlp_bias", False)
        and getattr(text, "sliding_window", None) is None
        and getattr(text, "hidden_act", "silu") == "silu"
    )


def build_runner(
    checkpoint: Checkpoint,
    *,
    impl: ModelImpl = "auto",
    device: str,
    max_model_len: int,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype | None = None,
) -> PagedRunner:
    """The model runner of ``checkpoint``: ``transformers`` (the adapter), ``native`` (the
    hand-written decoder) or ``auto`` (native where it computes the same model, else the adapter);
    ``dtype``: its weights' and KV cache's (None: bf16 on CUDA, fp32 elsewhere).

    :raises UnsupportedModel: the architecture is not supported, or ``native`` cannot run it.
    """
    family = family_of(checkpoint)
    native = family.native and _native_fits(checkpoint)
    if impl == "native" and not native:
        raise UnsupportedModel(
            f"architecture {_architecture(checkpoint)}: the native decoder cannot run this checkpoint"
        )
    kind = ModelRunner if impl == "native" or (impl == "auto" and native) else HFModelRunner
    runner = kind(
        checkpoint,
        device=device,
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        block_size=block_size,
        dtype=dtype,
    )
    runner.atomic_image_spans = family.atomic_image_spans
    return runner
