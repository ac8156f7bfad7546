"""The vision encoder loads the checkpoint's model without its language model: none of the language
model's or head's tensors is read from the weights, and the encodings equal the whole model's
``get_image_features`` exactly."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.images import make_image
from vision.checkpoint import Checkpoint
from vision.encoder import VisionEncoder
from vision.preprocess import preprocess_image

FamilyDir = Callable[[str], Path]


class _Slice:
    """A lazy safetensors slice that records its name once its data is read."""

    def __init__(self, inner: Any, name: str, read: set[str]) -> None:
        self._inner, self._name, self._read = inner, name, read

    def __getitem__(self, index: Any) -> Any:
        self._read.add(self._name)
        return self._inner[index]

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)


class _File:
    def __init__(self, inner: Any, read: set[str]) -> None:
        self._inner, self._read = inner, read

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self._inner.get_slice(name), name, self._read)

    def get_tensor(self, name: str) -> Any:
        self._read.add(name)
        return self._inner.get_tensor(name)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)


@contextmanager
def _reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[str]]:
    """The names of the checkpoint tensors transformers reads while the block runs."""
    import transformers.modeling_utils as modeling_utils

    read: set[str] = set()
    real = modeling_utils.safe_open
    with monkeypatch.context() as patch:
        patch.setattr(modeling_utils, "safe_open", lambda *a, **k: _File(real(*a, **k), read))
        yield read


@pytest.mark.parametrize("family", ["mistral3", "llava-clip", "gemma3-vlm"])
def test_the_encoder_reads_no_language_model_weights_and_encodes_as_the_whole_model(
    family: str, family_dir: FamilyDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForImageTextToText

    checkpoint = Checkpoint(family_dir(family))
    with _reads(monkeypatch) as read:
        encoder = VisionEncoder(checkpoint)
    assert encoder.model is not None  # these families encode through the model's get_image_features
    names = [name for name, _ in encoder.model.named_parameters()]
    assert names and not [n for n in names if "language_model" in n or n.startswith("lm_head")]
    # the spy sees the reads (the checkpoint keeps the legacy names transformers renames on load)
    assert [n for n in read if n.startswith("vision_tower.")] and [n for n in read if "multi_modal_projector" in n]
    assert not [n for n in read if "language_model" in n or "lm_head" in n]

    whole = AutoModelForImageTextToText.from_pretrained(checkpoint.path, dtype=torch.float32).eval()
    whole_parameters = dict(whole.named_parameters())
    assert sorted(names) == sorted(n for n in whole_parameters if n.startswith("model.") and "language_model" not in n)
    image = preprocess_image(checkpoint.image_processor, make_image(96, 64, seed=3))
    assert image.pixel_values is not None
    pixels = image.pixel_values[None]
    sizes = {"image_sizes": torch.tensor([pixels.shape[2:]])} if encoder.takes_sizes else {}
    with torch.inference_mode():
        expected = whole.get_image_features(pixel_values=pixels, **sizes).pooler_output[0]
    (encoded,) = encoder.encode([image])
    assert torch.equal(encoded, expected)
