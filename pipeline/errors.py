"""The error hierarchy of the pipeline (defined in ``pipeline.types``, drawn in its docstring).

This is the public import path: ``from pipeline.errors import InvalidRequest``.
"""

from __future__ import annotations

from pipeline.types import (
    AuthenticationFailed,
    DeadlineExceeded,
    EngineError,
    GrammarError,
    ImageDecodeError,
    ImageFetchError,
    InvalidAnswer,
    InvalidRequest,
    MethodNotAllowed,
    ModelNotFound,
    Overloaded,
    PayloadTooLarge,
    PipelineError,
    PromptTooLong,
    ReplicaFailed,
    RequestCancelled,
    RouteNotFound,
    ShuttingDown,
    UnsupportedSchemaError,
    WorkerCrashed,
)

__all__ = [
    "AuthenticationFailed",
    "DeadlineExceeded",
    "EngineError",
    "GrammarError",
    "ImageDecodeError",
    "ImageFetchError",
    "InvalidAnswer",
    "InvalidRequest",
    "MethodNotAllowed",
    "ModelNotFound",
    "Overloaded",
    "PayloadTooLarge",
    "PipelineError",
    "PromptTooLong",
    "ReplicaFailed",
    "RequestCancelled",
    "RouteNotFound",
    "ShuttingDown",
    "UnsupportedSchemaError",
    "WorkerCrashed",
]
