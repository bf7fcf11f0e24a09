"""The one table from exceptions to HTTP responses, and its sibling for errors mid-stream."""

from __future__ import annotations

import logging

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from deepinfer_server.errors import ApiError, BadRequestError, EngineRequestError
from deepinfer_server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

_HTTP_STATUS_TYPES = {
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
}


def error_response(error: ApiError, metrics: ServerMetrics | None = None) -> Response:
    """An OpenAI-shaped JSON error response (counted in request_failure_total)."""
    if metrics is not None:
        metrics.observe_failure(error.status_code)
    return Response(
        orjson.dumps(error.to_body()),
        status_code=error.status_code,
        media_type="application/json",
        headers=error.headers(),
    )


def as_api_error(exc: BaseException, request_id: str = "-") -> ApiError:
    """Any exception as an ApiError; unexpected ones become a generic 500 (and are logged)."""
    if isinstance(exc, ApiError):
        return exc
    logger.error("request %s: unexpected error", request_id, exc_info=exc)
    return EngineRequestError("internal server error", code="internal_error", status_code=500)


def sse_error_payload(exc: BaseException, metrics: ServerMetrics, request_id: str) -> str:
    """The `data:` payload that reports an error after a stream has started (and counts it)."""
    error = as_api_error(exc, request_id)
    metrics.observe_failure(error.status_code)
    return orjson.dumps(error.to_body()).decode()


def _metrics(request: Request) -> ServerMetrics | None:
    server = getattr(request.app.state, "server", None)
    return None if server is None else server.metrics


async def handle_api_error(request: Request, exc: Exception) -> Response:
    request_id = getattr(request.state, "request_id", "-")
    return error_response(as_api_error(exc, request_id), _metrics(request))


async def handle_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error_type, code = _HTTP_STATUS_TYPES.get(exc.status_code, ("invalid_request_error", None))
    error = BadRequestError(str(exc.detail), code=code, status_code=exc.status_code)
    error.error_type = error_type
    return error_response(error, _metrics(request))
