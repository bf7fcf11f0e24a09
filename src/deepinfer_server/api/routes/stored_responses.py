"""GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items, POST
/v1/responses/{id}/cancel: the Responses store (background responses: services/background.py).

Every read is in the request's scope (`api.store_scope.request_scope`): a response stored
under another API key is a 404, word for word as one that never existed. A store outage is a
503 (`StoreUnavailableError`); without a store (`--response-store none`) every ID is a 404.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from deepinfer_server.api.routes.answers import json_answer, list_page
from deepinfer_server.api.routes.paging import include_values, page_limit, page_order
from deepinfer_server.api.sse import FrameWriter, SSEResponse, complete
from deepinfer_server.api.state import AppState
from deepinfer_server.api.store_scope import request_scope
from deepinfer_server.errors import BadRequestError, ErrorKind
from deepinfer_server.protocol.responses.reasoning import (
    ENCRYPTED_CONTENT,
    ReasoningItems,
    ReasoningRequest,
    conversation_digest,
)
from deepinfer_server.protocol.responses.stored import (
    ITEMS_INCLUDE,
    RESPONSE_INCLUDE,
    check_include,
    response_not_found,
)
from deepinfer_server.protocol.responses.token_usage import complete_usage
from deepinfer_server.services.background_runs import cancel, lost, resume
from deepinfer_server.store import BrokenHistory, ResponseStore

_NO_STORE_HINT = " This server stores no responses (--response-store none)."
_MAX_SEQUENCE_NUMBER = 2**63 - 1


def _store(request: Request, response_id: str) -> ResponseStore:
    state: AppState = request.app.state.server
    if state.store is None:
        raise response_not_found(response_id, _NO_STORE_HINT)
    return state.store


async def retrieve_response(request: Request) -> Response:
    """The stored response; `include=reasoning.encrypted_content` seals its reasoning for the
    conversation as stored."""
    response_id: str = request.path_params["response_id"]
    store = _store(request, response_id)
    streaming = request.query_params.get("stream", "false").lower() == "true"
    after = _starting_after(request)
    include = include_values(request)
    check_include(include, RESPONSE_INCLUDE, "a stored response")
    scope = await request_scope(request, store)
    stored = await store.response(scope, response_id)
    if stored is None:
        raise response_not_found(response_id)
    state: AppState = request.app.state.server
    runs = state.background_runs
    body = stored.body
    if runs is not None and lost(stored.heartbeat_at):
        body = await runs.mark_lost(scope, response_id) or body
    if streaming:
        if runs is None or not body.get("background"):
            raise BadRequestError(
                "only a background response can be streamed again; omit `stream`",
                param="stream",
                kind=ErrorKind.UNSUPPORTED,
            )
        if await store.last_event(response_id) is None:  # its first is stored with it
            raise BadRequestError(
                "this background response was not created with `stream: true`; poll it "
                "without `stream`",
                param="stream",
            )
        frames = resume(runs, scope, response_id, after)

        async def write_body(write: FrameWriter) -> None:
            async for frame in frames:
                await complete(write(frame.encode()))

        return SSEResponse(write_body)  # type: ignore[return-value]  # an ASGI app, as a route answers
    if ENCRYPTED_CONTENT in include:
        try:
            history = await store.history(scope, response_id) or []
        except BrokenHistory:  # sealed after what is left of the conversation
            history = []
        inputs = history[: len(history) - len(stored.output_items)]
        asked = ReasoningRequest(encrypted=True, conversation=conversation_digest(inputs))
        body = ReasoningItems(asked, state.recipe.reasoning_seal).response(body)
    # A response stored by an earlier release lacks usage fields the clients now require.
    return json_answer(complete_usage(body))


def _starting_after(request: Request) -> int:
    raw = request.query_params.get("starting_after")
    if raw is None:
        return -1
    try:
        after = int(raw)
    except ValueError:
        after = None
    # -1 (before the first event) is the default; the store reads a signed 64-bit integer,
    # beyond which the stream would fail after its 200
    if after is None or not -1 <= after <= _MAX_SEQUENCE_NUMBER:
        raise BadRequestError(
            "'starting_after' must be an event's sequence number (an integer from -1 to "
            f"{_MAX_SEQUENCE_NUMBER})",
            param="starting_after",
        )
    return after


async def cancel_response(request: Request) -> Response:
    """Cancel a background response still running (its generation stops, its slot is
    freed); a finished one is returned unchanged."""
    response_id: str = request.path_params["response_id"]
    store = _store(request, response_id)
    scope = await request_scope(request, store)
    stored = await store.response(scope, response_id)
    if stored is None:
        raise response_not_found(response_id)
    state: AppState = request.app.state.server
    if state.background_runs is None or not stored.body.get("background"):
        raise BadRequestError("Cannot cancel a synchronous response.")
    body = await cancel(state.background_runs, scope, response_id)
    if body is None:
        raise response_not_found(response_id)
    return json_answer(body)


async def delete_response(request: Request) -> Response:
    response_id: str = request.path_params["response_id"]
    store = _store(request, response_id)
    if not await store.delete(await request_scope(request, store), response_id):
        raise response_not_found(response_id)
    return json_answer({"id": response_id, "object": "response", "deleted": True})


async def list_input_items(request: Request) -> Response:
    """The response's own input items (item references resolved), a page at a time."""
    response_id: str = request.path_params["response_id"]
    store = _store(request, response_id)
    limit, order = page_limit(request), page_order(request)
    check_include(include_values(request), ITEMS_INCLUDE, "input items")
    page = await store.input_items(
        await request_scope(request, store),
        response_id,
        after=request.query_params.get("after"),
        limit=limit,
        order=order,
    )
    if page is None:
        raise response_not_found(response_id)
    return json_answer(list_page(page.items, page.has_more))
