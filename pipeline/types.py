"""The import-free module of shared types and errors: the one part of ``pipeline`` that the lower
layers (``stages``, ``vision``, ``sampling``) may import (``make check`` enforces it).

It holds the error hierarchy, the parts of a chat request the stages read, the structured-output
constraint (``GrammarSpec``), and the two ways to wait for work done elsewhere: ``Outcome[T]`` (one
result or one error, set once) and ``Mailbox[T]`` (items in order until closed, then an error or
the end). Errors, drawn once; each carries its HTTP ``status``, the ``stage`` it was raised in and
the ``request_id`` of the request it ended (filled in by the pipeline when a stage does not know
it)::

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
    │   └── ShuttingDown (503)
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

import enum
import json
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import anyio

__all__ = [
    "AuthenticationFailed",
    "DeadlineExceeded",
    "EngineError",
    "GrammarError",
    "GrammarKind",
    "GrammarSpec",
    "ImageDecodeError",
    "ImageFetchError",
    "ImagePart",
    "InvalidAnswer",
    "InvalidRequest",
    "Mailbox",
    "Message",
    "MethodNotAllowed",
    "ModelNotFound",
    "Outcome",
    "OutcomeState",
    "Overloaded",
    "PayloadTooLarge",
    "PipelineError",
    "PromptTooLong",
    "ReplicaFailed",
    "RequestCancelled",
    "RouteNotFound",
    "ShuttingDown",
    "TextPart",
    "UnsupportedSchemaError",
    "WorkerCrashed",
]

T = TypeVar("T")
GrammarKind = Literal["json_schema", "json_object", "regex", "grammar", "choice", "structural_tag"]


# -- errors ---------------------------------------------------------------------------------------
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
        """OpenAI's error object shape (``{"message", "type", "param", "code"}``)."""
        return {
            "message": self.message,
            "type": self.error_type,
            "param": self.field,
            "code": self.code,
            "stage": self.stage,
            "request_id": self.request_id,
        }

    def __str__(self) -> str:
        where = f" [{self.field}]" if self.field else ""
        return f"{self.message}{where}"


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


# -- request parts the stages read -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TextPart:
    text: str


@dataclass(frozen=True, slots=True)
class ImagePart:
    url: str
    field: str  # where the URL sat in the body, for error messages
    index: int  # position of this image among the request's images


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    parts: tuple[TextPart | ImagePart, ...]
    # an assistant's earlier calls: (id, function name, arguments JSON text), ids as the template takes them
    tool_calls: tuple[tuple[str, str, str], ...] = ()
    tool_call_id: str | None = None  # a tool message: the call it answers


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A structured-output constraint; ``key`` is canonical, so equal constraints share a cache entry."""

    kind: GrammarKind
    value: Any  # schema dict (json_schema), None (json_object), str (regex/grammar), list[str] (choice)
    strict: bool = True
    field: str = "response_format"

    @property
    def key(self) -> str:
        body = json.dumps(self.value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return f"{self.kind}:{int(self.strict)}:{body}"


# -- waiting for work done elsewhere ----------------------------------------------------------------
class OutcomeState(enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Outcome(Generic[T]):
    """One result or one error, set once; any number of tasks wait for it.

    The first ``set_result``/``fail``/``cancel`` wins and later ones are ignored, so racing
    producers (a stage failing a job while its requester cancels it) end it exactly once.
    """

    __slots__ = ("_done", "_error", "_result", "state")

    def __init__(self) -> None:
        self.state = OutcomeState.PENDING
        self._result: T | None = None
        self._error: BaseException | None = None
        self._done = anyio.Event()

    @property
    def is_done(self) -> bool:
        return self.state is not OutcomeState.PENDING

    @property
    def error(self) -> BaseException | None:
        return self._error

    def set_result(self, result: T) -> bool:
        """Complete with ``result``; False when the outcome was already set."""
        return self._end(OutcomeState.COMPLETED, result, None)

    def fail(self, error: BaseException) -> bool:
        return self._end(OutcomeState.FAILED, None, error)

    def cancel(self, error: BaseException) -> bool:
        return self._end(OutcomeState.CANCELLED, None, error)

    def _end(self, state: OutcomeState, result: T | None, error: BaseException | None) -> bool:
        if self.state is not OutcomeState.PENDING:
            return False
        self.state, self._result, self._error = state, result, error
        self._done.set()
        return True

    async def wait(self) -> None:
        """Return once the outcome is set (whatever it is)."""
        await self._done.wait()

    def get(self) -> T:
        """The result of a set outcome. :raises: its error."""
        if self.state is OutcomeState.PENDING:
            raise RuntimeError("the outcome is not set yet")
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]

    async def result(self) -> T:
        """Wait, then the result. :raises: the outcome's error."""
        await self._done.wait()
        return self.get()


class Mailbox(Generic[T]):
    """Items in arrival order for one reader, then the end: closed cleanly or with an error.

    ``put`` never blocks (the producer bounds what it puts: ``max_tokens * n`` deltas at most), so
    an engine thread delivering through ``call_soon_threadsafe`` can never stall on a slow reader.
    """

    __slots__ = ("_closed", "_error", "_items", "_wakeup")

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._wakeup = anyio.Event()
        self._closed = False
        self._error: BaseException | None = None

    def put(self, item: T) -> None:
        if self._closed:
            return  # late items after an abort or failure are dropped
        self._items.append(item)
        self._wakeup.set()

    def close(self, error: BaseException | None = None) -> None:
        """No more items; a reader gets those queued, then ``error`` raised (or the end)."""
        if not self._closed:
            self._closed, self._error = True, error
            self._wakeup.set()

    @property
    def is_closed(self) -> bool:
        return self._closed

    def __aiter__(self) -> AsyncIterator[T]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[T]:
        while True:
            while self._items:
                yield self._items.popleft()
            if self._closed:
                if self._error is not None:
                    raise self._error
                return
            self._wakeup = anyio.Event()
            await self._wakeup.wait()
