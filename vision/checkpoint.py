"""Reads a Hugging Face checkpoint folder: config, tokenizer, image processor, weights by prefix.

The embedded default model and a user's checkpoint go through this same code.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from vision.default_checkpoint import ensure_default_checkpoint
from vision.model_source import ModelUnavailable, ResolvedModel, resolve_model

__all__ = ["Checkpoint", "ModelUnavailable", "open_checkpoint"]


@dataclass
class Checkpoint:
    """One checkpoint folder; every part is loaded on first use and then kept."""

    path: Path
    name: str = ""  # what the model is served as (the name it was asked by); empty: the folder's name
    _weights_by_file: dict[str, list[str]] = field(default_factory=dict, repr=False)

    @cached_property
    def config(self) -> Any:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.path)

    @cached_property
    def text_config(self) -> Any:
        return getattr(self.config, "text_config", self.config)

    @cached_property
    def vision_config(self) -> Any | None:
        return getattr(self.config, "vision_config", None)

    @cached_property
    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)

    @cached_property
    def image_processor(self) -> Any | None:
        """The checkpoint's image processor, None for a model without one."""
        if not self._has_image_processor():
            return None
        from transformers import AutoImageProcessor

        processor = AutoImageProcessor.from_pretrained(self.path)
        pooled = getattr(self.config, "mm_tokens_per_image", None)
        if pooled and self.vision_config is not None:
            # the projector pools the tower's patches to a fixed square of tokens (Gemma 3): the image
            # grid counts those, each this many pixels across
            processor.patch_size = int(self.vision_config.image_size) // math.isqrt(int(pooled))
        if getattr(processor, "patch_size", None) is None and self.vision_config is not None:
            # a fixed-size processor (CLIP) knows no patches: the tower's patch makes the token grid
            processor.patch_size = int(self.vision_config.patch_size)
        merge = getattr(self.config, "spatial_merge_size", None)
        if merge and merge > 1:  # the model's merge of patches into tokens, which the image grid counts in
            processor.spatial_merge_size = int(merge)
        return processor

    def _has_image_processor(self) -> bool:
        if (self.path / "preprocessor_config.json").exists():
            return True
        # transformers 5's processor.save_pretrained writes the image processor's settings inside
        # processor_config.json instead
        combined = self.path / "processor_config.json"
        return combined.exists() and "image_processor" in json.loads(combined.read_text())

    @cached_property
    def stop_token_ids(self) -> list[int]:
        """The ids that end an answer: the tokenizer's eos, then generation_config.json's
        ``eos_token_id`` (an id or a list: chat models end a turn with their own token)."""
        ids = [int(self.tokenizer.eos_token_id)] if self.tokenizer.eos_token_id is not None else []
        generation = self.path / "generation_config.json"
        if generation.exists():
            eos = json.loads(generation.read_text()).get("eos_token_id")
            ids += [int(t) for t in (eos if isinstance(eos, list) else [eos] if eos is not None else [])]
        return list(dict.fromkeys(ids))

    @cached_property
    def image_token_id(self) -> int | None:
        value = getattr(self.config, "image_token_index", None) or getattr(self.config, "image_token_id", None)
        return int(value) if value is not None else None

    @cached_property
    def tokenizer_info(self) -> Any:
        """xgrammar's view of the tokenizer, sized to the model's vocabulary (logits width)."""
        import xgrammar as xgr

        return xgr.TokenizerInfo.from_huggingface(
            self.tokenizer, vocab_size=self.text_config.vocab_size, stop_token_ids=self.stop_token_ids or None
        )

    @cached_property
    def model_name(self) -> str:
        return self.name or self.path.name

    def _weight_files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [self.path / name for name in names]
        single = self.path / "model.safetensors"
        if not single.exists():
            raise FileNotFoundError(f"no safetensors weights in {self.path}")
        return [single]

    def load_weights(self, prefixes: tuple[str, ...], *, device: str = "cpu") -> dict[str, torch.Tensor]:
        """Tensors whose names start with one of ``prefixes``, with that prefix removed."""
        from safetensors import safe_open

        found: dict[str, torch.Tensor] = {}
        for file in self._weight_files():
            with safe_open(str(file), framework="pt", device=device) as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                    for prefix in prefixes:
                        if name.startswith(prefix):
                            found[name[len(prefix) :]] = handle.get_tensor(name)
                            break
        return found


_opened: dict[tuple[Path, str], Checkpoint] = {}
_opened_lock = threading.Lock()


def open_checkpoint(model: str | None, cache_dir: Path) -> Checkpoint:
    """The checkpoint of ``model`` (a folder, a ``.gguf`` file or a Hugging Face name: vision/model_source.py),
    or the embedded default (written once into ``cache_dir``) when None.

    One ``Checkpoint`` per folder, name and process: its loaded parts are read-only and shared, so a
    second pipeline on the same model does not load the tokenizer again.

    :raises ModelUnavailable: if ``model`` cannot be found or read, or is not a folder with a config.json.
    """
    if model is None:
        default = ensure_default_checkpoint(cache_dir).resolve()
        resolved = ResolvedModel(default, default.name)
    else:
        resolved = resolve_model(model, cache_dir)
    if not (resolved.path / "config.json").is_file():
        raise ModelUnavailable(f"model {model!r}: {resolved.path} is not a checkpoint folder (no config.json)")
    with _opened_lock:
        key = (resolved.path, resolved.name)
        return _opened.setdefault(key, Checkpoint(path=resolved.path, name=resolved.name))
