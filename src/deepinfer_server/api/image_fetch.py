"""Fetching image URLs: only from the origins the operator allows, within one deadline and size.

Off unless `--allowed-media-domains` names hosts. An entry is `host` (that host on its scheme's
default port only: 80 for http, 443 for https) or `host:port` (that port, http or https);
an IPv6 address is written in brackets (`[::1]:8080`). A URL is fetched when its scheme is http
or https and its host and port are allowed; every redirect target must be allowed too.

The whole fetch (connecting, headers, body, every redirect) has `--media-fetch-timeout` seconds
in all; it runs on the event loop (httpx.AsyncClient), never on a thread, and cancelling the task
that awaits it (the client left) ends it at once. The body may not exceed `--max-image-bytes`
and must begin as a PNG, JPEG, GIF or WebP file does.

A URL that is not allowed is a 400 saying so: that is decided from the URL alone, before anything
is sent (`AllowedOrigins` and `check_fetchable` in `protocol.core.images`, which preparation
applies too). The fetching itself is the HTTP layer's: the protocol layer never opens a
connection. Every failure of a fetch itself (refused, timed out, an HTTP error, a redirect that is
not allowed, too large, not an image) is one and the same 400: its wording would otherwise tell a
client what listens where behind an allowed host. The detail goes to the server's log.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from deepinfer_server.errors import BadRequestError
from deepinfer_server.protocol.core.images import AllowedOrigins, check_fetchable

logger = logging.getLogger(__name__)

_MAX_REDIRECTS = 3
#: What an image file starts with (PNG, JPEG, GIF); WebP is RIFF....WEBP.
_IMAGE_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a")

#: The one message of every failed fetch.
FETCH_FAILED = "the image could not be fetched from its URL"


class _FetchFailed(Exception):
    """Why one fetch failed (for the log only)."""


async def fetch_image(
    url: str, allowed: AllowedOrigins, timeout: float, max_bytes: int, param: str | None
) -> bytes:
    """The image's bytes, fetched within `timeout` seconds in all; the neutral 400 otherwise."""
    check_fetchable(url, allowed, param)
    try:
        async with asyncio.timeout(timeout):
            return await _fetch(url, allowed, timeout, max_bytes)
    except TimeoutError:
        detail = f"not done within --media-fetch-timeout {timeout:g}s"
    except (_FetchFailed, httpx.HTTPError, httpx.InvalidURL, httpx.StreamError, OSError) as exc:
        detail = f"{type(exc).__name__}: {exc}"
    logger.warning("image URL %r (%s): fetch failed: %s", url, param or "image", detail)
    raise BadRequestError(FETCH_FAILED, param=param)


async def _fetch(url: str, allowed: AllowedOrigins, timeout: float, max_bytes: int) -> bytes:
    async with httpx.AsyncClient(timeout=timeout, follow_redirects=False) as client:
        for hop in range(_MAX_REDIRECTS + 1):
            if hop and not allowed.allows(url):
                raise _FetchFailed(f"redirected to {url!r}, which is not allowed")
            async with client.stream("GET", url) as response:
                if response.is_redirect and "location" in response.headers:
                    url = str(response.url.join(response.headers["location"]))
                    continue
                if response.status_code != 200:
                    raise _FetchFailed(f"HTTP {response.status_code}")
                body = await _read_bounded(response, max_bytes)
                if not _looks_like_an_image(body):
                    raise _FetchFailed("the body is not a PNG, JPEG, GIF or WebP image")
                return body
    raise _FetchFailed(f"more than {_MAX_REDIRECTS} redirects")


async def _read_bounded(response: httpx.Response, max_bytes: int) -> bytes:
    length = response.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise _FetchFailed(f"Content-Length {length} exceeds --max-image-bytes {max_bytes}")
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body.extend(chunk)
        if len(body) > max_bytes:
            raise _FetchFailed(f"the body exceeds --max-image-bytes {max_bytes}")
    return bytes(body)


def _looks_like_an_image(body: bytes) -> bool:
    if body.startswith(_IMAGE_MAGIC):
        return True
    return body[:4] == b"RIFF" and body[8:12] == b"WEBP"


async def fetch_images(
    urls: list[tuple[str, str | None]],
    allowed: AllowedOrigins,
    timeout: float,
    max_bytes: int,
) -> dict[str, bytes]:
    """Every (url, param) fetched concurrently, each within `timeout`: the bytes by URL. The
    first failure cancels the other fetches and is raised."""
    unique = dict(urls)  # one fetch per URL
    tasks = [
        asyncio.ensure_future(fetch_image(url, allowed, timeout, max_bytes, param))
        for url, param in unique.items()
    ]
    try:
        bodies = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    return dict(zip(unique, bodies, strict=True))
