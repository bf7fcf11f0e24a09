"""Anthropic's Message Batches (`/v1/messages/batches`) on the same runner and tables as
OpenAI's Batches (`api/routes/batches.py`): create, retrieve, list, cancel, delete, results.

Scoped by API key (another key's batch is a 404); the create request's body is bounded by
`--batch-max-file-mb`, its requests by `--batch-max-lines`, a key's unfinished batches by
`--batch-max-active`.
"""

from __future__ import annotations

import asyncio
import uuid

import orjson
from starlette.requests import Request
from starlette.responses import Response

from deepinfer_server.api.batches.message_batches import (
    ENDPOINT,
    WINDOW,
    batch_object,
    result_line,
)
from deepinfer_server.api.batches.message_requests import body_lines
from deepinfer_server.api.body import read_body, require_json_content_type
from deepinfer_server.api.routes.answers import fetched_page, json_answer
from deepinfer_server.api.routes.batches import (
    batch_storage_full,
    check_active,
    not_found,
    scoped,
)
from deepinfer_server.api.routes.paging import page_limit
from deepinfer_server.errors import BadRequestError
from deepinfer_server.store.batches import BatchRow

_KIND = "anthropic"


def _base_url(request: Request) -> str:
    return str(request.base_url).rstrip("/")


async def _batch(request: Request) -> tuple[BatchRow, str]:
    _, runner, scope = await scoped(request)
    batch_id: str = request.path_params["batch_id"]
    row = await runner.store.batch(scope, batch_id)
    if row is None or row.kind != _KIND:
        raise not_found("message batch", batch_id)
    return row, scope


async def create_message_batch(request: Request) -> Response:
    """Create a message batch of `requests: [{custom_id, params}]`."""
    state, runner, scope = await scoped(request)
    require_json_content_type(request)
    if await runner.store.quota_room(scope) == 0:  # refused before a byte of the body is read
        raise batch_storage_full("requests")
    raw = await read_body(
        request,
        state.config.batch_max_file_mb * 1024 * 1024,
        state.config.body_read_timeout,
        state.receiving,
    )
    lines = await asyncio.to_thread(body_lines, raw, state.config.batch_max_lines)
    await check_active(state, runner.store, scope)
    batch_id = f"msgbatch_{uuid.uuid4().hex}"
    if not await runner.store.add_batch(
        scope, _KIND, ENDPOINT, None, None, WINDOW, lines, batch_id
    ):
        raise batch_storage_full("requests")
    runner.wake()
    row = await runner.store.batch(scope, batch_id)
    assert row is not None
    return json_answer(batch_object(row, _base_url(request)))


async def retrieve_message_batch(request: Request) -> Response:
    row, _ = await _batch(request)
    return json_answer(batch_object(row, _base_url(request)))


async def list_message_batches(request: Request) -> Response:
    _, runner, scope = await scoped(request)
    limit = page_limit(request)
    rows = await runner.store.batches(scope, _KIND, request.query_params.get("after_id"), limit + 1)
    listed = fetched_page([batch_object(row, _base_url(request)) for row in rows], limit)
    # Anthropic's list is OpenAI's without its `object`.
    return json_answer({key: value for key, value in listed.items() if key != "object"})


async def cancel_message_batch(request: Request) -> Response:
    """Cancel a message batch: `canceling` until no request of it runs, then `ended`."""
    row, scope = await _batch(request)
    _, runner, _ = await scoped(request)
    await runner.store.move(row.id, "cancelling", sources=("validating", "in_progress"))
    runner.wake()
    found = await runner.store.batch(scope, row.id)
    assert found is not None
    return json_answer(batch_object(found, _base_url(request)))


async def delete_message_batch(request: Request) -> Response:
    """Delete an ended message batch (one still processing: cancel it first)."""
    row, scope = await _batch(request)
    if batch_object(row, "")["processing_status"] != "ended":
        raise BadRequestError(
            f"message batch {row.id} is still processing: cancel it, and delete it once ended"
        )
    _, runner, _ = await scoped(request)
    if not await runner.store.delete_batch(scope, row.id):
        raise not_found("message batch", row.id)
    return json_answer({"id": row.id, "type": "message_batch_deleted"})


async def message_batch_results(request: Request) -> Response:
    """An ended batch's results, one JSON line per request, in the order they were given."""
    row, _ = await _batch(request)
    if batch_object(row, "")["processing_status"] != "ended":
        raise BadRequestError(f"message batch {row.id} has not ended: its results are not ready")
    _, runner, _ = await scoped(request)
    lines = await runner.store.results(row.id)
    body = b"".join(orjson.dumps(result_line(row, line)) + b"\n" for line in lines)
    return Response(body, media_type="application/x-jsonl")
