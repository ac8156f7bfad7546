"""The checkpoint's own sampling defaults (``generation_config.json``), for requests that leave a field unset.

Model authors ship the sampling they tuned the model for there (Qwen: temperature 0.7, top_p 0.8,
top_k 20, repetition_penalty 1.05). vLLM applies those fields to every request that does not set
them (``--generation-config auto``, its default) and so does this server; ``--generation-config none``
keeps OpenAI's defaults (temperature 1, top_p 1, no top-k, no penalty). Only the fields vLLM reads
are taken: the rest of the file (``do_sample``, beam search, token ids) is ``generate``'s business.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["NO_DEFAULTS", "SamplingDefaults", "read_generation_config"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """Values a request's unset sampling fields take (None: OpenAI's default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # the file's max_new_tokens

    def as_dict(self) -> dict[str, float | int]:
        """The fields the checkpoint sets, for the start-up log and ``/v1/models``."""
        return {name: value for name in self.__slots__ if (value := getattr(self, name)) is not None}


NO_DEFAULTS = SamplingDefaults()  # OpenAI's defaults for every field

# generation_config.json field -> (SamplingDefaults field, type, lowest, highest) as requests bound them
_FIELDS: dict[str, tuple[str, type, float, float]] = {
    "temperature": ("temperature", float, 0.0, 2.0),
    "top_p": ("top_p", float, 1e-9, 1.0),
    "top_k": ("top_k", int, 0, 1 << 20),
    "min_p": ("min_p", float, 0.0, 1.0),
    "repetition_penalty": ("repetition_penalty", float, 1e-9, 100.0),
    "max_new_tokens": ("max_tokens", int, 1, 1 << 31),
}


def _value(raw: Any, kind: type, low: float, high: float) -> float | int | None:
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw):
        return None
    if kind is int and raw != int(raw):
        return None
    value = kind(raw)
    return value if low <= value <= high else None


def read_generation_config(folder: str | Path | None) -> SamplingDefaults:
    """The sampling defaults of the checkpoint in ``folder`` (none: no file, or a folder of None).

    A value a request could not carry (a temperature of 5, a string) is left out with a warning
    rather than failing the start: the file is the author's, the bounds are the API's.
    """
    if folder is None:
        return SamplingDefaults()
    path = Path(folder) / "generation_config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return SamplingDefaults()
    except (OSError, ValueError) as exc:
        logger.warning("%s is not readable JSON (%s); no sampling defaults taken from it", path, exc)
        return SamplingDefaults()
    if not isinstance(raw, dict):
        return SamplingDefaults()
    found: dict[str, float | int] = {}
    for key, (name, kind, low, high) in _FIELDS.items():
        if key not in raw or raw[key] is None:
            continue
        value = _value(raw[key], kind, low, high)
        if value is None:
            logger.warning("%s: %s=%r is out of the API's bounds; not applied", path, key, raw[key])
            continue
        found[name] = value
    return SamplingDefaults(**found)  # type: ignore[arg-type]  # names and types from _FIELDS
