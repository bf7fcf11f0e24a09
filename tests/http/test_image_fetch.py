"""Image URLs: fetched only from allowed hosts and ports, within one deadline, on the event loop
(never on a preparation worker), cancelled when the client leaves, and failing with one neutral
message whatever went wrong. Real HTTP servers on loopback: a threaded one for the plain routes,
an asyncio one that drips its headers."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from deepinfer_server.api.app import build_app
from deepinfer_server.api.image_fetch import FETCH_FAILED
from deepinfer_server.api.preparation_gate import PREPARATION_WORKERS, SPARE_WORKERS
from deepinfer_server.cli import parse_config
from deepinfer_server.config.media_origins import parse_origin
from deepinfer_server.errors import ConfigError
from deepinfer_server.protocol.core.images import AllowedOrigins
from tests.e2e.test_images import png
from tests.http.harness import MODEL, run, serve
from tests.server import refusing_port

CHAT = "/v1/chat/completions"
IMAGE = png(40, 30)
_STALL = threading.Event()  # never set: the slow route waits on it until its timeout


class _Images(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.server.paths.append(self.path)  # type: ignore[attr-defined]
        port = self.server.server_address[1]
        if self.path == "/ok.png":
            self._send(200, IMAGE)
        elif self.path == "/big.png":
            self._send(200, IMAGE + b"\0" * 200_000)
        elif self.path == "/text":
            self._send(200, b"<html>not an image</html>")
        elif self.path == "/hop":
            self._redirect("/ok.png")
        elif self.path == "/away":
            self._redirect(f"http://localhost:{port}/ok.png")
        elif self.path.startswith("/to/"):  # /to/PORT: the same host, another port
            self._redirect(f"http://127.0.0.1:{self.path[4:]}/ok.png")
        elif self.path == "/slow":
            self.send_response(200)
            self.send_header("Content-Length", str(len(IMAGE)))
            self.end_headers()
            _STALL.wait(3.0)
        else:
            self._send(404, b"")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


class _Host:
    """A threaded HTTP server on loopback, and the paths it was asked for."""

    def __init__(self) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
        self.server.paths = []  # type: ignore[attr-defined]
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def paths(self) -> list[str]:
        return self.server.paths  # type: ignore[attr-defined,no-any-return]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def image_host() -> Iterator[_Host]:
    host = _Host()
    yield host
    host.close()


@pytest.fixture
def other_host() -> Iterator[_Host]:
    """A second server on the same host name, another port (say, the server's own /metrics)."""
    host = _Host()
    yield host
    host.close()


class _Dripper:
    """An asyncio HTTP server that sends its status line one byte at a time (every 50 ms, for
    at most `drip_seconds`), then closes; it records who closed each connection first (a client
    that hangs up before its request is out counts as cut by the client)."""

    def __init__(self, drip_seconds: float = 20.0) -> None:
        self._drip_seconds = drip_seconds
        self.connections = 0
        self.connected = asyncio.Condition()
        #: Connections the client closed while the headers were still dripping.
        self.cut_by_client = 0
        self.cut = asyncio.Condition()
        #: Connections that dripped for the whole `drip_seconds` (the client never gave up).
        self.dripped_out = 0
        self.release = asyncio.Event()
        self._server: asyncio.Server | None = None
        self.url = ""

    async def __aenter__(self) -> _Dripper:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release.set()
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):  # the deadline came first
            async with self.cut:
                self.cut_by_client += 1
                self.cut.notify_all()
            writer.close()
            return
        async with self.connected:
            self.connections += 1
            self.connected.notify_all()
        eof = asyncio.ensure_future(reader.read())  # b"" once the client closes
        released = asyncio.ensure_future(self.release.wait())
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self._drip_seconds
            for byte in b"HTTP/1.1 200 OK\r\nX-Drip: " + b"." * 10_000:
                if loop.time() > deadline:
                    self.dripped_out += 1
                    return
                writer.write(bytes([byte]))
                done, _ = await asyncio.wait({eof, released}, timeout=0.05)
                if eof in done:
                    async with self.cut:
                        self.cut_by_client += 1
                        self.cut.notify_all()
                    return
                if released in done:
                    return
        finally:
            eof.cancel()
            released.cancel()
            writer.close()

    async def wait_connections(self, count: int) -> None:
        async with self.connected:
            await self.connected.wait_for(lambda: self.connections >= count)

    async def wait_cut(self, count: int) -> None:
        async with self.cut:
            await self.cut.wait_for(lambda: self.cut_by_client >= count)


def _asking(url: str) -> dict[str, Any]:
    part = {"type": "image_url", "image_url": {"url": url}}
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": "what?"}]}],
    }


def _allow(*urls: str) -> tuple[str, ...]:
    """Options allowing each URL's host:port, with a 100000-byte image limit."""
    args: list[str] = []
    for url in urls:
        args += ["--allowed-media-domains", url.removeprefix("http://")]
    return (*args, "--max-image-bytes", "100000")


def test_an_allowed_url_is_fetched_and_reaches_the_engine(image_host: _Host) -> None:
    async def body() -> None:
        async with serve(*_allow(image_host.url)) as h:
            for path in ("/ok.png", "/hop"):
                response = await h.client.post(CHAT, json=_asking(image_host.url + path))
                assert response.status_code == 200, response.text
                request_id = h.coordinator.submitted[-1][0]
                images = h.coordinator.images[request_id]
                assert images is not None and len(images.sizes) == 1

    run(body)


def test_urls_the_server_never_fetches_say_why(image_host: _Host) -> None:
    async def body() -> None:
        for args, words in [
            ((), "data:image"),  # no allowed hosts: URLs are refused
            (("--allowed-media-domains", "localhost"), "allowed-media-domains"),  # other host
            (("--allowed-media-domains", "127.0.0.1"), "allowed-media-domains"),  # port 80 only
        ]:
            async with serve(*args) as h:
                response = await h.client.post(CHAT, json=_asking(image_host.url + "/ok.png"))
                assert response.status_code == 400, response.text
                assert words in response.json()["error"]["message"]
                assert response.json()["error"]["param"] == "messages[0]"
                assert not h.coordinator.submitted

    run(body)


def test_every_fetch_failure_reads_the_same(
    image_host: _Host, other_host: _Host, caplog: pytest.LogCaptureFixture
) -> None:
    with refusing_port() as port:
        _every_fetch_failure_reads_the_same(
            f"http://127.0.0.1:{port}", image_host, other_host, caplog
        )


def _every_fetch_failure_reads_the_same(
    refused: str, image_host: _Host, other_host: _Host, caplog: pytest.LogCaptureFixture
) -> None:
    failures = {
        refused + "/ok.png": "ConnectError",
        image_host.url + "/slow": "not done within --media-fetch-timeout",
        image_host.url + "/text": "not a PNG, JPEG, GIF or WebP",
        image_host.url + "/missing.png": "HTTP 404",
        image_host.url + "/big.png": "exceeds --max-image-bytes",
        image_host.url + "/away": "which is not allowed",  # another host name
        image_host.url + f"/to/{other_host.port}": "which is not allowed",  # another port
    }

    async def body() -> None:
        options = (*_allow(image_host.url, refused), "--media-fetch-timeout", "0.5")
        async with serve(*options) as h:
            for url in failures:
                response = await h.client.post(CHAT, json=_asking(url))
                assert response.status_code == 400, (url, response.text)
                assert response.json()["error"]["message"] == FETCH_FAILED, url
                assert response.json()["error"]["param"] == "messages[0]"
            assert not h.coordinator.submitted

    with caplog.at_level(logging.WARNING, "deepinfer_server.api.image_fetch"):
        run(body)
    for url, detail in failures.items():  # the detail is the operator's, in the log
        assert any(url in r.message and detail in r.message for r in caplog.records), url
    assert other_host.paths == []  # the redirect to another port was never followed


def test_a_host_that_drips_its_headers_is_cut_at_the_deadline() -> None:
    async def body() -> None:
        async with _Dripper(drip_seconds=20.0) as dripper:
            async with serve(*_allow(dripper.url), "--media-fetch-timeout", "0.5") as h:
                response = await h.client.post(CHAT, json=_asking(dripper.url + "/a.png"))
                assert response.status_code == 400
                assert response.json()["error"]["message"] == FETCH_FAILED
            await dripper.wait_cut(1)  # the server hung up, not the dripper
            assert dripper.dripped_out == 0

    run(body)


def _inline_image_request() -> dict[str, Any]:
    return _asking("data:image/png;base64," + base64.b64encode(IMAGE).decode())


def _large_prompt_request() -> dict[str, Any]:
    words = " ".join(["word"] * 20_000)  # 100 KB: prepared on a worker
    return {"model": MODEL, "messages": [{"role": "user", "content": words}], "max_tokens": 4}


def test_fetches_never_hold_the_preparation_workers() -> None:
    async def body() -> None:
        async with _Dripper() as dripper:
            options = (*_allow(dripper.url), "--media-fetch-timeout", "30")
            async with serve(*options, "--max-model-len", "32768") as h:
                # More slow fetches than there are preparation threads ...
                fetches = [
                    asyncio.ensure_future(
                        h.client.post(CHAT, json=_asking(f"{dripper.url}/{n}.png"))
                    )
                    for n in range(PREPARATION_WORKERS + SPARE_WORKERS + 1)
                ]
                await dripper.wait_connections(len(fetches))
                # ... and other clients' inline image and large prompt are prepared meanwhile.
                for request in (_inline_image_request(), _large_prompt_request()):
                    answer = await asyncio.wait_for(h.client.post(CHAT, json=request), 10)
                    assert answer.status_code == 200, answer.text
                assert dripper.cut_by_client == dripper.dripped_out == 0  # still fetching
                dripper.release.set()
                for fetch in fetches:
                    assert (await fetch).status_code == 400

    run(body)


async def _post_and_leave(app: Any, payload: dict[str, Any], leave: asyncio.Event) -> None:
    """POST `payload` to the ASGI app as a client that disconnects once `leave` is set."""
    raw = json.dumps(payload).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": CHAT,
        "raw_path": CHAT.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"test"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(raw)).encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("test", 80),
    }
    messages = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        pass

    await app(scope, receive, send)


def test_a_client_that_leaves_cancels_its_fetch() -> None:
    async def body() -> None:
        async with (
            _Dripper() as dripper,
            serve(*_allow(dripper.url), "--media-fetch-timeout", "30") as h,
        ):
            leave = asyncio.Event()
            request = asyncio.ensure_future(
                _post_and_leave(build_app(h.state), _asking(dripper.url + "/a.png"), leave)
            )
            await dripper.wait_connections(1)
            leave.set()
            await dripper.wait_cut(1)  # the fetch ended with the client, not at 30 s
            await asyncio.wait_for(request, 10)
            assert not h.coordinator.submitted

    run(body)


@pytest.mark.parametrize(
    ("entry", "origin"),
    [
        ("images.example.com", ("images.example.com", None)),
        ("Images.Example.com:8443", ("images.example.com", 8443)),
        ("10.0.0.5:80", ("10.0.0.5", 80)),
        ("[::1]:8080", ("::1", 8080)),
        ("[::1]", ("::1", None)),
    ],
)
def test_allow_list_entries_are_hosts_with_an_optional_port(
    entry: str, origin: tuple[str, int | None]
) -> None:
    assert parse_origin(entry) == origin


@pytest.mark.parametrize("entry", ["host:", "host:http", "host:70000", "http://host", "[::1]x"])
def test_a_malformed_allow_list_entry_is_a_configuration_error(entry: str) -> None:
    with pytest.raises(ConfigError, match="allowed-media-domains"):
        parse_config(["--engine", "simulated", "--allowed-media-domains", entry])


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("http://img.test/a.png", True),
        ("https://img.test/a.png", True),
        ("http://img.test:80/a.png", True),
        ("http://img.test:8080/a.png", False),  # a bare host is its default ports only
        ("http://img.test:443/a.png", False),  # https's port, not http's
        ("http://cdn.test:8443/a.png", True),
        ("https://cdn.test:8443/a.png", True),
        ("https://cdn.test/a.png", False),
        ("ftp://img.test/a.png", False),
        ("http://img.test:bad/a.png", False),
        ("http://img.test:0/a.png", False),
        ("http://evil.test\\@img.test/a.png", True),  # httpx fetches img.test, as checked
        ("http://img.test:80@evil.test/a.png", False),
        ("http://IMG.test/a.png", True),
    ],
)
def test_the_allow_list_compares_hosts_and_ports(url: str, allowed: bool) -> None:
    origins = AllowedOrigins.of(["img.test", "cdn.test:8443"])
    assert origins.allows(url) is allowed


def test_n_choices_with_a_fetched_image_answer_n_choices(image_host: _Host) -> None:
    """A body prepared twice (once to learn its image URLs, once with the fetched bytes) is
    the client's body both times: `n` is not lost on the second preparation."""

    async def body() -> None:
        async with serve(*_allow(image_host.url)) as h:
            inline = {"url": "data:image/png;base64," + base64.b64encode(IMAGE).decode()}
            for url in (image_host.url + "/ok.png", inline["url"]):
                asking = _asking(url)
                response = await h.client.post(CHAT, json={**asking, "n": 2})
                assert response.status_code == 200, response.text
                assert [c["index"] for c in response.json()["choices"]] == [0, 1]

    run(body)
