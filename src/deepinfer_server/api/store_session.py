"""The Responses store around one `POST /v1/responses`, as HTTP: whether the request takes it
(`open_session`), and the answer of a background response (its queued body, or its stream).

The session itself (what is read before generation, written after, and the background run) is
`services/responses_session.py`'s; this module reads the request (its body's `store`,
`background`, `conversation` and references, its API key's scope, its request ID) and writes
the answer.
"""

from __future__ import annotations

import uuid

import orjson
from starlette.requests import Request
from starlette.responses import Response

from deepinfer_server.api.sse import FrameWriter, SSEResponse, complete
from deepinfer_server.api.state import AppState
from deepinfer_server.api.store_scope import request_scope
from deepinfer_server.coordinator.handle import RequestHandle
from deepinfer_server.disaggregation.role import DisaggregationRole
from deepinfer_server.errors import BadRequestError, StoredObjectNotFound
from deepinfer_server.metrics import RequestRecord
from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.core.validation import optional_bool
from deepinfer_server.protocol.responses.conversations import read_conversation
from deepinfer_server.protocol.responses.stored import (
    check_previous_response_id,
    input_list,
    referenced_ids,
)
from deepinfer_server.services.responses_session import ResponsesSession


def _client_chose_request_id(request: Request) -> bool:
    return "x-request-id" in request.headers


class StoredSession(ResponsesSession):
    """A Responses session that answers a background response over HTTP."""

    async def run_in_background(
        self, handle: RequestHandle, record: RequestRecord, streaming: bool
    ) -> Response | SSEResponse:
        """Store the response as queued, start its run (which owns `handle` from here on) and
        answer: the queued response, or the stream of its events (the client may leave)."""
        run, queued = await self.start_in_background(handle, record, streaming)
        if not streaming:
            return Response(orjson.dumps(queued), media_type="application/json")

        async def write_body(write: FrameWriter) -> None:
            async for frame in run.follow(-1):
                await complete(write(frame.encode()))

        return SSEResponse(write_body)


def _prefill_leg(body: JsonObject, has_store: bool) -> None:
    """A prefill server's part in a Responses request: its answer is the first token of one
    a decode server gives, runs and stores. `store` (a PD gateway sets it on every request) is
    the decode server's to honour, so it is taken out of the body here; what needs the history
    is read from the store the decode servers write, which this server must then share."""
    optional_bool(body, "store")  # still a boolean when given
    body.pop("store", None)
    if optional_bool(body, "background"):
        raise BadRequestError(
            "a prefill server runs no background responses: the decode server that answers "
            "the request runs and stores them",
            param="background",
        )
    if has_store:
        return
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            raise BadRequestError(
                f"{name} needs the Responses store the decode servers write, and this prefill "
                "server has none (--response-store none): give it the decode servers' "
                "--response-store",
                param=name,
            )


async def open_session(request: Request, body: JsonObject) -> StoredSession | None:
    """The session of a Responses request the store serves, or None (the stateless path)."""
    state: AppState = request.app.state.server
    store = state.store
    # A prefill server's answer would be a stored row no client sees, taking the key's quota.
    prefill_leg = state.config.disaggregation_mode is DisaggregationRole.PREFILL
    if prefill_leg:
        _prefill_leg(body, store is not None)
    if store is None:
        return None  # the preparation refuses what needs a store, as without one
    stored = optional_bool(body, "store", default=True) and not prefill_leg
    conversation = read_conversation(body)
    previous = check_previous_response_id(body)
    references = referenced_ids(input_list(body), reasoning=False)
    background = optional_bool(body, "background")
    if background and not stored:
        raise BadRequestError(
            "background responses must be stored: omit `store` or set it to true",
            param="store",
        )
    if not stored and previous is None and not references and conversation is None:
        return None
    request_id: str = request.state.request_id
    # Stored IDs must be unique: a client's X-Request-Id may repeat.
    unique = uuid.uuid4().hex if stored and _client_chose_request_id(request) else request_id
    session = StoredSession(
        state,
        store,
        await request_scope(request, store),
        f"resp_{unique}",
        stored,
        previous,
        background,
        conversation,
        appends=not prefill_leg,
    )
    try:
        await session.expand(body)
    except StoredObjectNotFound as missing:
        if prefill_leg:
            raise StoredObjectNotFound(
                f"{missing.message} A prefill server reads the history its decode servers "
                "stored: give it the decode servers' --response-store",
                param=missing.param,
                kind=missing.kind,
            ) from None
        raise
    return session
