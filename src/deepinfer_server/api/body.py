"""Request body reading with a size bound (413 without buffering an oversized body)."""

from __future__ import annotations

from starlette.requests import Request

from deepinfer_server.errors import RequestTooLargeError

DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024


async def read_body(request: Request, limit: int = DEFAULT_MAX_REQUEST_BYTES) -> bytes:
    """The whole body, or RequestTooLargeError as soon as it passes `limit` bytes."""
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
