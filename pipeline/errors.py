"""The one error hierarchy of the pipeline.

Every error carries the HTTP ``status`` it maps to, the ``stage`` it was raised in and the
``request_id`` of the request it ended (filled in by the pipeline when a stage does not know it)::

    PipelineError (500)
    ├── InvalidRequest (400)            bad input; ``field`` names the offending field
    │   ├── ImageFetchError (400)       URL refused, unreachable, wrong content type
    │   ├── ImageDecodeError (400)      bytes that are not a supported image
    │   ├── GrammarError (400)          schema/regex/grammar that cannot be compiled
    │   │   └── UnsupportedSchemaError (400)   keywords xgrammar would silently ignore
    │   └── PromptTooLong (400)
    ├── PayloadTooLarge (413)           image bytes or pixels over the configured cap
    ├── Overloaded (429)                pipeline full; ``retry_after`` seconds
    │   └── ShuttingDown (503)
    ├── DeadlineExceeded (504)          a configured deadline passed (fetch, grammar compile)
    ├── RequestCancelled (499)          the caller cancelled or disconnected
    └── EngineError (500)               the decode engine failed this sequence
"""

from __future__ import annotations

__all__ = [
    "DeadlineExceeded",
    "EngineError",
    "GrammarError",
    "ImageDecodeError",
    "ImageFetchError",
    "InvalidRequest",
    "Overloaded",
    "PayloadTooLarge",
    "PipelineError",
    "PromptTooLong",
    "RequestCancelled",
    "ShuttingDown",
    "UnsupportedSchemaError",
]


class PipelineError(Exception):
    """Base of every error the pipeline raises on purpose."""

    status: int = 500
    error_type: str = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        stage: str | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.stage = stage
        self.request_id = request_id

    def bind(self, *, stage: str | None = None, request_id: str | None = None) -> PipelineError:
        """Fill in stage and request id where the raiser did not know them; returns self."""
        if self.stage is None:
            self.stage = stage
        if self.request_id is None:
            self.request_id = request_id
        return self

    def to_dict(self) -> dict[str, object]:
        """OpenAI's error object shape (``{"message", "type", "param", "code"}``)."""
        return {
            "message": self.message,
            "type": self.error_type,
            "param": self.field,
            "code": self.status,
            "stage": self.stage,
            "request_id": self.request_id,
        }

    def __str__(self) -> str:
        where = f" [{self.field}]" if self.field else ""
        return f"{self.message}{where}"


class InvalidRequest(PipelineError):
    status = 400
    error_type = "invalid_request_error"


class ImageFetchError(InvalidRequest):
    pass


class ImageDecodeError(InvalidRequest):
    pass


class GrammarError(InvalidRequest):
    pass


class UnsupportedSchemaError(GrammarError):
    def __init__(self, message: str, *, keywords: list[str] | None = None, **kwargs: str | None) -> None:
        super().__init__(message, **kwargs)
        self.keywords = keywords or []


class PromptTooLong(InvalidRequest):
    pass


class PayloadTooLarge(PipelineError):
    status = 413
    error_type = "payload_too_large"


class Overloaded(PipelineError):
    status = 429
    error_type = "overloaded"

    def __init__(self, message: str, *, retry_after: float = 1.0, **kwargs: str | None) -> None:
        super().__init__(message, **kwargs)
        self.retry_after = retry_after


class ShuttingDown(Overloaded):
    status = 503
    error_type = "shutting_down"


class DeadlineExceeded(PipelineError):
    status = 504
    error_type = "deadline_exceeded"


class RequestCancelled(PipelineError):
    status = 499
    error_type = "cancelled"


class EngineError(PipelineError):
    status = 500
    error_type = "engine_error"
