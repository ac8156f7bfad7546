"""The Ray Serve ingress reads a request body under the aiohttp server's body deadline: a body that
stalls is refused with a 408 after ``timeout_s``, one that keeps arriving earns its time, and the
size cap still holds. The body comes from a scripted ASGI ``receive``, as Ray's proxy would send it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

pytest.importorskip("ray.serve")  # its first import warns (pydantic), which importorskip lets pass
from starlette.requests import Request  # noqa: E402  (with ray)

from pipeline.errors import InvalidRequest, PayloadTooLarge  # noqa: E402
from pipeline.scaleout.ingress import _read_body  # noqa: E402


def _request(chunks: list[bytes], gap_s: float, then_stall: bool) -> Request:
    """A POST whose body arrives as ``chunks``, ``gap_s`` apart; then its end, or nothing ever again."""
    sent = iter(chunks)

    async def receive() -> dict[str, Any]:
        chunk = next(sent, None)
        if chunk is None:
            if then_stall:
                await anyio.sleep_forever()
            return {"type": "http.request", "body": b"", "more_body": False}
        await anyio.sleep(gap_s)  # noqa: sleep-ok  (a body that trickles in: the deadline is about elapsed time)
        return {"type": "http.request", "body": chunk, "more_body": True}

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    return Request(scope, receive)


async def _refusal(read: Callable[[], Awaitable[bytes]]) -> Exception:
    with pytest.raises((InvalidRequest, PayloadTooLarge)) as caught:
        await read()
    return caught.value


@pytest.mark.anyio
async def test_a_stalled_body_is_refused_with_a_408() -> None:
    request = _request([b"x" * 10], 0, then_stall=True)
    with anyio.fail_after(10):
        error = await _refusal(lambda: _read_body(request, 1 << 20, timeout_s=0.2, rate=64 * 1024))
    assert isinstance(error, InvalidRequest) and error.status == 408 and error.field == "body"


@pytest.mark.anyio
async def test_a_body_that_keeps_arriving_earns_its_time() -> None:
    """Twenty 1,000-byte chunks 0.05 s apart (1 s in all) under a 0.5 s deadline: each chunk earns
    0.2 s more at 5,000 bytes a second, so the body is read whole (without what they earn, it would be
    refused halfway)."""
    chunks = [bytes([i]) * 1000 for i in range(20)]
    request = _request(chunks, 0.05, then_stall=False)
    with anyio.fail_after(10):
        body = await _read_body(request, 1 << 20, timeout_s=0.5, rate=5000)
    assert body == b"".join(chunks)


@pytest.mark.anyio
async def test_a_timeout_of_ray_s_own_is_not_the_client_s() -> None:
    """Ray's errors of its own (``GetTimeoutError`` and others) are ``TimeoutError``s: one raised while
    the body is read is not taken for the body deadline's 408."""

    async def receive() -> dict[str, Any]:
        raise TimeoutError("the proxy did not answer")

    request = Request({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}, receive)
    with anyio.fail_after(10), pytest.raises(TimeoutError, match="the proxy did not answer"):
        await _read_body(request, 1 << 20, timeout_s=5, rate=64 * 1024)


def test_a_deadline_that_is_not_positive_is_refused_at_build() -> None:
    from pipeline.scaleout.ray_serve import build_app

    with pytest.raises(ValueError, match="body_timeout_rate"):
        build_app(body_timeout_rate=0)


@pytest.mark.anyio
async def test_the_size_cap_still_holds() -> None:
    request = _request([b"x" * 600, b"x" * 600], 0, then_stall=False)
    with anyio.fail_after(10):
        error = await _refusal(lambda: _read_body(request, 1000, timeout_s=5, rate=64 * 1024))
    assert isinstance(error, PayloadTooLarge)
