"""OpenAI's Files (`/v1/files`, batch input files and batches' output files) and Batches
(`/v1/batches`), on the Responses store; the work is `services/batch_runner.py`'s.

Scoped like stored responses (`api.store_scope.request_scope`): another API key's file or
batch is a 404. Limits (per API key): `--batch-max-file-mb` (413), the store's byte caps on
the key's files and batches and on every key's, and `--files-key-max-count` files (413,
`_QUOTA`: refused, never evicted), `--batch-max-lines` (400), `--batch-max-active` unfinished
batches (429). Without a store (`--response-store none`) every route is a 400 that says so.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Scope

from deepinfer_server.api.batches.input_file import decode_utf8, input_lines
from deepinfer_server.api.batches.openai_batches import (
    ENDPOINTS,
    METADATA_KEY_CHARS,
    METADATA_PAIRS,
    METADATA_VALUE_CHARS,
    WINDOWS,
    batch_object,
    file_object,
)
from deepinfer_server.api.body import read_body, read_json_body
from deepinfer_server.api.dialects import sends_anthropic_version
from deepinfer_server.api.routes.answers import fetched_page, json_answer
from deepinfer_server.api.routes.paging import page_limit
from deepinfer_server.api.state import AppState
from deepinfer_server.api.store_scope import request_scope
from deepinfer_server.errors import (
    BadRequestError,
    ErrorKind,
    OverloadedError,
    RequestTooLargeError,
    StoredObjectNotFound,
)
from deepinfer_server.services.batch_runner import BatchRunner
from deepinfer_server.store.batches import BatchStore

Found = TypeVar("Found")

#: Room for the multipart framing and the other fields around a file of the largest size.
_FORM_SLACK = 64 * 1024
#: What bounds the files kept, in an upload's 413 when they are full.
_QUOTA = (
    "its files and batches may take --response-store-key-max-mb and every key's "
    "--response-store-max-mb, its files number at most --files-key-max-count, and they are "
    "never deleted to make room; delete files (DELETE /v1/files/{id}) or ended batches it no "
    "longer needs"
)
#: The purposes of the files this server stores: batch input files (it writes the others).
_UPLOAD_PURPOSES = ("batch",)


def _runner(request: Request) -> tuple[AppState, BatchRunner]:
    state: AppState = request.app.state.server
    if state.batches is None:
        raise BadRequestError(
            "this server keeps no files or batches: it runs without a store "
            "(--response-store none)",
            kind=ErrorKind.UNSUPPORTED,
        )
    return state, state.batches


async def scoped(request: Request) -> tuple[AppState, BatchRunner, str]:
    state, runner = _runner(request)
    assert state.store is not None
    return state, runner, await request_scope(request, state.store)


async def _files_scoped(request: Request) -> tuple[AppState, BatchRunner, str]:
    """`scoped`, for a request of OpenAI's Files API; a request of Anthropic's (an
    `anthropic-version` header, or an `anthropic-beta` naming the Files API) is a 400 in
    Anthropic's envelope: this server's Messages cannot refer to a file, so storing one for
    them would answer 200 to an upload nothing can use, in a shape those clients cannot read."""
    beta = request.headers.get("anthropic-beta", "")
    if sends_anthropic_version(request.scope) or "files-api" in beta:
        raise BadRequestError(
            "this server does not implement Anthropic's Files API (its Messages take a "
            "document's content, not a file_id): /v1/files is OpenAI's Files API here, for "
            "batch input files"
        )
    return await scoped(request)


def not_found(kind: str, object_id: str) -> StoredObjectNotFound:
    return StoredObjectNotFound(f"No {kind} found with id {object_id!r}.", kind=ErrorKind.NOT_FOUND)


# Files.


async def create_file(request: Request) -> Response:
    """Store a batch input file (multipart: `file`, `purpose: "batch"`)."""
    state, runner, scope = await _files_scoped(request)
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "multipart/form-data":
        raise BadRequestError(
            "upload a file as multipart/form-data with the fields `file` and `purpose`",
            kind=ErrorKind.UNSUPPORTED_MEDIA_TYPE,
        )
    limit = state.config.batch_max_file_mb * 1024 * 1024
    purpose, filename, data = await _form_file(
        request, await _upload_body(request, runner.store, scope, limit)
    )
    if len(data) > limit:
        raise RequestTooLargeError(
            f"the file is {len(data)} bytes; this server takes batch input files of at most "
            f"{limit} bytes (--batch-max-file-mb)",
            param="file",
        )
    content = await asyncio.to_thread(decode_utf8, data)
    if content is None:
        raise BadRequestError("a batch input file must be UTF-8 JSONL", param="file")
    row = await runner.store.upload_file(scope, str(purpose), filename, content, len(data))
    if row is None:
        raise _quota_full(len(data))
    return json_answer(file_object(row))


async def _upload_body(request: Request, store: BatchStore, scope: str, limit: int) -> bytes:
    """The upload's whole body, refused (413) as soon as it cannot fit under `limit` or in the
    room `scope`'s files have left: before it is read, or once it passes that room."""
    state: AppState = request.app.state.server
    room = await store.upload_room(scope)
    if room == 0:
        raise _quota_full(None)
    try:
        return await read_body(
            request, min(limit, room) + _FORM_SLACK, state.config.body_read_timeout, state.receiving
        )
    except RequestTooLargeError:
        if room >= limit:
            raise
        raise _quota_full(None) from None


async def _form_file(request: Request, raw: bytes) -> tuple[str, str, bytes]:
    """The upload's purpose, file name and content, from its multipart body `raw`: parsed in
    a worker thread, on a loop of its own, since the parser scans and copies the whole file
    (and writes it to a temporary file) in steps that would each hold the event loop."""
    return await asyncio.to_thread(asyncio.run, _parsed_form(request.scope, raw))


async def _parsed_form(scope: Scope, raw: bytes) -> tuple[str, str, bytes]:
    async def replay() -> Message:
        return {"type": "http.request", "body": raw, "more_body": False}

    async with Request(scope, replay).form(max_files=1, max_fields=8) as form:
        purpose = form.get("purpose")
        upload = form.get("file")
        if purpose not in _UPLOAD_PURPOSES:
            raise BadRequestError(
                "'purpose' must be 'batch': this server stores batch input files only",
                param="purpose",
            )
        if not isinstance(upload, UploadFile):
            raise BadRequestError("the form has no `file`", param="file")
        return str(purpose), upload.filename or "upload.jsonl", await upload.read()


def _quota_full(size: int | None) -> RequestTooLargeError:
    """The 413 of an upload that does not fit in what the store may still keep of files (of
    `size` bytes, when it is known)."""
    what = "the file" if size is None else f"the file of {size} bytes"
    return RequestTooLargeError(
        f"{what} does not fit in this API key's file storage: {_QUOTA}",
        param="file",
        code="file_storage_full",
    )


def batch_storage_full(param: str) -> RequestTooLargeError:
    """The 413 of a new batch whose requests do not fit in what the store may still keep of
    the key's files and batches (nothing of it stored)."""
    return RequestTooLargeError(
        f"the batch does not fit in this API key's storage: {_QUOTA}",
        param=param,
        code="batch_storage_full",
    )


async def list_files(request: Request) -> Response:
    _, runner, scope = await _files_scoped(request)
    limit = page_limit(request)
    rows = await runner.store.files(
        scope, request.query_params.get("purpose"), request.query_params.get("after"), limit + 1
    )
    return json_answer(fetched_page([file_object(row) for row in rows], limit))


async def _read_file(
    request: Request, read: Callable[[BatchStore, str, str], Awaitable[Found | None]]
) -> Found:
    """What `read` finds of the path's file in the request's scope (a 404 when nothing)."""
    _, runner, scope = await _files_scoped(request)
    file_id: str = request.path_params["file_id"]
    found = await read(runner.store, scope, file_id)
    if found is None:
        raise not_found("file", file_id)
    return found


async def retrieve_file(request: Request) -> Response:
    """The `file` object."""
    return json_answer(file_object(await _read_file(request, BatchStore.file)))


async def file_content(request: Request) -> Response:
    """The file's content, as stored (JSONL)."""
    content = await _read_file(request, BatchStore.file_content)
    return Response(content.encode(), media_type="application/jsonl")


async def delete_file(request: Request) -> Response:
    _, runner, scope = await _files_scoped(request)
    file_id: str = request.path_params["file_id"]
    if not await runner.store.delete_file(scope, file_id):
        raise not_found("file", file_id)
    return json_answer({"id": file_id, "object": "file", "deleted": True})


# Batches.


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if (
        not isinstance(value, dict)
        or len(value) > METADATA_PAIRS
        or not all(
            isinstance(key, str)
            and isinstance(text, str)
            and len(key) <= METADATA_KEY_CHARS
            and len(text) <= METADATA_VALUE_CHARS
            for key, text in value.items()
        )
    ):
        raise BadRequestError(
            f"'metadata' must be an object of at most {METADATA_PAIRS} string values "
            f"(keys up to {METADATA_KEY_CHARS} characters, values up to "
            f"{METADATA_VALUE_CHARS})",
            param="metadata",
        )
    return value


async def check_active(state: AppState, store: BatchStore, scope: str) -> None:
    """429 when the API key has `--batch-max-active` batches unfinished."""
    limit = state.config.batch_max_active
    if await store.active_count(scope) >= limit:
        raise OverloadedError(
            f"this API key has {limit} batches unfinished, the most it may have "
            "(--batch-max-active): wait for one to end, or cancel one",
            retry_after_seconds=60,
        )


async def create_batch(request: Request) -> Response:
    """Create a batch from an uploaded input file; its lines are stored with it."""
    state, runner, scope = await scoped(request)
    body = (await read_json_body(request, state.config, state.receiving)).value
    endpoint = body.get("endpoint")
    if not isinstance(endpoint, str) or endpoint not in ENDPOINTS:
        raise BadRequestError(f"'endpoint' must be one of {', '.join(ENDPOINTS)}", param="endpoint")
    window = body.get("completion_window")
    if not isinstance(window, str) or window not in WINDOWS:
        raise BadRequestError("'completion_window' must be '24h'", param="completion_window")
    metadata = _metadata(body.get("metadata"))
    extra = sorted(set(body) - {"endpoint", "completion_window", "metadata", "input_file_id"})
    if extra:
        raise BadRequestError(f"unknown parameter {extra[0]!r}", param=extra[0])
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str):
        raise BadRequestError("'input_file_id' must be a file's id", param="input_file_id")
    file = await runner.store.file(scope, file_id)
    content = None
    if file is not None and file.purpose == "batch":
        content = await runner.store.file_content(scope, file_id)
    if content is None:
        raise BadRequestError(
            f"no batch input file {file_id!r} (upload one with purpose 'batch')",
            param="input_file_id",
        )
    limit = state.config.batch_max_lines
    lines = await asyncio.to_thread(input_lines, content, str(endpoint), limit)
    if not lines:
        raise BadRequestError("the input file has no requests", param="input_file_id")
    await check_active(state, runner.store, scope)
    batch_id = f"batch_{uuid.uuid4().hex}"
    if not await runner.store.add_batch(
        scope, "openai", str(endpoint), file_id, metadata, WINDOWS[window], lines, batch_id
    ):
        raise batch_storage_full("input_file_id")
    runner.wake()
    row = await runner.store.batch(scope, batch_id)
    assert row is not None
    return json_answer(batch_object(row))


async def retrieve_batch(request: Request) -> Response:
    _, runner, scope = await scoped(request)
    batch_id: str = request.path_params["batch_id"]
    row = await runner.store.batch(scope, batch_id)
    if row is None or row.kind != "openai":
        raise not_found("batch", batch_id)
    return json_answer(batch_object(row))


async def list_batches(request: Request) -> Response:
    _, runner, scope = await scoped(request)
    limit = page_limit(request)
    rows = await runner.store.batches(scope, "openai", request.query_params.get("after"), limit + 1)
    return json_answer(fetched_page([batch_object(row) for row in rows], limit))


async def cancel_batch(request: Request) -> Response:
    """Cancel a batch: `cancelling` until no line of it runs, then `cancelled` (a finished
    batch is returned unchanged)."""
    _, runner, scope = await scoped(request)
    batch_id: str = request.path_params["batch_id"]
    row = await runner.store.batch(scope, batch_id)
    if row is None or row.kind != "openai":
        raise not_found("batch", batch_id)
    await runner.store.move(batch_id, "cancelling", sources=("validating", "in_progress"))
    runner.wake()
    row = await runner.store.batch(scope, batch_id)
    assert row is not None
    return json_answer(batch_object(row))
