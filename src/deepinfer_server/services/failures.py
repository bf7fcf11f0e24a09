"""Any exception as an ApiError, for work that runs outside an HTTP request's handler (a
background response's run): the error boundary's rule without the HTTP layer's own cases."""

from __future__ import annotations

import logging

from deepinfer_server.errors import ApiError, InternalError

logger = logging.getLogger(__name__)


def api_error_of(exc: BaseException, request_id: str = "-") -> ApiError:
    """`exc` if it is an ApiError; anything else is a 500, logged with the request's ID."""
    if isinstance(exc, ApiError):
        return exc
    logger.error("request %s: unexpected error", request_id, exc_info=exc)
    return InternalError()
