"""Bounded request preparation and guided decoding for vision-language model serving."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.config import PipelineConfig
from pipeline.errors import PipelineError

if TYPE_CHECKING:
    from pipeline.core.pipeline import Pipeline

__all__ = ["Pipeline", "PipelineConfig", "PipelineError"]


def __getattr__(name: str) -> Any:
    # Pipeline pulls in torch and every stage; the stages themselves import pipeline.config and
    # pipeline.errors, so importing it eagerly here would be circular.
    if name == "Pipeline":
        from pipeline.core.pipeline import Pipeline

        return Pipeline
    raise AttributeError(name)
