"""The core: the ``Pipeline`` (start/stop, admission, ``submit()``), the staged queue its preparation
runs through, request handles, the answer gate and the construction of the stages and the engine.

Below it sit the wire protocol (``pipeline.protocol``) and observability; above it the HTTP API
(``pipeline.api``) and scale-out (``pipeline.scaleout``). ``make check`` holds the direction.
"""

from __future__ import annotations

from pipeline.core.answer_gate import AnswerGate
from pipeline.core.choice import Choice, Delta, Result
from pipeline.core.handle import RequestHandle
from pipeline.core.pipeline import Pipeline
from pipeline.core.staged import Job, StageWorkers

__all__ = ["AnswerGate", "Choice", "Delta", "Job", "Pipeline", "RequestHandle", "Result", "StageWorkers"]
