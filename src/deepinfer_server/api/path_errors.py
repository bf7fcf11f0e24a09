"""Error responses in the envelope of the API the path speaks, as the route table declares it.

This is the HTTP side of the one error boundary: `error_response` renders an ApiError
(`api/error_responses.py`) with the status from `errors.ERROR_TABLE` and the envelope of the
protocol the path speaks (`dialects.py`, from `ROUTES`). It imports the route table, so the
handlers' modules never import it: the app, its middleware and the connection guards do.
"""

from __future__ import annotations

from functools import cache
from http import HTTPStatus

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Scope

from deepinfer_server.api.dialects import PathDialects
from deepinfer_server.api.error_responses import as_api_error, envelope
from deepinfer_server.api.route_table import ROUTES
from deepinfer_server.errors import ApiError, ErrorKind

_HTTP_STATUS_KINDS = {
    404: ErrorKind.NOT_FOUND,
    405: ErrorKind.METHOD_NOT_ALLOWED,
    413: ErrorKind.REQUEST_TOO_LARGE,
}


@cache
def path_dialects() -> PathDialects:
    """The dialect of every path, from the route table."""
    return PathDialects.of((endpoint.path, endpoint.dialect) for endpoint in ROUTES)


def speaks_anthropic(scope: Scope) -> bool:
    """True where the route table says the path speaks Anthropic's API (for `/v1/models`,
    when asked with an `anthropic-version` header): the one test of whether a client speaks
    Anthropic's API for an error's envelope."""
    return path_dialects().speaks_anthropic(scope)


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
    """The app's handler of an ApiError (and of anything else reaching it)."""
    request_id = getattr(request.state, "request_id", "-")
    return error_response(as_api_error(exc, request_id), request.scope)


async def handle_http_exception(request: Request, exc: Exception) -> Response:
    """The app's handler of Starlette's HTTPException (a 404, 405 or 413 of its routing)."""
    assert isinstance(exc, HTTPException)
    kind = _HTTP_STATUS_KINDS.get(exc.status_code, ErrorKind.BAD_REQUEST)
    return error_response(ApiError(str(exc.detail), kind=kind), request.scope)
