"""Request body reading with a size bound (413 without buffering an oversized body)."""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from deepinfer_server.errors import RequestTimeoutError, RequestTooLargeError


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The whole body: 413 as soon as it passes `limit` bytes, 408 if it takes over `timeout`."""
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
