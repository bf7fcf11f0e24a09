"""RequestContextMiddleware: X-Request-Id on every response and one access-log line per request.

Pure ASGI (it never buffers a body), so streamed responses pass through untouched. The request
ID comes from the client's `X-Request-Id` when it is usable (sanitised, at most 128 characters)
or is generated; routes read it from `request.state.request_id` and may leave their
`RequestRecord` in `request.state.record` for the log line.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deepinfer_server.metrics import RequestRecord

access_logger = logging.getLogger("deepinfer_server.access")

REQUEST_ID_HEADER = b"x-request-id"
MAX_REQUEST_ID_LENGTH = 128
_UNSAFE = re.compile(r"[^A-Za-z0-9._:\-]")


def sanitise_request_id(raw: str | None) -> str | None:
    """The client's request ID with unsafe characters removed, or None if nothing usable is left."""
    if not raw:
        return None
    cleaned = _UNSAFE.sub("", raw)[:MAX_REQUEST_ID_LENGTH]
    return cleaned or None


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value).decode("latin-1")
    return None


class RequestContextMiddleware:
    """Assigns request IDs, echoes them, and writes the access log."""

    def __init__(self, app: ASGIApp, access_log: bool) -> None:
        self.app = app
        self.access_log = access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = sanitise_request_id(_header(scope, REQUEST_ID_HEADER)) or uuid.uuid4().hex
        state: dict[str, Any] = scope.setdefault("state", {})
        state["request_id"] = request_id
        started = time.perf_counter()
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [
                    *message.get("headers", []),
                    (REQUEST_ID_HEADER, request_id.encode()),
                ]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if self.access_log:
                self._log(scope, status, request_id, started, state.get("record"))

    @staticmethod
    def _log(
        scope: Scope, status: int, request_id: str, started: float, record: RequestRecord | None
    ) -> None:
        duration_ms = (time.perf_counter() - started) * 1000
        details = ""
        if record is not None:
            ttft = "-" if record.ttft is None else f"{record.ttft * 1000:.1f}"
            details = (
                f" prompt_tokens={record.prompt_tokens}"
                f" completion_tokens={record.generation_tokens}"
                f" ttft_ms={ttft} finish_reason={record.finish_reason or '-'}"
            )
        access_logger.info(
            "%s %s %s request_id=%s%s duration_ms=%.1f",
            scope["method"],
            scope["path"],
            status or "-",
            request_id,
            details,
            duration_ms,
        )
