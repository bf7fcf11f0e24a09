"""The route table's batches: OpenAI's Files and Batches and Anthropic's Message Batches."""

from __future__ import annotations

from deepinfer_server.api.dialects import Dialect
from deepinfer_server.api.route import Endpoint, Handler, with_parameters
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
    envelope = op.ANTHROPIC_ENVELOPE if dialect is Dialect.ANTHROPIC else op.OPENAI_ENVELOPE
    content = {media_type: {"schema": {"type": "string"}}}
    operation = op.get(summary, content, envelope=envelope)
    return Endpoint(
        path, "GET", handler, dialect, with_parameters(operation, parameter), protected=True
    )


#: In the order the document lists them.
BATCHES: tuple[Endpoint, ...] = (
    Endpoint(
        "/v1/files",
        "POST",
        create_file,
        Dialect.OPENAI,
        op.upload("Upload a batch input file (JSONL, purpose 'batch')", "FileUpload"),
        protected=True,
    ),
    Endpoint(
        "/v1/files",
        "GET",
        list_files,
        Dialect.OPENAI,
        with_parameters(op.get("The API key's files, newest first"), op.PURPOSE, *op.PAGE),
        protected=True,
    ),
    Endpoint(
        "/v1/files/{file_id}",
        "GET",
        retrieve_file,
        Dialect.OPENAI,
        with_parameters(op.get("A file"), op.FILE_ID),
        protected=True,
    ),
    _jsonl_download(
        "/v1/files/{file_id}/content",
        file_content,
        "A file's content (a batch's output and error files: JSONL)",
        "application/jsonl",
        op.FILE_ID,
    ),
    Endpoint(
        "/v1/files/{file_id}",
        "DELETE",
        delete_file,
        Dialect.OPENAI,
        with_parameters(op.get("Delete a file"), op.FILE_ID),
        protected=True,
    ),
    Endpoint(
        "/v1/batches",
        "POST",
        create_batch,
        Dialect.OPENAI,
        op.post_object(
            "Create a batch from an input file, run at the lowest priority (input_file_id, "
            "endpoint, completion_window '24h', metadata)",
            "BatchRequest",
        ),
        protected=True,
    ),
    Endpoint(
        "/v1/batches",
        "GET",
        list_batches,
        Dialect.OPENAI,
        with_parameters(op.get("The API key's batches, newest first"), *op.PAGE),
        protected=True,
    ),
    Endpoint(
        "/v1/batches/{batch_id}",
        "GET",
        retrieve_batch,
        Dialect.OPENAI,
        with_parameters(op.get("A batch, with its request_counts"), op.BATCH_ID),
        protected=True,
    ),
    Endpoint(
        "/v1/batches/{batch_id}/cancel",
        "POST",
        cancel_batch,
        Dialect.OPENAI,
        with_parameters(op.cancel("Cancel a batch (cancelling, then cancelled)"), op.BATCH_ID),
        protected=True,
    ),
    Endpoint(
        "/v1/messages/batches",
        "POST",
        create_message_batch,
        Dialect.ANTHROPIC,
        op.post_object(
            "Create a message batch of requests: [{custom_id, params}], run at the lowest priority",
            "MessageBatchRequest",
            op.ANTHROPIC_ENVELOPE,
        ),
        protected=True,
    ),
    Endpoint(
        "/v1/messages/batches",
        "GET",
        list_message_batches,
        Dialect.ANTHROPIC,
        with_parameters(
            op.get("The API key's message batches, newest first", envelope=op.ANTHROPIC_ENVELOPE),
            op.AFTER_ID,
            op.PAGE[1],
        ),
        protected=True,
    ),
    Endpoint(
        "/v1/messages/batches/{batch_id}",
        "GET",
        retrieve_message_batch,
        Dialect.ANTHROPIC,
        with_parameters(
            op.get("A message batch, with its request_counts", envelope=op.ANTHROPIC_ENVELOPE),
            op.BATCH_ID,
        ),
        protected=True,
    ),
    Endpoint(
        "/v1/messages/batches/{batch_id}",
        "DELETE",
        delete_message_batch,
        Dialect.ANTHROPIC,
        with_parameters(
            op.get("Delete an ended message batch", envelope=op.ANTHROPIC_ENVELOPE),
            op.BATCH_ID,
        ),
        protected=True,
    ),
    Endpoint(
        "/v1/messages/batches/{batch_id}/cancel",
        "POST",
        cancel_message_batch,
        Dialect.ANTHROPIC,
        with_parameters(
            op.cancel("Cancel a message batch (canceling, then ended)", op.ANTHROPIC_ENVELOPE),
            op.BATCH_ID,
        ),
        protected=True,
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
