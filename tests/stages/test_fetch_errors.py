"""A remote image server's bytes never reach our error messages: each failure is our own sentence.

Raw asyncio servers on 127.0.0.1 answer with what an aiohttp server would refuse to write: a broken
status line, a broken chunk size, a cut body, a control character in a Location or a content type.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest

from pipeline.errors import ImageFetchError
from stages.fetch import FetchStage
from stages.fetch_errors import remote_text, status_reason
from stages.fetch_policy import AddressPolicy

FIELD = "messages[0].content[1].image_url.url"
SECRET = b"EVIL\x01SECRET"  # what the remote side writes; none of it may be quoted back

ANSWERS = {
    "status line": (b"HTTP/1.1 2x0 " + SECRET + b"\r\n\r\n", "the server's answer is not valid HTTP"),
    "not http": (b"\x00\x01" + SECRET + b"\r\n\r\n", "the server's answer is not valid HTTP"),
    "chunk size": (
        b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nTransfer-Encoding: chunked\r\n\r\n" + SECRET + b"\r\nabc\r\n",
        "the server's answer is not valid HTTP",
    ),
    "cut body": (
        b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: 100\r\n\r\n" + SECRET,
        "the server's answer broke off, or its body is not valid HTTP",
    ),
    "reason phrase": (b"HTTP/1.1 404 " + SECRET + b"\r\nContent-Length: 0\r\n\r\n", "HTTP 404 (a client error)"),
    "server error": (b"HTTP/1.1 503 " + SECRET + b"\r\nContent-Length: 0\r\n\r\n", "HTTP 503 (a server error)"),
    "content type": (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/" + SECRET + b"\r\nContent-Length: 0\r\n\r\n",
        "content type (not shown: long or not printable) is not an image",
    ),
    "location": (
        b"HTTP/1.1 302 Found\r\nLocation: http://[" + SECRET + b"\r\nContent-Length: 0\r\n\r\n",
        "malformed redirect Location (not shown: long or not printable)",
    ),
    "closed": (b"", "the server closed the connection before it answered"),
}


@asynccontextmanager
async def answering(raw: bytes) -> AsyncIterator[str]:
    """A server on 127.0.0.1 that reads a request's head and writes ``raw``; yields an image URL."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(raw)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/a.png"
    finally:
        server.close()
        await server.wait_closed()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the raw servers are asyncio's


@pytest.mark.parametrize("name", sorted(ANSWERS))
async def test_remote_bytes_are_not_quoted_in_the_error(name: str) -> None:
    raw, expected = ANSWERS[name]
    async with FetchStage(policy=AddressPolicy(allow_private=True), total_timeout_s=5) as stage, answering(raw) as url:
        with anyio.fail_after(5), pytest.raises(ImageFetchError) as info:
            await stage.run(url, field=FIELD)
    error = info.value
    assert (error.status, error.field, error.stage) == (400, FIELD, "fetch")
    assert expected in error.message, error.message
    assert "EVIL" not in error.message and "SECRET" not in error.message, error.message
    assert url in error.message  # the client's own URL names the image


def test_remote_text_is_shown_only_when_short_and_printable() -> None:
    assert remote_text("image/svg+xml", quoted=True) == "'image/svg+xml'"
    assert remote_text("https://example.com/a.png") == "https://example.com/a.png"
    assert remote_text("a\x01b").startswith("(not shown")
    assert remote_text("x" * 129).startswith("(not shown")
    assert remote_text("caf\u00e9").startswith("(not shown")
    assert status_reason(301) == "the server answered HTTP 301 (not an image)"
