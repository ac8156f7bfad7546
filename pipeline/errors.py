"""The error hierarchy of the pipeline: the public import path (``from pipeline.errors import InvalidRequest``).

Import-free, so the lower layers (``stages``, ``vision``, ``sampling``) raise these too (``make check``
enforces it). Each error carries its HTTP ``status``, the ``stage`` it was raised in and the ``request_id``
of the request it ended (filled in by the pipeline when a stage does not know it)::

    PipelineError (500)
    ├── InvalidRequest (400)            bad input; ``field`` names the offending field
    │   ├── ImageFetchError (400)       URL refused, unreachable, wrong content type
    │   ├── ImageDecodeError (400)      bytes that are not a supported image, or one the model cannot take
    │   ├── GrammarError (400)          schema/regex/grammar that cannot be compiled
    │   │   └── UnsupportedSchemaError (400)   keywords no backend nor the answer check can hold
    │   ├── PromptTooLong (400)         over max_model_len, or more KV cache than the whole cache holds
    │   ├── ModelNotFound (404)         a ``model`` this server does not serve
    │   ├── RouteNotFound (404)         no such path
    │   └── MethodNotAllowed (405)
    ├── AuthenticationFailed (401)      no API key, or the wrong one
    ├── PayloadTooLarge (413)           a body, image bytes or pixels over the configured cap
    ├── Overloaded (429)                pipeline full; ``retry_after`` seconds
    │   ├── ShuttingDown (503)
    │   └── EngineFailed (503)          the engine process died or hung holding the request; retry
    ├── DeadlineExceeded (504)          a configured deadline passed (fetch, grammar compile, a stuck worker)
    ├── WorkerCrashed (500)             a preparation worker process died holding the request's image
    ├── ReplicaFailed (502)             a serving replica died holding the request (scale-out only)
    ├── RequestCancelled (499)          the caller cancelled or disconnected
    ├── EngineError (500)               the decode engine failed this sequence
    └── InvalidAnswer (422)             no attempt's answer passed the whole constraint; ``path``
                                        points into the last answer where it broke

``to_dict()`` is OpenAI's error object; its ``code`` is a string, as OpenAI's is (the class's
``code``: ``context_length_exceeded``, ``model_not_found``, ``invalid_api_key``, ...).
"""

from __future__ import annotations

__all__ = [
    "AuthenticationFailed",
    "DeadlineExceeded",
    "EngineError",
    "EngineFailed",
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


class PipelineError(Exception):
    """Base of every error the pipeline raises on purpose."""

    status: int = 500
    error_type: str = "internal_error"
    code: str = "internal_error"

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
        """OpenAI's error object shape (``{"message", "type", "param", "code"}``); a message or field
        that quotes the client at length (a 100 KB model name, a 400-digit number) is clipped."""
        return {
            "message": _clipped(self.message),
            "type": self.error_type,
            "param": _clipped(self.field),
            "code": self.code,
            "stage": self.stage,
            "request_id": self.request_id,
        }

    def __str__(self) -> str:
        where = f" [{self.field}]" if self.field else ""
        return f"{self.message}{where}"


# what an error reply quotes of the client's input at most: enough to recognise any value
_QUOTED_CHARS = 1000


def _clipped(text: str | None) -> str | None:
    """``text`` with its middle cut when it is long (the quote is there; what the message says after
    it, such as the names a server does serve, too)."""
    if text is None or len(text) <= _QUOTED_CHARS:
        return text
    half = _QUOTED_CHARS // 2
    return f"{text[:half]}... ({len(text) - 2 * half} characters cut) ...{text[-half:]}"


class InvalidRequest(PipelineError):
    status = 400
    error_type = "invalid_request_error"
    code = "invalid_request"


class ImageFetchError(InvalidRequest):
    code = "image_fetch_failed"


class ImageDecodeError(InvalidRequest):
    code = "invalid_image"


class GrammarError(InvalidRequest):
    code = "invalid_constraint"


class UnsupportedSchemaError(GrammarError):
    code = "unsupported_schema"

    def __init__(self, message: str, *, keywords: list[str] | None = None, **kwargs: str | None) -> None:
        super().__init__(message, **kwargs)
        self.keywords = keywords or []


class PromptTooLong(InvalidRequest):
    code = "context_length_exceeded"


class ModelNotFound(InvalidRequest):
    status = 404
    code = "model_not_found"


class RouteNotFound(InvalidRequest):
    status = 404
    code = "not_found"


class MethodNotAllowed(InvalidRequest):
    status = 405
    code = "method_not_allowed"


class AuthenticationFailed(PipelineError):
    status = 401
    error_type = "invalid_request_error"
    code = "invalid_api_key"


class PayloadTooLarge(PipelineError):
    status = 413
    error_type = "payload_too_large"
    code = "payload_too_large"


class Overloaded(PipelineError):
    status = 429
    error_type = "overloaded"
    code = "overloaded"

    def __init__(self, message: str, *, retry_after: float = 1.0, **kwargs: str | None) -> None:
        super().__init__(message, **kwargs)
        self.retry_after = retry_after


class ShuttingDown(Overloaded):
    status = 503
    error_type = "shutting_down"
    code = "shutting_down"


class EngineFailed(Overloaded):
    """The engine process died (killed, out of memory, a native crash) or stopped making progress while
    it held the request, or is being started again after that: retry (``Retry-After`` says when)."""

    status = 503
    error_type = "engine_failed"
    code = "engine_failed"


class DeadlineExceeded(PipelineError):
    status = 504
    error_type = "deadline_exceeded"
    code = "deadline_exceeded"


class WorkerCrashed(PipelineError):
    """A preparation worker process died holding the request's work (only that work fails)."""

    status = 500
    error_type = "worker_crashed"


class ReplicaFailed(PipelineError):
    """A serving replica died, or could not be reached, while it held the request (scale-out only):
    the request was not retried because part of its answer had already left."""

    status = 502
    error_type = "replica_failed"
    code = "replica_failed"


class RequestCancelled(PipelineError):
    status = 499
    error_type = "cancelled"
    code = "cancelled"


class EngineError(PipelineError):
    status = 500
    error_type = "engine_error"
    code = "engine_error"


class InvalidAnswer(PipelineError):
    """Every attempt at a structured answer failed the answer check (never passed off as valid)."""

    status = 422
    error_type = "invalid_answer"
    code = "invalid_answer"

    def __init__(self, message: str, *, path: str = "", reason: str = "", **kwargs: str | None) -> None:
        super().__init__(message, **kwargs)
        self.path = path  # JSON pointer into the answer ("" for the whole text)
        self.reason = reason  # what failed: "json", a schema keyword, "regex", "choice", "grammar"

    def to_dict(self) -> dict[str, object]:
        return {**super().to_dict(), "path": self.path, "reason": self.reason}
