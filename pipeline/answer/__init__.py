"""A request's answer as it is assembled: the handle a caller streams or awaits, its choices, deltas
and result, the split of tool calls from text, and the gate that lets a structured answer leave only
once its whole text passes its constraint.

Above it sits the core (``pipeline.core``), which prepares what a handle decodes (``PreparedInput``);
below it the wire protocol and observability. It knows nothing of the engine process.
"""

from __future__ import annotations

from pipeline.answer.call_check import with_calls_check
from pipeline.answer.choice import Choice, Delta, Result
from pipeline.answer.handle import PreparedInput, RequestHandle

__all__ = ["Choice", "Delta", "PreparedInput", "RequestHandle", "Result", "with_calls_check"]
