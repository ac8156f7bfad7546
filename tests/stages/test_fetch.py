"""FetchStage against a real aiohttp server on 127.0.0.1, with images made here by Pillow."""

from __future__ import annotations

import base64
import io
import ipaddress
import os
import random
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import anyio
import pytest
from aiohttp import web
from aiohttp.typedefs import Handler
from PIL import Image

from pipeline.errors import DeadlineExceeded, ImageFetchError, PayloadTooLarge, PipelineError
from stages.fetch import FetchStage
from stages.fetch_policy import AddressPolicy
from tests.images import data_url

FIELD = "messages[0].content[1].image_url.url"
CAP = 64 * 1024


def make_png(width: int = 32, height: int = 24, *, seed: int = 0) -> bytes:
    rng = random.Random(seed)
    image = Image.new("RGB", (width, height), tuple(rng.randrange(256) for _ in range(3)))
    image.putpixel((1, 1), (rng.randrange(256), 0, 0))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


PNG = make_png()


def config(**overrides: Any) -> dict[str, Any]:
    """The fetch stage's keyword arguments for these tests."""
    return {"max_bytes": CAP, "total_timeout_s": 5.0, "max_redirects": 3, **overrides}


async def fetch_error(stage: FetchStage, url: str, kind: type[PipelineError], status: int) -> PipelineError:
    with anyio.fail_after(5), pytest.raises(kind) as info:
        await stage.run(url, field=FIELD)
    err = info.value
    assert type(err) is kind
    assert (err.status, err.field, err.stage) == (status, FIELD, "fetch")
    return err


class FakeResolver:
    """Answers from a table and records every lookup."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table
        self.calls: list[str] = []

    async def resolve(self, host: str, port: int) -> list[str]:
        self.calls.append(host)
        if host not in self.table:
            raise socket.gaierror(socket.EAI_NONAME, f"unknown host {host}")
        return self.table[host]


@dataclass
class Server:
    base: str
    port: int
    release: anyio.Event  # hanging handlers wait for it
    arrived: anyio.Event  # set when a hanging handler has its request
    stream_ended: anyio.Event  # set when the endless body stops (client gone)
    paths: list[str] = field(default_factory=list)


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    state = Server("", 0, anyio.Event(), anyio.Event(), anyio.Event())

    @web.middleware
    async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
        state.paths.append(request.path)
        return await handler(request)

    async def image(request: web.Request) -> web.Response:
        return web.Response(body=PNG, content_type="image/png")

    async def html(request: web.Request) -> web.Response:
        return web.Response(text="<html>not an image</html>", content_type="text/html")

    async def missing(request: web.Request) -> web.Response:
        return web.Response(status=404, text="no")

    async def hops(request: web.Request) -> web.Response:
        n = int(request.match_info["n"])
        if n == 0:
            return web.Response(body=PNG, content_type="image/png")
        raise web.HTTPFound(f"/hops/{n - 1}")

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound(request.query["to"].replace("PORT", str(state.port)))

    async def location(request: web.Request) -> web.Response:  # any Location, parsed or not
        return web.Response(status=302, headers={"Location": request.query["to"]})

    async def declared_large(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "image/png", "Content-Length": str(10 * CAP)})
        await resp.prepare(request)
        await resp.write(b"\x89PNG")
        await state.release.wait()  # the body never comes: the client must not wait for it
        return resp

    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "image/png"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        try:
            while True:
                await resp.write(b"\0" * 16384)
        except ConnectionError:
            pass
        finally:
            state.stream_ended.set()
        return resp

    async def hang(request: web.Request) -> web.Response:
        state.arrived.set()
        await state.release.wait()
        return web.Response(body=PNG, content_type="image/png")

    app = web.Application(middlewares=[record])
    app.add_routes(
        [
            web.get("/img.png", image),
            web.get("/page.html", html),
            web.get("/missing.png", missing),
            web.get("/hops/{n}", hops),
            web.get("/redirect", redirect),
            web.get("/location", location),
            web.get("/declared-large.png", declared_large),
            web.get("/endless.png", endless),
            web.get("/hang.png", hang),
        ]
    )
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    state.port = runner.addresses[0][1]
    state.base = f"http://127.0.0.1:{state.port}"
    try:
        yield state
    finally:
        state.release.set()
        await runner.cleanup()


@pytest.fixture
async def local_stage() -> AsyncIterator[FetchStage]:
    """A stage that may reach the local test server (private networks allowed)."""
    async with FetchStage(**config(allow_private=True)) as stage:
        yield stage


# -- data: URLs ------------------------------------------------------------------------------------
async def test_data_url_is_decoded() -> None:
    async with FetchStage(**config()) as stage:
        assert await stage.run(data_url(PNG), field=FIELD) == PNG
        encoded = base64.encodebytes(PNG).decode()  # MIME style: a newline every 76 characters
        assert await stage.run("data:image/png;base64,\n" + encoded, field=FIELD) == PNG


async def test_large_data_url_is_decoded_in_a_thread() -> None:
    payload = random.Random(1).randbytes(600 * 1024)
    async with FetchStage(**config(max_bytes=1024 * 1024)) as stage:
        assert await stage.run(data_url(payload, "image/jpeg"), field=FIELD) == payload


async def test_broken_base64_is_refused() -> None:
    async with FetchStage(**config()) as stage:
        err = await fetch_error(stage, "data:image/png;base64,iVBORw0K*GgoAAA", ImageFetchError, 400)
        assert "base64" in err.message and "data:image/png;base64," in err.message
        await fetch_error(stage, "data:image/png;base64,iVBORw0KGgoAAA", ImageFetchError, 400)  # bad padding


async def test_data_url_must_be_a_base64_image() -> None:
    async with FetchStage(**config()) as stage:
        err = await fetch_error(stage, data_url(b"hello", "text/plain"), ImageFetchError, 400)
        assert "text/plain" in err.message
        await fetch_error(stage, "data:image/png,rawbytes", ImageFetchError, 400)
        await fetch_error(stage, "data:image/png;base64", ImageFetchError, 400)


async def test_oversize_data_url_is_refused_and_shortened_in_the_message() -> None:
    async with FetchStage(**config()) as stage:
        err = await fetch_error(stage, data_url(b"\0" * (CAP + 1)), PayloadTooLarge, 413)
        assert err.message.startswith("image data:image/png;base64,AAAA")
        assert len(err.message) < 160


# -- http(s) ---------------------------------------------------------------------------------------
async def test_http_image_is_fetched(server: Server, local_stage: FetchStage) -> None:
    with anyio.fail_after(5):
        assert await local_stage.run(f"{server.base}/img.png", field=FIELD) == PNG


async def test_http_error_status_is_refused(server: Server, local_stage: FetchStage) -> None:
    err = await fetch_error(local_stage, f"{server.base}/missing.png", ImageFetchError, 400)
    assert "404" in err.message and "/missing.png" in err.message


async def test_html_content_type_is_refused(server: Server, local_stage: FetchStage) -> None:
    err = await fetch_error(local_stage, f"{server.base}/page.html", ImageFetchError, 400)
    assert "text/html" in err.message


async def test_declared_length_over_cap_is_refused_at_once(server: Server, local_stage: FetchStage) -> None:
    err = await fetch_error(local_stage, f"{server.base}/declared-large.png", PayloadTooLarge, 413)
    assert str(10 * CAP) in err.message


async def test_endless_body_is_cut_off_at_the_cap(server: Server, local_stage: FetchStage) -> None:
    await fetch_error(local_stage, f"{server.base}/endless.png", PayloadTooLarge, 413)
    with anyio.fail_after(5):
        await server.stream_ended.wait()  # the client hung up on the server


async def test_redirects_are_followed_up_to_the_limit(server: Server, local_stage: FetchStage) -> None:
    with anyio.fail_after(5):
        assert await local_stage.run(f"{server.base}/hops/2", field=FIELD) == PNG
        assert await local_stage.run(f"{server.base}/hops/3", field=FIELD) == PNG
    err = await fetch_error(local_stage, f"{server.base}/hops/4", ImageFetchError, 400)
    assert "more than 3 redirects" in err.message
    assert "/hops/0" not in server.paths[server.paths.index("/hops/4") :]


async def test_redirect_to_another_scheme_is_refused(server: Server, local_stage: FetchStage) -> None:
    err = await fetch_error(local_stage, f"{server.base}/redirect?to=file:///etc/passwd", ImageFetchError, 400)
    assert "file:///etc/passwd" in err.message


@pytest.mark.parametrize(
    "location",
    ["http://[::1", "http://[::1/x.png", "http://a b/x.png", "http://127.0.0.1:99999/x.png", "http://h:-1/", "//[::1"],
)
async def test_a_malformed_redirect_location_is_refused(server: Server, local_stage: FetchStage, location: str) -> None:
    # any remote host can answer this: a 400 naming the image, never a ValueError out of the stage
    err = await fetch_error(local_stage, f"{server.base}/location?to={quote(location)}", ImageFetchError, 400)
    assert f"malformed redirect Location {location}" in err.message
    assert server.paths == ["/location"]


async def test_hanging_server_hits_the_deadline(server: Server) -> None:
    async with FetchStage(**config(allow_private=True, total_timeout_s=0.2)) as stage:
        err = await fetch_error(stage, f"{server.base}/hang.png", DeadlineExceeded, 504)
    assert server.arrived.is_set()
    assert "/hang.png" in err.message


async def test_connection_refused(local_stage: FetchStage) -> None:
    with socket.socket() as sock:  # bound but not listening: connections to it are refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        err = await fetch_error(local_stage, f"http://127.0.0.1:{port}/img.png", ImageFetchError, 400)
    assert "cannot connect" in err.message


async def test_unknown_host_is_refused() -> None:
    async with FetchStage(**config(), resolver=FakeResolver({})) as stage:
        err = await fetch_error(stage, "http://nowhere.test/img.png", ImageFetchError, 400)
    assert "nowhere.test" in err.message


async def test_downloads_are_bounded_by_fetch_concurrency(server: Server) -> None:
    results: list[bytes] = []
    async with FetchStage(**config(allow_private=True, concurrency=1)) as stage:

        async def fetch(base: str) -> None:
            results.append(await stage.run(f"{base}/hang.png", field=FIELD))

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                # two names of one server: two hosts, so what bounds them is the shared slot
                tg.start_soon(fetch, server.base)
                tg.start_soon(fetch, server.base.replace("127.0.0.1", "localhost"))
                await server.arrived.wait()
                await anyio.wait_all_tasks_blocked()
                assert stage.limiter.statistics().tasks_waiting == 1 and stage.hosts_in_use() == 2
                assert server.paths == ["/hang.png"]
                server.release.set()
    assert results == [PNG, PNG]


# -- address policy --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:{port}/img.png",
        "http://[::1]:{port}/img.png",
        "http://[::ffff:127.0.0.1]:{port}/img.png",
        "http://10.0.0.1/img.png",
        "http://169.254.169.254/latest/meta-data",
        "http://0.0.0.0:{port}/img.png",
        "http://127.1:{port}/img.png",  # legacy numeric forms the OS would map onto 127.0.0.1
        "http://2130706433:{port}/img.png",
    ],
)
async def test_private_literal_address_is_refused_by_default(server: Server, url: str) -> None:
    async with FetchStage(**config()) as stage:
        err = await fetch_error(stage, url.format(port=server.port), ImageFetchError, 400)
    assert "not allowed" in err.message
    assert server.paths == []


@pytest.mark.parametrize(
    "addresses",
    [["10.0.0.1"], ["169.254.169.254"], ["::1"], ["::ffff:127.0.0.1"], ["93.184.216.34", "192.168.1.1"]],
)
async def test_hostname_resolving_to_a_private_address_is_refused(addresses: list[str]) -> None:
    resolver = FakeResolver({"images.test": addresses})
    async with FetchStage(**config(), resolver=resolver) as stage:
        err = await fetch_error(stage, "http://images.test/img.png", ImageFetchError, 400)
    assert "images.test" in err.message and "not allowed" in err.message
    assert resolver.calls == ["images.test"]


async def test_checked_address_is_the_one_connected_to(server: Server) -> None:
    # "public.test" exists only in the fake resolver: fetching it proves the connection used that answer
    resolver = FakeResolver({"public.test": ["127.0.0.1"]})
    policy = AddressPolicy(allowed_networks=(ipaddress.ip_network("127.0.0.1/32"),))
    async with FetchStage(**config(), resolver=resolver, policy=policy) as stage:
        with anyio.fail_after(5):
            assert await stage.run(f"http://public.test:{server.port}/img.png", field=FIELD) == PNG
    assert resolver.calls == ["public.test"]


@pytest.mark.parametrize(
    "target",
    ["http://metadata.test:PORT/img.png", "http://169.254.169.254/latest/meta-data", "http://[::1]:PORT/img.png"],
)
async def test_redirect_to_a_private_address_is_refused(server: Server, target: str) -> None:
    # the test server counts as public here; the redirect target does not
    resolver = FakeResolver({"public.test": ["127.0.0.1"], "metadata.test": ["169.254.169.254"]})
    policy = AddressPolicy(allowed_networks=(ipaddress.ip_network("127.0.0.1/32"),))
    async with FetchStage(**config(), resolver=resolver, policy=policy) as stage:
        url = f"http://public.test:{server.port}/redirect?to={target}"
        err = await fetch_error(stage, url, ImageFetchError, 400)
    assert "not allowed" in err.message
    assert server.paths == ["/redirect"]


@pytest.mark.parametrize(
    ("address", "allowed"),
    [
        ("93.184.216.34", True),
        ("2606:2800:220:1:248:1893:25c8:1946", True),
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("192.168.0.1", False),
        ("100.64.0.1", False),
        ("169.254.169.254", False),
        ("224.0.0.1", False),
        ("240.0.0.1", False),
        ("0.0.0.0", False),
        ("::", False),
        ("::1", False),
        ("fe80::1%eth0", False),
        ("fc00::1", False),
        ("ff02::1", False),
        ("::ffff:10.0.0.1", False),
        ("::ffff:93.184.216.34", True),
    ],
)
def test_address_policy(address: str, allowed: bool) -> None:
    assert AddressPolicy().is_allowed(address) is allowed
    assert AddressPolicy(allow_private=True).is_allowed(address)


# -- other schemes and local files -----------------------------------------------------------------
@pytest.mark.parametrize(
    "url", ["ftp://example.com/a.png", "javascript:alert(1)", "gopher://x/", "images/a.png", " http://x/a.png"]
)
async def test_other_schemes_are_refused(url: str) -> None:
    async with FetchStage(**config()) as stage:
        await fetch_error(stage, url, ImageFetchError, 400)


async def test_local_file_needs_a_media_root(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(PNG)
    async with FetchStage(**config()) as stage:
        err = await fetch_error(stage, str(tmp_path / "a.png"), ImageFetchError, 400)
        assert "media root" in err.message
        await fetch_error(stage, (tmp_path / "a.png").as_uri(), ImageFetchError, 400)


async def test_local_file_under_the_media_root(tmp_path: Path) -> None:
    media = tmp_path / "media"
    (media / "sub").mkdir(parents=True)
    (media / "sub" / "a.png").write_bytes(PNG)
    (media / "big.png").write_bytes(b"\0" * (CAP + 1))
    (tmp_path / "secret.png").write_bytes(PNG)
    os.symlink(tmp_path / "secret.png", media / "link.png")
    async with FetchStage(**config(media_root=str(media))) as stage:
        with anyio.fail_after(5):
            assert await stage.run(str(media / "sub" / "a.png"), field=FIELD) == PNG
            assert await stage.run((media / "sub" / "a.png").as_uri(), field=FIELD) == PNG
        for escape in [f"{media}/sub/../../secret.png", f"file://{media}/../secret.png", str(media / "link.png")]:
            err = await fetch_error(stage, escape, ImageFetchError, 400)
            assert "outside the media root" in err.message
        await fetch_error(stage, str(media / "big.png"), PayloadTooLarge, 413)
        await fetch_error(stage, str(media / "sub"), ImageFetchError, 400)
        await fetch_error(stage, str(media / "nope.png"), ImageFetchError, 400)
        await fetch_error(stage, f"file://otherhost{media}/sub/a.png", ImageFetchError, 400)
