"""Error responses: any exception as an ApiError, in the envelope of the path's protocol.

This is the HTTP side of the one error boundary: `as_api_error` turns anything into an ApiError
(unexpected exceptions become an InternalError, logged with the request ID), and
`error_response` renders it with the status from `errors.ERROR_TABLE` and the envelope of the
protocol the path speaks (`protocol/core/error_shapes.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import cache
from http import HTTPStatus
from typing import Any

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Scope

from deepinfer_server.api.dialects import PathDialects
from deepinfer_server.errors import ApiError, ClientDisconnected, ErrorKind
from deepinfer_server.protocol.core.error_shapes import anthropic_error_body, openai_error_body
from deepinfer_server.services.failures import api_error_of

logger = logging.getLogger(__name__)

_HTTP_STATUS_KINDS = {
    404: ErrorKind.NOT_FOUND,
    405: ErrorKind.METHOD_NOT_ALLOWED,
    413: ErrorKind.REQUEST_TOO_LARGE,
}


@cache
def path_dialects() -> PathDialects:
    """The dialect of every path, from the route table."""
    # Imported here: the table imports the routes, and they import this module.
    from deepinfer_server.api.route_table import ROUTES

    return PathDialects.of((endpoint.path, endpoint.dialect) for endpoint in ROUTES)


def speaks_anthropic(scope: Scope) -> bool:
    """True where the route table says the path speaks Anthropic's API (for `/v1/models`,
    when asked with an `anthropic-version` header): the one test of whether a client speaks
    Anthropic's API (for error envelopes and model lists alike)."""
    return path_dialects().speaks_anthropic(scope)


def envelope(anthropic: bool) -> Callable[[ApiError], dict[str, Any]]:
    """Anthropic's envelope where the client speaks Anthropic, OpenAI's everywhere else."""
    return anthropic_error_body if anthropic else openai_error_body


def as_api_error(exc: BaseException, request_id: str = "-") -> ApiError:
    """Any exception as an ApiError; unexpected ones become a 500 and are logged with the ID."""
    if isinstance(exc, ClientDisconnect):
        logger.info("request %s: the client disconnected while sending its body", request_id)
        return ClientDisconnected()
    return api_error_of(exc, request_id)


def error_response(error: ApiError, scope: Scope) -> Response:
    """A JSON error response in the envelope of the protocol the client speaks."""
    return Response(
        orjson.dumps(envelope(speaks_anthropic(scope))(error)),
        status_code=error.status_code,
        media_type="application/json",
        headers=error.headers(),
    )


def raw_error_response(error: ApiError, scope: Scope) -> bytes:
    """`error_response` as the bytes of a whole HTTP/1.1 response that closes the connection,
    for a request refused before it reached the app (`scope`: its path and headers so far)."""
    body = orjson.dumps(envelope(speaks_anthropic(scope))(error))
    status = error.status_code
    head = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *(f"{name}: {value}" for name, value in error.headers().items()),
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def handle_api_error(request: Request, exc: Exception) -> Response:
    request_id = getattr(request.state, "request_id", "-")
    return error_response(as_api_error(exc, request_id), request.scope)


async def handle_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = _HTTP_STATUS_KINDS.get(exc.status_code, ErrorKind.BAD_REQUEST)
    return error_response(ApiError(str(exc.detail), kind=kind), request.scope)
