"""Fetch stage: image bytes from ``data:``, ``http(s)`` and (under a media root) local URLs.

One shared aiohttp ``ClientSession``; one deadline across all redirect hops; redirects followed by
hand (each hop re-checked, at most ``max_redirects``); image content types only; the byte cap
enforced while the body streams in; private addresses refused unless allowed (see ``fetch_policy``).
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from urllib.parse import unquote, urlsplit

import aiohttp
import anyio
from yarl import URL

from pipeline.errors import DeadlineExceeded, ImageFetchError, PayloadTooLarge
from stages.data_url_keys import is_data_url
from stages.fetch_errors import client_error_reason, remote_text, status_reason
from stages.fetch_policy import AddressPolicy, AddressRefused, PinnedResolver, Resolver, SystemResolver

__all__ = ["FetchStage"]

_CHUNK = 64 * 1024
_INLINE_BASE64_LIMIT = 256 * 1024  # larger payloads are decoded in a worker thread (rule 1 of the README)
_REDIRECTS = (301, 302, 303, 307, 308)
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
# a host as yarl gives it: a name (IDNA-encoded), an IPv4 address, or an IPv6 one without brackets
_HOST = re.compile(r"[A-Za-z0-9._:%-]+")
# S3 and many CDNs serve uploads as octet-stream; the decode stage checks the bytes themselves
_ACCEPTED_TYPES = ("application/octet-stream",)


def _shown(url: str) -> str:
    limit = 64 if is_data_url(url) else 256
    return url if len(url) <= limit else url[: limit - 3] + "..."


@dataclass(slots=True)
class _HostSlots:
    """One host's share of the fetch slots, and the fetches that hold or wait for it (at 0 it is dropped)."""

    limiter: anyio.CapacityLimiter
    users: int = 0


def _host_key(url: str) -> str:
    """The host and port an http(s) URL names, lower-case; "" for one that does not parse (its fetch
    fails on its own, under the slots of every such URL)."""
    try:
        parsed = URL(url)
        return f"{(parsed.host or '').lower()}:{parsed.port}"
    except ValueError:
        return ""


class FetchStage:
    """Fetches the bytes of image URLs within its limits: ``max_bytes`` per image, ``concurrency``
    fetches at once (``per_request`` of them for one request's images, see ``request_slots``, and
    ``per_host`` for one host's, by the URL a fetch starts from), a connect timeout and one total
    deadline per image (every redirect hop included), ``max_redirects`` hops, private addresses only
    when ``allow_private``, local files only under ``media_root``."""

    name = "fetch"

    def __init__(
        self,
        *,
        max_bytes: int = 20 * 1024 * 1024,
        concurrency: int = 32,
        per_request: int | None = None,
        per_host: int | None = None,
        connect_timeout_s: float = 5.0,
        total_timeout_s: float = 20.0,
        max_redirects: int = 3,
        allow_private: bool = False,
        media_root: str | None = None,
        resolver: Resolver | None = None,
        policy: AddressPolicy | None = None,
    ) -> None:
        self.max_bytes = max_bytes
        self.concurrency = concurrency
        self.per_request = min(per_request or concurrency, concurrency)
        # one host's fetches at once: many requests whose URLs all point at one slow host (a tarpit)
        # take this many slots, not every slot, and other hosts' images are fetched meanwhile
        self.per_host = min(per_host or concurrency, concurrency)
        self._hosts: dict[str, _HostSlots] = {}
        self.connect_timeout_s = connect_timeout_s
        self.total_timeout_s = total_timeout_s
        self.max_redirects = max_redirects
        self.media_root = media_root
        self.limiter = anyio.CapacityLimiter(concurrency)
        # base64 decoding holds the GIL for its whole call (~1 ms per 400 KB): one thread at a time,
        # so a burst of data URLs cannot crowd the event loop out of the interpreter
        self.base64_limiter = anyio.CapacityLimiter(1)
        self.policy = policy or AddressPolicy(allow_private=allow_private)
        self._resolver = PinnedResolver(resolver or SystemResolver(), self.policy)
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Create the shared HTTP session (``run`` does so on first use otherwise)."""
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(resolver=self._resolver, limit=self.concurrency)
            timeout = aiohttp.ClientTimeout(total=self.total_timeout_s, sock_connect=self.connect_timeout_s)
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)

    async def aclose(self) -> None:
        """Close the shared HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> FetchStage:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def request_slots(self) -> anyio.CapacityLimiter:
        """One request's share of the fetch slots, for ``run``: its images beyond ``per_request`` wait
        for its own, not for everyone's (four requests of eight slow URLs held all 32 slots, and
        another user's good URL waited behind them)."""
        return anyio.CapacityLimiter(self.per_request)

    async def run(self, url: str, *, field: str, slots: anyio.CapacityLimiter | None = None) -> bytes:
        """The bytes ``url`` points at; ``slots``: the request's share (``request_slots``), taken
        before a shared slot.

        :raises ImageFetchError: refused or failed URL. :raises PayloadTooLarge: over the byte cap.
        :raises DeadlineExceeded: the server did not answer in time.
        """
        match = _SCHEME.match(url)
        scheme = match.group(1).lower() if match else ""
        if scheme == "data":
            return await self._data_url(url, field)
        is_local = scheme == "file" or (not scheme and url.startswith("/"))
        if scheme not in ("http", "https") and not is_local:
            raise self._error(url, f"unsupported URL scheme {scheme or '(none)'!r}", field)
        if slots is None:
            return await self._fetch(url, field, is_local)
        async with slots:
            return await self._fetch(url, field, is_local)

    async def _fetch(self, url: str, field: str, is_local: bool) -> bytes:
        if is_local:
            return await self._local_file(url, field)
        async with self._host_slot(_host_key(url)), self.limiter:
            return await self._http(url, field)

    @asynccontextmanager
    async def _host_slot(self, host: str) -> AsyncIterator[None]:
        """Hold one of ``host``'s ``per_host`` slots (taken before a shared one, as a request's are)."""
        slots = self._hosts.get(host)
        if slots is None:
            slots = self._hosts[host] = _HostSlots(anyio.CapacityLimiter(self.per_host))
        slots.users += 1
        try:
            async with slots.limiter:
                yield
        finally:
            slots.users -= 1
            if not slots.users:  # no fetch holds or awaits it: the table keeps only hosts in use
                del self._hosts[host]

    def hosts_in_use(self) -> int:
        """Hosts whose slots some fetch holds or waits for (what the per-host table holds)."""
        return len(self._hosts)

    def _error(self, url: str, reason: str, field: str) -> ImageFetchError:
        return ImageFetchError(f"cannot fetch image {_shown(url)}: {reason}", field=field, stage=self.name)

    def _too_large(self, url: str, size: str, field: str) -> PayloadTooLarge:
        message = f"image {_shown(url)} is {size} bytes; at most {self.max_bytes} are allowed"
        return PayloadTooLarge(message, field=field, stage=self.name)

    # -- data: -------------------------------------------------------------------------------
    async def _data_url(self, url: str, field: str) -> bytes:
        # The payload stays inside ``url`` until the decoding call slices it: a slice taken here
        # copies megabytes on the loop (about 1.5 ms for a 2 MB URL, 46 ms for a burst of 32).
        comma = url.find(",", 5)
        if comma < 0:
            raise self._error(url, "a data URL needs a ',' before its payload", field)
        media_type, *params = url[5:comma].split(";")
        if not media_type.strip().lower().startswith("image/"):
            raise self._error(url, f"media type {media_type or '(none)'!r} is not an image", field)
        if "base64" not in (p.strip().lower() for p in params):
            raise self._error(url, "only base64 data URLs are supported", field)
        size = len(url) - comma - 1
        if size > self.max_bytes * 4 // 3 + 4:  # before decoding anything
            raise self._too_large(url, f"about {size * 3 // 4}", field)
        if size > _INLINE_BASE64_LIMIT:
            data = await anyio.to_thread.run_sync(self._b64decode, url, comma + 1, field, limiter=self.base64_limiter)
        else:
            data = self._b64decode(url, comma + 1, field)
        if len(data) > self.max_bytes:
            raise self._too_large(url, str(len(data)), field)
        return data

    def _b64decode(self, url: str, start: int, field: str) -> bytes:
        payload = url[start:]
        payload = unquote(payload) if "%" in payload else payload
        try:
            return base64.b64decode("".join(payload.split()), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise self._error(url, f"broken base64 ({exc})", field) from None

    # -- http(s) -----------------------------------------------------------------------------
    async def _http(self, url: str, field: str) -> bytes:
        await self.start()
        assert self._session is not None
        try:
            with anyio.fail_after(self.total_timeout_s):  # one deadline for every hop
                return await self._follow(self._session, url, field)
        except TimeoutError:
            message = f"image {_shown(url)} did not arrive within {self.total_timeout_s:g} s"
            raise DeadlineExceeded(message, field=field, stage=self.name) from None
        except AddressRefused as exc:
            raise self._error(url, str(exc), field) from None
        except aiohttp.ClientConnectorError as exc:
            reason = str(exc.os_error) if isinstance(exc.os_error, AddressRefused) else client_error_reason(exc)
            raise self._error(url, reason, field) from None
        except aiohttp.ClientError as exc:
            raise self._error(url, client_error_reason(exc), field) from None

    async def _follow(self, session: aiohttp.ClientSession, url: str, field: str) -> bytes:
        target = self._parse_http(url, url, field)
        for _hop in range(self.max_redirects + 1):
            self.policy.check_literal(target.raw_host or "")
            async with session.get(target, allow_redirects=False) as resp:
                if resp.status not in _REDIRECTS:
                    return await self._read_body(url, resp, field)
                location = resp.headers.get("Location")
                if not location:
                    raise self._error(url, f"redirect {resp.status} without a Location", field)
                target = self._parse_http(url, location, field, base=target)
        raise self._error(url, f"more than {self.max_redirects} redirects", field)

    def _parse_http(self, url: str, hop: str, field: str, *, base: URL | None = None) -> URL:
        """``hop`` (a redirect's Location, relative to ``base``) as an http(s) URL with a valid host."""
        what = "URL" if base is None else "redirect Location"
        try:  # any remote host writes the Location: yarl's ValueError must not leave the stage
            target = URL(hop) if base is None else base.join(URL(hop))
            target.port  # noqa: B018  # raises for a port out of range
        except ValueError:  # yarl's message quotes the text: a Location is the remote server's
            raise self._error(url, f"malformed {what} {self._hop(url, hop, base)}", field) from None
        if target.scheme not in ("http", "https") or not target.raw_host:
            raise self._error(url, f"{what} {self._hop(url, hop, base)} is not an http(s) URL with a host", field)
        if not _HOST.fullmatch(target.raw_host):
            message = f"malformed {what} {self._hop(url, hop, base)} (the host is not a name or address)"
            raise self._error(url, message, field)
        return target

    @staticmethod
    def _hop(url: str, hop: str, base: URL | None) -> str:
        """A hop as an error shows it: the client's own URL as it is, a redirect's as remote text."""
        return _shown(url) if base is None else remote_text(hop)

    async def _read_body(self, url: str, resp: aiohttp.ClientResponse, field: str) -> bytes:
        if resp.status != 200:
            raise self._error(url, status_reason(resp.status), field)
        # the raw header: aiohttp's resp.content_type says octet-stream when the header is missing
        content_type = resp.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if not content_type.startswith("image/") and content_type not in _ACCEPTED_TYPES:
            shown = remote_text(content_type, quoted=True) if content_type else "(none)"
            raise self._error(url, f"content type {shown} is not an image", field)
        if resp.content_length is not None and resp.content_length > self.max_bytes:
            raise self._too_large(url, str(resp.content_length), field)
        chunks: list[bytes] = []
        num_bytes = 0
        # never ask for more than cap + 1 bytes: an endless body is cut off there
        while chunk := await resp.content.read(min(_CHUNK, self.max_bytes + 1 - num_bytes)):
            chunks.append(chunk)
            num_bytes += len(chunk)
            if num_bytes > self.max_bytes:
                raise self._too_large(url, f"more than {self.max_bytes}", field)
        return b"".join(chunks)

    # -- local files ---------------------------------------------------------------------------
    async def _local_file(self, url: str, field: str) -> bytes:
        root = self.media_root
        if root is None:
            raise self._error(url, "local files are not allowed (no media root is configured)", field)
        if url[:5].lower() == "file:":
            parts = urlsplit(url)
            if parts.netloc not in ("", "localhost"):
                raise self._error(url, f"file URL names another host {parts.netloc!r}", field)
            raw = unquote(parts.path)
        else:
            raw = url
        return await anyio.to_thread.run_sync(self._read_file, url, raw, root, field, limiter=self.limiter)

    def _read_file(self, url: str, raw: str, root: str, field: str) -> bytes:
        path = Path(os.path.realpath(raw))  # symlinks and '..' resolved before the check
        if not path.is_relative_to(os.path.realpath(root)):
            raise self._error(url, "the path is outside the media root, which is not allowed", field)
        try:
            # O_NOFOLLOW: the checked path cannot be swapped for a symlink; O_NONBLOCK: a FIFO cannot hang us
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
            with open(fd, "rb") as handle:
                info = os.fstat(handle.fileno())
                if not stat.S_ISREG(info.st_mode):
                    raise self._error(url, "not a regular file", field)
                if info.st_size > self.max_bytes:
                    raise self._too_large(url, str(info.st_size), field)
                data = handle.read(self.max_bytes + 1)
        except OSError as exc:
            raise self._error(url, f"cannot read the file ({exc.strerror})", field) from None
        if len(data) > self.max_bytes:
            raise self._too_large(url, f"more than {self.max_bytes}", field)
        return data
