"""The vision encoder of a checkpoint: for Llava with a Pixtral tower (its last layer, every patch),
transformers' tower and projector modules loaded alone from the checkpoint's weights; for other
families, the checkpoint's own transformers model built and loaded without its language model,
encoding through its own ``get_image_features`` (tower + projector or patch merger).

Qwen3-VL's tower also gives DeepStack features, one ``[tokens, hidden]`` map per layer it feeds: they
travel beside each token's embedding in the same row, ``[tokens, (1 + num_deepstack) * hidden]``, so
one tensor per image crosses the worker's slab and sits in the encoder cache; the engine input splits
them off (``split_deepstack``)."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from vision.checkpoint import Checkpoint
from vision.preprocess import PreparedImage

__all__ = ["VisionEncoder", "embedding_row_bytes", "encoder_dtype", "split_deepstack"]

# vision towers that take flattened patches and their grid (vision/grid_images.py)
_GRID_TOWERS = ("qwen2_5_vl_vision", "qwen3_vl_vision")


def split_deepstack(rows: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The embeddings ``[tokens, hidden]`` of packed encoder rows, and their DeepStack features
    ``[tokens, num_deepstack, hidden]`` (None when there are none)."""
    if rows.shape[-1] == hidden:
        return rows, None
    return rows[:, :hidden], rows[:, hidden:].reshape(rows.shape[0], -1, hidden)


def encoder_dtype(device: torch.device) -> torch.dtype:
    """The encoder's dtype on ``device``: bf16 on a GPU, fp32 on the CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def embedding_row_bytes(checkpoint: Checkpoint, device: str) -> int:
    """Bytes of one image token's row as ``VisionEncoder.encode`` gives it on ``device``: the text
    model's hidden size, once more per DeepStack layer (Qwen3-VL), in the encoder's dtype (what an
    image's embeddings weigh in a cache before any is encoded)."""
    vision = checkpoint.vision_config
    deepstack = len(getattr(vision, "deepstack_visual_indexes", None) or ()) if vision is not None else 0
    itemsize = torch.empty((), dtype=encoder_dtype(torch.device(device))).element_size()
    return int(checkpoint.text_config.hidden_size) * (1 + deepstack) * itemsize


class VisionEncoder:
    """Encodes a batch of prepared images into one embedding row per ``[IMG]`` token."""

    def __init__(self, checkpoint: Checkpoint, *, device: str = "cpu", dtype: torch.dtype | None = None) -> None:
        from transformers import PixtralVisionModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        config = checkpoint.config
        if checkpoint.vision_config is None:
            raise ValueError(f"{checkpoint.path} has no vision_config: not a vision-language checkpoint")
        self.device = torch.device(device)
        self.dtype = dtype or encoder_dtype(self.device)
        self.text_hidden_size = int(checkpoint.text_config.hidden_size)
        self.model: Any = None
        self.takes_sizes = checkpoint.vision_config.model_type == "pixtral"
        # a tower of flattened patches takes their grid in patches: the token grid times the merge
        is_grid = checkpoint.vision_config.model_type in _GRID_TOWERS
        self.grid_merge = int(checkpoint.vision_config.spatial_merge_size) if is_grid else 0
        # the tower's last hidden state of every patch through the projector: what Llava's
        # get_image_features computes then, without loading the language model's weights at all
        towers_alone = (config.model_type, checkpoint.vision_config.model_type) == ("llava", "pixtral") and (
            config.vision_feature_layer == -1 and config.vision_feature_select_strategy == "full"
        )
        if not towers_alone:
            self.model = _load_without_language_model(checkpoint, self.device, self.dtype)
            return
        self.tower = PixtralVisionModel(checkpoint.vision_config)
        self.projector = LlavaMultiModalProjector(config)
        _load(self.tower, checkpoint.load_weights(("vision_tower.",)), "vision_tower")
        _load(self.projector, checkpoint.load_weights(("multi_modal_projector.",)), "multi_modal_projector")
        self.tower.to(self.device, self.dtype).eval()  # type: ignore[call-arg, arg-type]
        self.projector.to(self.device, self.dtype).eval()

    @property
    def hidden_size(self) -> int:
        return self.text_hidden_size

    def encode(self, images: list[PreparedImage]) -> list[torch.Tensor]:
        """One tensor ``[num_patches, hidden]`` per image (DeepStack features packed beside: see
        the module's docstring), on the CPU in the model's dtype.

        The tower runs once per image: transformers' Pixtral tower packs a batch into one sequence
        under a block-diagonal mask, so its attention cost grows with the square of the whole
        batch (measured: 8 images of 768 patches, 301 ms packed vs 57 ms one by one, CPU).
        The stage's micro-batch still saves thread hops and keeps the work in one call.
        """
        with torch.inference_mode():
            return [self._encode_one(image).to("cpu") for image in images]

    def _encode_one(self, image: PreparedImage) -> torch.Tensor:
        if image.pixel_values is None:
            raise ValueError("the image has no pixels to encode")
        if self.grid_merge:
            return self._encode_grid(image)
        # pixel_values: [1, 3, H, W]
        pixels = image.pixel_values[None].to(self.device, self.dtype, non_blocking=True)
        if self.model is not None:
            # only towers of dynamic resolution (Pixtral) take the image's size
            sizes = {"image_sizes": torch.tensor([image.pixel_values.shape[1:]])} if self.takes_sizes else {}
            features: Any = self.model.get_image_features(pixel_values=pixels, **sizes)
            return features.pooler_output[0]  # [image tokens, hidden]
        out: Any = self.tower(pixels, image_sizes=[tuple(image.pixel_values.shape[1:])])
        # last_hidden_state: [1, num_patches, vision_hidden]
        return self.projector(out.last_hidden_state[0])

    def _encode_grid(self, image: PreparedImage) -> torch.Tensor:
        assert image.pixel_values is not None
        t, h, w = image.grid_thw
        merge = self.grid_merge
        # pixel_values: [num_patches, patch_dim]; the grid in patches, before the merger
        features: Any = self.model.get_image_features(
            pixel_values=image.pixel_values.to(self.device, self.dtype, non_blocking=True),
            image_grid_thw=torch.tensor([[t, h * merge, w * merge]], device=self.device),
        )
        deepstack = getattr(features, "deepstack_features", None) or []
        # [tokens, hidden] each: the embeddings, then every DeepStack layer's features
        return torch.cat([features.pooler_output[0], *(layer[0] for layer in deepstack)], dim=-1)


def _load_without_language_model(checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype) -> Any:
    """The checkpoint's own model without its language model and head: only what
    ``get_image_features`` runs (tower, projector or merger) is built and read from the weights.

    transformers builds a model on the meta device and then reads, of the checkpoint, the tensors
    its modules hold (renaming legacy names as it does for the whole model); here the modules go
    before the reading, so the language model's weights are never read, nor held in any process
    that encodes, and non-persistent buffers (rotary frequencies) are set up as usual.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    classes: Any = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
    model = _without_language_model(classes[type(checkpoint.config)])
    return model.from_pretrained(checkpoint.path, dtype=dtype).to(device).eval()


def _without_language_model(base: Any) -> Any:
    """``base`` (a transformers image-text-to-text class) whose instances drop their decoder and
    output head as soon as they are built."""

    def __init__(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, config, *args, **kwargs)
        dropped = []
        for part in (self.get_decoder(), self.get_output_embeddings()):
            name = next((n for n, m in self.named_modules() if m is part and n), None)
            if name is not None:
                parent, _, attr = name.rpartition(".")
                setattr(self.get_submodule(parent), attr, None)
                dropped.append(name)
        self.all_tied_weights_keys = {}  # the head tied to the embeddings went with them
        # the checkpoint's tensors of the dropped parts are expected to go unread, not reported
        self._keys_to_ignore_on_load_unexpected = {rf"^{re.escape(name)}\." for name in dropped}

    # named and placed as the base, so transformers applies the base's checkpoint conversions
    # (it skips those for classes defined outside transformers)
    return type(base.__name__, (base,), {"__init__": __init__, "__module__": base.__module__})


def _load(module: nn.Module, weights: dict[str, torch.Tensor], name: str) -> None:
    missing, unexpected = module.load_state_dict(weights, strict=False)
    # rotary inverse frequencies are buffers the tower computes itself
    missing = [m for m in missing if "inv_freq" not in m]
    if missing or unexpected:
        raise ValueError(f"{name} weights do not match: missing {missing[:5]}, unexpected {unexpected[:5]}")
