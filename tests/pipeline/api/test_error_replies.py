"""An error that becomes a reply lets go of its frames: kept, a frame that awaited it (and held the
request's body) sat in a reference cycle with it until the cyclic collector next ran."""

from __future__ import annotations

import gc
import json
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from pipeline.api.replies import error_reply
from pipeline.errors import InvalidRequest, Overloaded


class Body:
    """Stands for a request's body: something a frame holds, that can be watched for its end."""


@contextmanager
def no_cyclic_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def refused(body: Body) -> InvalidRequest:
    """An error raised from another and caught where ``body`` is a local: the caught error's frames
    hold ``body``, and the frame holds the error (the cycle an awaited future makes)."""
    try:
        try:
            raise ValueError("the parser's own error")
        except ValueError as cause:
            raise InvalidRequest("'messages' must be a list", field="messages") from cause
    except InvalidRequest as exc:
        caught = exc
    return caught


def test_an_error_reply_lets_go_of_the_frames_that_held_the_body() -> None:
    with no_cyclic_collector():
        body = Body()
        watched = weakref.ref(body)
        error = refused(body)
        del body
        assert watched() is not None  # held by the error's frames
        reply = error_reply(error)
        assert error.__traceback__ is None and error.__cause__ is not None and error.__cause__.__traceback__ is None
        del error
        assert watched() is None  # gone at once, without the collector
    assert reply.status == 400 and json.loads(reply.body)["error"]["param"] == "messages"


def test_an_overload_reply_still_says_when_to_retry() -> None:
    reply = error_reply(Overloaded("full", retry_after=2.4))
    assert reply.status == 429 and reply.headers["Retry-After"] == "2"
