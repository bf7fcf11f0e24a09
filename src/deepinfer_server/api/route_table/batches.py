"""The route table's batches: OpenAI's Files and Batches and Anthropic's Message Batches.

`/v1/files` is OpenAI's Files API, but Anthropic's clients send their Files API's requests to
the same path (with an `anthropic-version` header): its routes are `Dialect.EITHER`, so that
those clients read the refusal (`routes.batches`) in Anthropic's envelope."""

from __future__ import annotations

from deepinfer_server.api.dialects import Dialect
from deepinfer_server.api.route import Endpoint, Handler, with_parameters
from deepinfer_server.api.route_table.entries import envelope_of, on_object, post_body
from deepinfer_server.api.routes.batches import (
    cancel_batch,
    create_batch,
    create_file,
    delete_file,
    file_content,
    list_batches,
    list_files,
    retrieve_batch,
    retrieve_file,
)
from deepinfer_server.api.routes.message_batches import (
    cancel_message_batch,
    create_message_batch,
    delete_message_batch,
    list_message_batches,
    message_batch_results,
    retrieve_message_batch,
)
from deepinfer_server.openapi import operations as op
from deepinfer_server.openapi.schema import Schema


def _jsonl_download(
    path: str,
    handler: Handler,
    summary: str,
    media_type: str,
    parameter: Schema,
    dialect: Dialect = Dialect.OPENAI,
) -> Endpoint:
    """A protected GET of a JSONL document (a file's content, a batch's results)."""
    content = {media_type: {"schema": {"type": "string"}}}
    operation = op.get(summary, content, envelope=envelope_of(dialect))
    return Endpoint(
        path, "GET", handler, dialect, with_parameters(operation, parameter), protected=True
    )


#: In the order the document lists them.
BATCHES: tuple[Endpoint, ...] = (
    Endpoint(
        "/v1/files",
        "POST",
        create_file,
        Dialect.EITHER,
        op.upload("Upload a batch input file (JSONL, purpose 'batch')", "FileUpload"),
        protected=True,
    ),
    on_object(
        "GET",
        "/v1/files",
        list_files,
        "The API key's files, newest first",
        op.PURPOSE,
        *op.PAGE,
        dialect=Dialect.EITHER,
    ),
    on_object(
        "GET", "/v1/files/{file_id}", retrieve_file, "A file", op.FILE_ID, dialect=Dialect.EITHER
    ),
    _jsonl_download(
        "/v1/files/{file_id}/content",
        file_content,
        "A file's content (a batch's output and error files: JSONL)",
        "application/jsonl",
        op.FILE_ID,
        Dialect.EITHER,
    ),
    on_object(
        "DELETE",
        "/v1/files/{file_id}",
        delete_file,
        "Delete a file",
        op.FILE_ID,
        dialect=Dialect.EITHER,
    ),
    post_body(
        "/v1/batches",
        create_batch,
        "Create a batch from an input file, run at the lowest priority (input_file_id, "
        "endpoint, completion_window '24h', metadata)",
        "BatchRequest",
    ),
    on_object("GET", "/v1/batches", list_batches, "The API key's batches, newest first", *op.PAGE),
    on_object(
        "GET",
        "/v1/batches/{batch_id}",
        retrieve_batch,
        "A batch, with its request_counts",
        op.BATCH_ID,
    ),
    on_object(
        "POST",
        "/v1/batches/{batch_id}/cancel",
        cancel_batch,
        "Cancel a batch (cancelling, then cancelled)",
        op.BATCH_ID,
    ),
    post_body(
        "/v1/messages/batches",
        create_message_batch,
        "Create a message batch of requests: [{custom_id, params}], run at the lowest priority",
        "MessageBatchRequest",
        dialect=Dialect.ANTHROPIC,
    ),
    on_object(
        "GET",
        "/v1/messages/batches",
        list_message_batches,
        "The API key's message batches, newest first",
        op.AFTER_ID,
        op.PAGE[1],
        dialect=Dialect.ANTHROPIC,
    ),
    on_object(
        "GET",
        "/v1/messages/batches/{batch_id}",
        retrieve_message_batch,
        "A message batch, with its request_counts",
        op.BATCH_ID,
        dialect=Dialect.ANTHROPIC,
    ),
    on_object(
        "DELETE",
        "/v1/messages/batches/{batch_id}",
        delete_message_batch,
        "Delete an ended message batch",
        op.BATCH_ID,
        dialect=Dialect.ANTHROPIC,
    ),
    on_object(
        "POST",
        "/v1/messages/batches/{batch_id}/cancel",
        cancel_message_batch,
        "Cancel a message batch (canceling, then ended)",
        op.BATCH_ID,
        dialect=Dialect.ANTHROPIC,
    ),
    _jsonl_download(
        "/v1/messages/batches/{batch_id}/results",
        message_batch_results,
        "An ended message batch's results (JSONL)",
        "application/x-jsonl",
        op.BATCH_ID,
        Dialect.ANTHROPIC,
    ),
)
