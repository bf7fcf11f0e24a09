"""Request bodies: a JSON content type, a size bound (413 without buffering an oversized body),
a time bound, and the process's receive budget (503 rather than buffer a body that does not fit
in it); `read_json_body` is every POST route's prologue."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from starlette.requests import Request

from deepinfer_server.api.receive_budget import ReceiveBudget, ReceiveBufferFullError
from deepinfer_server.config import ResolvedConfig
from deepinfer_server.errors import (
    BadRequestError,
    ErrorKind,
    RequestTimeoutError,
    RequestTooLargeError,
)
from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.core.validation import decode_json

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class JsonBody:
    """A POST route's body: its bytes, and the JSON object they hold."""

    raw: bytes
    value: JsonObject


async def read_json_body(
    request: Request, config: ResolvedConfig, budget: ReceiveBudget
) -> JsonBody:
    """The prologue of every POST route: a JSON content type (415), the body within
    `--max-request-bytes` (413), `--body-read-timeout` (408) and `budget` (503), logged with
    `--log-requests`, decoded as one bounded JSON object (400)."""
    require_json_content_type(request)
    raw = await read_body(request, config.max_request_bytes, config.body_read_timeout, budget)
    if config.log_requests:
        request_id = getattr(request.state, "request_id", "-")
        logger.info("request %s body: %s", request_id, raw[:65536].decode(errors="replace"))
    return JsonBody(raw, decode_json(raw))


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


async def read_body(request: Request, limit: int, timeout: float, budget: ReceiveBudget) -> bytes:
    """The whole body: 413 as soon as it passes `limit` bytes, 408 if it takes over `timeout`,
    415 if it is compressed (nothing here decompresses, and a decompressed size would have to
    be bounded too), 503 once its bytes do not fit in `budget` (held while it is read: a
    declared length at once, before any byte is read)."""
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise BadRequestError(
            f"Content-Encoding: {encoding[:40]} is not supported: send the body uncompressed",
            kind=ErrorKind.UNSUPPORTED_MEDIA_TYPE,
        )
    try:
        async with asyncio.timeout(timeout):
            return await _read(request, limit, budget)
    except TimeoutError:
        raise RequestTimeoutError(
            f"the request body did not arrive within {timeout:g}s", code="body_timeout"
        ) from None


async def _read(request: Request, limit: int, budget: ReceiveBudget) -> bytes:
    declared = request.headers.get("content-length")
    held = 0
    if declared is not None and declared.isdigit():
        if int(declared) > limit:
            raise RequestTooLargeError(f"the request body is larger than {limit} bytes")
        if not budget.take(int(declared)):
            raise ReceiveBufferFullError()
        held = int(declared)
    try:
        parts: list[bytes] = []
        size = 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise RequestTooLargeError(f"the request body is larger than {limit} bytes")
            if size > held:
                if not budget.take(size - held):
                    raise ReceiveBufferFullError()
                held = size
            parts.append(part)
        return b"".join(parts)
    finally:
        budget.give(held)
