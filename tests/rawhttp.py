"""HTTP/1.1 written and read at the socket level, for bytes no HTTP client would send."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import anyio
from anyio.abc import SocketStream


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str] = field(default_factory=dict)  # names in lower case
    body: bytes = b""

    def json(self) -> Any:
        return json.loads(self.body)


def address(base: str) -> tuple[str, int]:
    """``(host, port)`` of a base URL such as ``http://127.0.0.1:8080``."""
    parts = urlsplit(base)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def request_bytes(method: str, path: str, headers: dict[str, bytes | str], body: bytes = b"") -> bytes:
    """One request as bytes; ``Host`` and ``Content-Length`` are added unless given."""
    lines = [f"{method} {path} HTTP/1.1".encode()]
    given = {name.lower() for name in headers}
    if "host" not in given:
        lines.append(b"Host: 127.0.0.1")
    if "content-length" not in given and "transfer-encoding" not in given and (body or method == "POST"):
        lines.append(b"Content-Length: " + str(len(body)).encode())
    for name, value in headers.items():
        lines.append(name.encode() + b": " + (value if isinstance(value, bytes) else value.encode()))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


async def read_response(stream: SocketStream, *, head_only: bool = False, interim: bool = False) -> RawResponse:
    """Read one final response (``Content-Length`` framed, or up to the close) from ``stream``,
    skipping interim ones (``100 Continue``); ``interim``: the status of the first response alone,
    interim or not; ``head_only``: the answer to a HEAD request (a ``Content-Length`` but no body)."""
    data = b""
    while True:
        while b"\r\n\r\n" not in data:
            try:
                data += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                raise ConnectionError(f"closed before a whole response head: {data!r}") from None
        head, _, body = data.partition(b"\r\n\r\n")
        if interim or not head.startswith(b"HTTP/1.1 1"):
            break
        data = body  # an interim response: the final one follows
    if interim:
        return RawResponse(int(head.split()[1]))
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = "0" if head_only else headers.get("content-length")
    while length is None or len(body) < int(length):
        try:
            body += await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            if length is None:
                break
            raise
    return RawResponse(int(status_line.split()[1]), headers, body)


async def exchange(base: str, raw: bytes) -> RawResponse:
    """Send ``raw`` on a new connection to ``base`` and read one response."""
    host, port = address(base)
    async with await anyio.connect_tcp(host, port) as stream:
        await stream.send(raw)
        return await read_response(stream, head_only=raw.startswith(b"HEAD "))
