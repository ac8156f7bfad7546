"""The core: the ``Pipeline`` (start/stop, admission, ``submit()``), the staged queue its preparation
runs through, the preparation steps and what a start loads.

Below it sit the answer's assembly (``pipeline.answer``), the engine (``pipeline.engine``), the stage
factory, the wire protocol (``pipeline.protocol``) and observability; above it the HTTP API
(``pipeline.api``) and scale-out (``pipeline.scaleout``). ``make check`` holds the direction.
"""

from __future__ import annotations

from pipeline.core.pipeline import Pipeline
from pipeline.core.staged import Job, StageWorkers

__all__ = ["Job", "Pipeline", "StageWorkers"]
