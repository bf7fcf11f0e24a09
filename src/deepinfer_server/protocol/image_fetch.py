"""Fetching image URLs, only from the domains the operator allows, within time and size limits.

Off unless `--allowed-media-domains` names domains. A URL is fetched when its scheme is http or
https and its host is exactly one of the allowed domains (case-insensitive); every redirect
target must be allowed too. The body may take at most `--media-fetch-timeout` seconds as a whole
and may not exceed `--max-image-bytes` (413). Any other failure is a 400 naming the image.
"""

from __future__ import annotations

import time
from urllib.parse import urljoin, urlsplit

import httpx

from deepinfer_server.errors import BadRequestError, ErrorKind

_MAX_REDIRECTS = 3


def _allowed(url: str, allowed_domains: tuple[str, ...]) -> bool:
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    return parts.scheme in ("http", "https") and host in allowed_domains


def fetch_image(
    url: str, allowed_domains: tuple[str, ...], timeout: float, max_bytes: int, param: str | None
) -> bytes:
    """The image's bytes, or a 400 (not allowed, unreachable, slow) or 413 (too large)."""
    if not allowed_domains:
        raise BadRequestError(
            "image URLs are not fetched by this server: send the image inline as a "
            "`data:image/...;base64,...` URL",
            param=param,
            kind=ErrorKind.UNSUPPORTED,
            code="unsupported_content",
        )
    deadline = time.monotonic() + timeout
    try:
        with httpx.Client(timeout=timeout, follow_redirects=False) as client:
            for _ in range(_MAX_REDIRECTS + 1):
                if not _allowed(url, allowed_domains):
                    raise BadRequestError(
                        f"image URL {url!r} is not on this server's --allowed-media-domains",
                        param=param,
                        kind=ErrorKind.UNSUPPORTED,
                    )
                with client.stream("GET", url) as response:
                    if response.is_redirect and "location" in response.headers:
                        url = urljoin(url, response.headers["location"])
                        continue
                    if response.status_code != 200:
                        raise BadRequestError(
                            f"fetching the image failed: HTTP {response.status_code}", param=param
                        )
                    return _read_bounded(response, deadline, max_bytes, param)
    except httpx.HTTPError as exc:
        raise BadRequestError(f"fetching the image failed: {exc}", param=param) from exc
    raise BadRequestError("fetching the image failed: too many redirects", param=param)


def _read_bounded(
    response: httpx.Response, deadline: float, max_bytes: int, param: str | None
) -> bytes:
    body = bytearray()
    for chunk in response.iter_bytes():
        body.extend(chunk)
        if len(body) > max_bytes:
            raise BadRequestError(
                f"an image is larger than this server's limit of {max_bytes} bytes",
                param=param,
                kind=ErrorKind.REQUEST_TOO_LARGE,
            )
        if time.monotonic() > deadline:
            raise BadRequestError(
                "fetching the image took longer than --media-fetch-timeout", param=param
            )
    return bytes(body)
