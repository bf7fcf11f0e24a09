"""POST /v1/responses/input_tokens: the prompt tokens of a Responses request, without running it,
`{"object": "response.input_tokens", "input_tokens": N}` (openai-python's
`responses.input_tokens.count`).

The body is read, continued from the store (`previous_response_id`, `conversation`, item
references) and prepared exactly as `POST /v1/responses` does it, so the count is that
request's `usage.input_tokens`. Nothing is admitted, generated or stored: the fields that would
store or run the request (`store`, `background`, `stream`) are dropped, and `model`, optional
here, defaults to the served model.
"""

from __future__ import annotations

import dataclasses

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from deepinfer_server.api.endpoint import prepare_choices, read_request
from deepinfer_server.api.generation_protocol import Session
from deepinfer_server.api.routes.generation import RESPONSES
from deepinfer_server.api.state import AppState
from deepinfer_server.api.store_session import open_session
from deepinfer_server.ipc.messages import Images
from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.responses.request import PreparedResponses

#: What would store or run the request: a count does neither.
_RUN_FIELDS = ("store", "background", "stream")


async def _counting_session(
    request: Request, body: JsonObject
) -> Session[PreparedResponses] | None:
    """The store's session of the request as a count reads it: the history it continues, and
    nothing written."""
    state: AppState = request.app.state.server
    for name in _RUN_FIELDS:
        body.pop(name, None)
    body["store"] = False
    body.setdefault("model", state.config.served_model_name)
    return await open_session(request, body)


_COUNTING = dataclasses.replace(RESPONSES, open_session=_counting_session)


async def responses_input_tokens(request: Request) -> Response:
    """The input tokens `POST /v1/responses` would report for this body."""
    read = await read_request(request, _COUNTING)
    (prepared,) = await prepare_choices(request, _COUNTING, read)
    tokens = Images.prompt_tokens(prepared.prompt_token_ids, prepared.images)
    return JSONResponse({"object": "response.input_tokens", "input_tokens": tokens})
