"""The one table from exceptions to HTTP responses, and its sibling for errors mid-stream."""

from __future__ import annotations

import logging
from typing import Any

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from deepinfer_server.errors import ApiError, BadRequestError, EngineRequestError
from deepinfer_server.metrics import ServerMetrics
from deepinfer_server.protocol.messages import anthropic_error_body

logger = logging.getLogger(__name__)

_HTTP_STATUS_TYPES = {
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
}


ANTHROPIC_PATH_PREFIX = "/v1/messages"


def error_body_for(path: str, error: ApiError) -> dict[str, Any]:
    """The error envelope clients of this path expect: Anthropic's for /v1/messages,
    OpenAI's everywhere else."""
    if path.startswith(ANTHROPIC_PATH_PREFIX):
        return anthropic_error_body(error)
    return error.to_body()


def error_response(
    error: ApiError, metrics: ServerMetrics | None = None, path: str = ""
) -> Response:
    """A JSON error response in the path's envelope (counted in request_failure_total)."""
    if metrics is not None:
        metrics.observe_failure(error.status_code)
    return Response(
        orjson.dumps(error_body_for(path, error)),
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


def _metrics(request: Request) -> ServerMetrics | None:
    server = getattr(request.app.state, "server", None)
    return None if server is None else server.metrics


async def handle_api_error(request: Request, exc: Exception) -> Response:
    request_id = getattr(request.state, "request_id", "-")
    return error_response(as_api_error(exc, request_id), _metrics(request), request.url.path)


async def handle_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error_type, code = _HTTP_STATUS_TYPES.get(exc.status_code, ("invalid_request_error", None))
    error = BadRequestError(str(exc.detail), code=code, status_code=exc.status_code)
    error.error_type = error_type
    return error_response(error, _metrics(request), request.url.path)
