"""Image URLs: fetched only from --allowed-media-domains, within time and size limits."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.api.harness import MODEL, run, serve
from tests.test_images_e2e import png

CHAT = "/v1/chat/completions"
IMAGE = png(40, 30)
_STALL = threading.Event()  # never set: the slow route waits on it until its timeout


class _Images(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/ok.png":
            self._send(200, IMAGE)
        elif self.path == "/big.png":
            self._send(200, IMAGE + b"\0" * 200_000)
        elif self.path == "/hop":
            self._redirect("/ok.png")
        elif self.path == "/away":
            self._redirect(f"http://localhost:{self.server.server_address[1]}/ok.png")
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


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _asking(url: str) -> dict[str, Any]:
    part = {"type": "image_url", "image_url": {"url": url}}
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": "what?"}]}],
    }


ALLOW = ("--allowed-media-domains", "127.0.0.1", "--max-image-bytes", "100000")


def test_an_allowed_url_is_fetched_and_reaches_the_engine(image_host: str) -> None:
    async def body() -> None:
        async with serve(*ALLOW) as h:
            for path in ("/ok.png", "/hop"):
                response = await h.client.post(CHAT, json=_asking(image_host + path))
                assert response.status_code == 200, response.text
                request_id = h.coordinator.submitted[-1][0]
                images = h.coordinator.images[request_id]
                assert images is not None and len(images.sizes) == 1

    run(body)


@pytest.mark.parametrize(
    ("args", "path", "status", "words"),
    [
        ((), "/ok.png", 400, "data:image"),  # no allowed domains: URLs are refused
        (ALLOW, "/away", 400, "allowed-media-domains"),  # a redirect to another host
        (ALLOW, "/big.png", 413, "100000 bytes"),
        (ALLOW, "/missing.png", 400, "HTTP 404"),
        ((*ALLOW, "--media-fetch-timeout", "0.5"), "/slow", 400, "fetching the image"),
    ],
)
def test_urls_outside_the_rules_are_refused(
    image_host: str, args: tuple[str, ...], path: str, status: int, words: str
) -> None:
    async def body() -> None:
        async with serve(*args) as h:
            response = await h.client.post(CHAT, json=_asking(image_host + path))
            assert response.status_code == status, response.text
            assert words in response.json()["error"]["message"]
            assert response.json()["error"]["param"] == "messages[0]"
            assert not h.coordinator.submitted

    run(body)
