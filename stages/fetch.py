"""Fetch stage: image bytes from ``data:``, ``http(s)`` and (under a media root) local URLs.

One shared aiohttp ``ClientSession``; connect and total timeouts; redirects followed by hand (each
hop re-checked, at most ``max_redirects``); image content types only; the byte cap enforced while
the body streams in; private addresses refused unless allowed (see ``fetch_policy``).
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import os
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import aiohttp
import anyio
from aiohttp.abc import AbstractResolver

from pipeline.config import PipelineConfig
from pipeline.errors import DeadlineExceeded, ImageFetchError, PayloadTooLarge
from stages.fetch_policy import AddressRefused, CheckingResolver, is_public_address

__all__ = ["FetchStage"]

_CHUNK = 64 * 1024
_INLINE_BASE64_LIMIT = 256 * 1024  # larger payloads are decoded in a worker thread (rule 1)


def _shown(url: str) -> str:
    return url if len(url) <= 64 else url[:61] + "..."


class FetchStage:
    name = "fetch"

    def __init__(self, config: PipelineConfig, *, resolver: AbstractResolver | None = None) -> None:
        self.config = config
        self.max_bytes = config.max_image_bytes
        self.limiter = anyio.CapacityLimiter(config.fetch_concurrency)
        self._resolver = CheckingResolver(allow_private=config.allow_private_networks, inner=resolver)
        self._session: aiohttp.ClientSession | None = None

    def _error(self, url: str, reason: str, field: str) -> ImageFetchError:
        return ImageFetchError(f"cannot fetch image {_shown(url)}: {reason}", field=field, stage=self.name)

    async def run(self, url: str, *, field: str) -> bytes:
        """The bytes ``url`` points at.

        :raises ImageFetchError: refused or failed URL. :raises PayloadTooLarge: over the byte cap.
        :raises DeadlineExceeded: the server did not answer in time.
        """
        scheme = urlsplit(url).scheme.lower() if ":" in url else ""
        if scheme == "data":
            return await self._data_url(url, field)
        if scheme in ("http", "https"):
            async with self.limiter:
                return await self._http(url, field)
        if scheme == "file" or (not scheme and url.startswith("/")):
            return await self._local_file(url, field)
        raise self._error(url, f"unsupported URL scheme {scheme or '(none)'!r}", field)

    # -- data: -------------------------------------------------------------------------------
    async def _data_url(self, url: str, field: str) -> bytes:
        header, sep, payload = url[5:].partition(",")
        if not sep:
            raise self._error(url, "a data URL needs a ',' before its payload", field)
        media_type, *params = header.split(";")
        if not media_type.lower().startswith("image/"):
            raise self._error(url, f"media type {media_type or '(none)'!r} is not an image", field)
        if "base64" not in (p.lower() for p in params):
            raise self._error(url, "only base64 data URLs are supported", field)
        if len(payload) > self.max_bytes * 4 // 3 + 8:
            raise PayloadTooLarge(
                f"data URL of about {len(payload) * 3 // 4} bytes; at most {self.max_bytes} are allowed",
                field=field,
                stage=self.name,
            )
        if len(payload) > _INLINE_BASE64_LIMIT:
            data = await anyio.to_thread.run_sync(self._b64decode, url, payload, field)
        else:
            data = self._b64decode(url, payload, field)
        if len(data) > self.max_bytes:
            raise PayloadTooLarge(f"image of {len(data)} bytes; at most {self.max_bytes}", field=field, stage=self.name)
        return data

    def _b64decode(self, url: str, payload: str, field: str) -> bytes:
        try:
            return base64.b64decode("".join(unquote(payload).split()), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise self._error(url, f"broken base64 ({exc})", field) from None

    # -- http(s) -----------------------------------------------------------------------------
    def _session_for_loop(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(resolver=self._resolver, limit=self.config.fetch_concurrency)
            timeout = aiohttp.ClientTimeout(
                total=self.config.fetch_total_timeout_s, sock_connect=self.config.fetch_connect_timeout_s
            )
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        return self._session

    def _check_literal_address(self, url: str, field: str) -> None:
        # aiohttp does not resolve IP literals, so the resolver's check never sees them
        host = urlsplit(url).hostname or ""
        try:
            ipaddress.ip_address(host)
        except ValueError:
            return
        if not self.config.allow_private_networks and not is_public_address(host):
            raise self._error(url, f"address {host} is private or local, which is not allowed", field)

    async def _http(self, url: str, field: str) -> bytes:
        session = self._session_for_loop()
        current = url
        try:
            for _hop in range(self.config.max_redirects + 1):
                self._check_literal_address(current, field)
                async with session.get(current, allow_redirects=False) as resp:
                    if resp.status in (301, 302, 303, 307, 308):
                        location = resp.headers.get("Location")
                        if not location:
                            raise self._error(url, f"redirect {resp.status} without a Location", field)
                        current = urljoin(current, location)
                        if urlsplit(current).scheme not in ("http", "https"):
                            raise self._error(url, f"redirect to a non-http URL {_shown(current)}", field)
                        continue
                    return await self._read_body(url, resp, field)
            raise self._error(url, f"more than {self.config.max_redirects} redirects", field)
        except TimeoutError:
            raise DeadlineExceeded(
                f"image {_shown(url)} did not arrive within {self.config.fetch_total_timeout_s:g} s",
                field=field,
                stage=self.name,
            ) from None
        except AddressRefused as exc:
            raise self._error(url, str(exc), field) from None
        except aiohttp.ClientConnectorError as exc:
            if isinstance(exc.os_error, AddressRefused):
                raise self._error(url, str(exc.os_error), field) from None
            raise self._error(url, f"connection failed ({exc.os_error})", field) from None
        except aiohttp.ClientError as exc:
            raise self._error(url, f"{type(exc).__name__}: {exc}", field) from None

    async def _read_body(self, url: str, resp: aiohttp.ClientResponse, field: str) -> bytes:
        if resp.status != 200:
            raise self._error(url, f"the server answered {resp.status}", field)
        content_type = resp.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if not content_type.startswith("image/"):
            raise self._error(url, f"content type {content_type or '(none)'!r} is not an image", field)
        if resp.content_length is not None and resp.content_length > self.max_bytes:
            raise PayloadTooLarge(
                f"image {_shown(url)} is {resp.content_length} bytes; at most {self.max_bytes}",
                field=field,
                stage=self.name,
            )
        body = bytearray()
        async for chunk in resp.content.iter_chunked(_CHUNK):
            body += chunk
            if len(body) > self.max_bytes:  # an endless body is cut off here
                raise PayloadTooLarge(
                    f"image {_shown(url)} is over {self.max_bytes} bytes", field=field, stage=self.name
                )
        return bytes(body)

    # -- local files ---------------------------------------------------------------------------
    async def _local_file(self, url: str, field: str) -> bytes:
        root = self.config.media_root
        if root is None:
            raise self._error(url, "local files are not allowed (no media root is configured)", field)
        raw = unquote(urlsplit(url).path) if url.startswith("file:") else url

        def read() -> bytes:
            path = Path(os.path.realpath(raw))  # symlinks and '..' resolved before the check
            if not path.is_relative_to(Path(os.path.realpath(root))):
                raise self._error(url, "the path is outside the media root", field)
            try:
                with open(path, "rb") as handle:
                    data = handle.read(self.max_bytes + 1)
            except OSError as exc:
                raise self._error(url, f"cannot read the file ({exc.strerror})", field) from None
            if len(data) > self.max_bytes:
                raise PayloadTooLarge(f"file over {self.max_bytes} bytes", field=field, stage=self.name)
            return data

        return await anyio.to_thread.run_sync(read)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
