"""Request bodies: a JSON content type, a size bound (413 without buffering an oversized body),
and a time bound."""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from deepinfer_server.errors import (
    BadRequestError,
    ErrorKind,
    RequestTimeoutError,
    RequestTooLargeError,
)


def require_json_content_type(request: Request) -> None:
    """415 unless the body is declared JSON (`application/json` or `application/*+json`).

    Browsers send text/plain, form and typeless bodies cross-site without asking first; a JSON
    content type needs a CORS preflight, which only `--allowed-origins` answers. So a web page
    cannot make its visitors' browsers spend inference here.
    """
    declared = request.headers.get("content-type", "")
    media_type = declared.split(";", 1)[0].strip().lower()
    if media_type == "application/json" or (
        media_type.startswith("application/") and media_type.endswith("+json")
    ):
        return
    shown = media_type or "none"
    raise BadRequestError(
        f"the request body must be JSON with Content-Type: application/json (got {shown}); "
        "with curl, use --json or -H 'Content-Type: application/json'",
        kind=ErrorKind.UNSUPPORTED_MEDIA_TYPE,
    )


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The whole body: 413 as soon as it passes `limit` bytes, 408 if it takes over `timeout`,
    415 if it is compressed (nothing here decompresses, and a decompressed size would have to
    be bounded too)."""
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise BadRequestError(
            f"Content-Encoding: {encoding[:40]} is not supported: send the body uncompressed",
            kind=ErrorKind.UNSUPPORTED_MEDIA_TYPE,
        )
    try:
        async with asyncio.timeout(timeout):
            return await _read(request, limit)
    except TimeoutError:
        raise RequestTimeoutError(
            f"the request body did not arrive within {timeout:g}s", code="body_timeout"
        ) from None


async def _read(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestTooLargeError(f"the request body is larger than {limit} bytes")
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise RequestTooLargeError(f"the request body is larger than {limit} bytes")
        parts.append(part)
    return b"".join(parts)
