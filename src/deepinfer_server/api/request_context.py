"""RequestContextMiddleware: request IDs, the error boundary, failure metrics, the access log.

Pure ASGI (it never buffers a body), so streamed responses pass through untouched. The request
ID comes from the client's `X-Request-Id` when it is usable (sanitised, at most 128 characters)
or is generated; routes read it from `request.state.request_id` and may leave their
`RequestRecord` in `request.state.record` for the log line. It is the outermost middleware of
the app, so every response carries the ID: an exception that escapes the routes (a bug, a
client that vanished mid-body) is answered here, in the path's error envelope, and logged with
the ID. Every error status is counted once here, in `request_failure_total`.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deepinfer_server.api.disconnect import CLIENT_LEFT
from deepinfer_server.api.error_responses import as_api_error
from deepinfer_server.api.path_errors import error_response
from deepinfer_server.errors import ERROR_TABLE, ErrorKind
from deepinfer_server.metrics import ChoiceRecords, RequestRecord

access_logger = logging.getLogger("deepinfer_server.access")

REQUEST_ID_HEADER = b"x-request-id"
MAX_REQUEST_ID_LENGTH = 128
_UNSAFE = re.compile(r"[^A-Za-z0-9._:\-]")
#: Statuses that are not request failures: the client left (499), or it is not allowed in
#: (401: anyone can send those, so counting them would let strangers move the failure rate).
_NOT_FAILURES = frozenset(
    {
        ERROR_TABLE[ErrorKind.CLIENT_DISCONNECTED].status,
        ERROR_TABLE[ErrorKind.AUTHENTICATION].status,
    }
)
#: Probe endpoints whose 503s are states, not request failures.
_PROBES = frozenset({"/health"})


def loggable(text: str) -> str:
    """`text` safe for one log line: what is not printable (line breaks, terminal escapes,
    direction overrides), spaces (the line's field separator) and backslashes (the escape
    character itself) become `\\xNN` / `\\uNNNN`."""
    if text.isprintable() and " " not in text and "\\" not in text:
        return text
    return "".join(
        char if char.isprintable() and char not in " \\" else _escape(char) for char in text
    )


def _escape(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


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
    """Assigns request IDs, echoes them, answers escaped exceptions, writes the access log."""

    def __init__(self, app: ASGIApp, access_log: bool, on_failure: Callable[[int], None]) -> None:
        self.app = app
        self.access_log = access_log
        self._on_failure = on_failure

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
            try:
                await self.app(scope, receive, send_with_id)
            except Exception as exc:
                if status:  # the response has started: all that is left is to drop the line
                    raise
                error = as_api_error(exc, request_id)
                await error_response(error, scope)(scope, receive, send_with_id)
            if status >= 400 and status not in _NOT_FAILURES and scope["path"] not in _PROBES:
                self._on_failure(status)
        finally:
            if self.access_log:
                # A client that left mid-stream got a 200 start line; the log says it left.
                left = ERROR_TABLE[ErrorKind.CLIENT_DISCONNECTED].status
                logged = left if state.get(CLIENT_LEFT) else status
                self._log(
                    scope,
                    logged,
                    request_id,
                    started,
                    state.get("record"),
                    state.get("tenant_name"),
                )

    @staticmethod
    def _log(
        scope: Scope,
        status: int,
        request_id: str,
        started: float,
        record: RequestRecord | ChoiceRecords | None,
        tenant: str | None,
    ) -> None:
        duration_ms = (time.perf_counter() - started) * 1000
        # The key's name (`--api-key-file`), never the key.
        details = "" if tenant is None else f" tenant={tenant}"
        if record is not None:
            ttft = "-" if record.ttft is None else f"{record.ttft * 1000:.1f}"
            finish = record.client_finish_reason or record.finish_reason or "-"
            details += (
                f" prompt_tokens={record.prompt_tokens}"
                f" completion_tokens={record.generation_tokens}"
                f" ttft_ms={ttft} finish_reason={finish}"
            )
            if record.error_kind is not None:
                details += f" error={record.error_kind}"
        access_logger.info(
            "%s %s %s request_id=%s%s duration_ms=%.1f",
            scope["method"],
            loggable(scope["path"]),
            status or "-",
            request_id,
            details,
            duration_ms,
        )
