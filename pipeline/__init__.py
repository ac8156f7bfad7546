"""Bounded request preparation and guided decoding for vision-language model serving."""

from __future__ import annotations

from pipeline.config import PipelineConfig
from pipeline.errors import PipelineError

__all__ = ["PipelineConfig", "PipelineError"]
