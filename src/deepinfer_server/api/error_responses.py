"""Errors as ApiErrors and their envelopes: the half of the one error boundary that needs no
route table (the handlers' side may import it).

`as_api_error` turns anything into an ApiError (unexpected exceptions become an InternalError,
logged with the request ID; `services/failures.py` holds the rule for work outside a request);
`envelope` is the body each protocol's clients read an error in
(`protocol/core/error_shapes.py`). Which protocol a path speaks, and the responses themselves,
are `api/path_errors.py`'s, from the route table.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from starlette.requests import ClientDisconnect

from deepinfer_server.errors import ApiError, ClientDisconnected
from deepinfer_server.protocol.core.error_shapes import anthropic_error_body, openai_error_body
from deepinfer_server.services.failures import api_error_of

logger = logging.getLogger(__name__)


def envelope(anthropic: bool) -> Callable[[ApiError], dict[str, Any]]:
    """Anthropic's envelope where the client speaks Anthropic, OpenAI's everywhere else."""
    return anthropic_error_body if anthropic else openai_error_body


def as_api_error(exc: BaseException, request_id: str = "-") -> ApiError:
    """Any exception as an ApiError; unexpected ones become a 500 and are logged with the ID."""
    if isinstance(exc, ClientDisconnect):
        logger.info("request %s: the client disconnected while sending its body", request_id)
        return ClientDisconnected()
    return api_error_of(exc, request_id)
