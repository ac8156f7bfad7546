"""Why a remote image could not be fetched, in words of our own: never the bytes its server sent.

aiohttp's exceptions quote what the remote server wrote (a status line, a chunk size, a header
value: ``Bad status line: b'HTTP/1.1 2x0 EVIL\\x01...'``), and whoever controls an image URL controls
those bytes; passed on, they would reach the client in our error body, and its logs. So each kind of
failure is one fixed sentence, with at most its status code, and text from the remote side (a
content type, a redirect's ``Location``) is shown only when it is short printable ASCII.
"""

from __future__ import annotations

import re

import aiohttp

__all__ = ["client_error_reason", "remote_text", "status_reason"]

_PRINTABLE = re.compile(r"[\x20-\x7e]*")
_MAX_SHOWN = 128


def remote_text(text: str, *, quoted: bool = False) -> str:
    """``text`` from the remote side (``quoted``: in quotes) when it is short printable ASCII; else a
    placeholder."""
    if len(text) <= _MAX_SHOWN and _PRINTABLE.fullmatch(text):
        return repr(text) if quoted else text
    return "(not shown: long or not printable)"


def status_reason(status: int) -> str:
    """A non-200 answer, by its code and class (the reason phrase is the server's text, not shown)."""
    kind = "a client error" if 400 <= status < 500 else "a server error" if 500 <= status < 600 else "not an image"
    return f"the server answered HTTP {status} ({kind})"


def client_error_reason(exc: aiohttp.ClientError) -> str:
    """What went wrong, by ``exc``'s kind alone (its message may quote the remote server's bytes)."""
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return "cannot connect: the server's TLS certificate was not accepted"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect ({exc.os_error.strerror or type(exc.os_error).__name__})"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the server closed the connection before it answered"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "the server's answer broke off, or its body is not valid HTTP"
    if isinstance(exc, aiohttp.ClientResponseError):
        return "the server's answer is not valid HTTP"
    if isinstance(exc, aiohttp.ClientOSError):
        return f"the connection failed ({exc.strerror or 'connection error'})"
    return f"the request failed ({type(exc).__name__})"
