"""OpenAI's Files and Batches objects: the `file` and `batch` objects as OpenAI shapes them (a
batch input file is read into lines by `input_file.py`)."""

from __future__ import annotations

from typing import Any, Literal, TypedDict

from deepinfer_server.store.batches import BatchRow, FileRow

#: The endpoints a batch may call (OpenAI's list, as far as this server serves them).
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
#: The only completion window OpenAI offers, in seconds.
WINDOWS = {"24h": 24 * 3600.0}
#: OpenAI's bounds on `metadata`.
METADATA_PAIRS = 16
METADATA_KEY_CHARS = 64
METADATA_VALUE_CHARS = 512


class FileObject(TypedDict):
    """OpenAI's `file` object."""

    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"]
    expires_at: None
    status_details: None


class RequestCounts(TypedDict):
    """A batch's lines: all of them, those that succeeded and those that failed."""

    total: int
    completed: int
    failed: int


class BatchObject(TypedDict):
    """OpenAI's `batch` object (each `<status>_at`: when it reached that status, or None)."""

    id: str
    object: Literal["batch"]
    endpoint: str
    errors: None
    input_file_id: str | None
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, Any] | None


def file_object(row: FileRow) -> FileObject:
    """The `file` object."""
    return {
        "id": row.id,
        "object": "file",
        "bytes": row.bytes,
        "created_at": int(row.created_at),
        "filename": row.filename,
        "purpose": row.purpose,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


def batch_object(row: BatchRow, window: str = "24h") -> BatchObject:
    """The `batch` object, with `request_counts` from its lines."""
    counts = row.counts

    def reached(status: str) -> int | None:
        value = row.times.get(status)
        return None if value is None else int(value)

    return {
        "id": row.id,
        "object": "batch",
        "endpoint": row.endpoint,
        "errors": None,
        "input_file_id": row.input_file_id,
        "completion_window": window,
        "status": row.status,
        "output_file_id": row.output_file_id,
        "error_file_id": row.error_file_id,
        "created_at": int(row.created_at),
        "in_progress_at": reached("in_progress"),
        "expires_at": int(row.expires_at),
        "finalizing_at": reached("finalizing"),
        "completed_at": reached("completed"),
        "failed_at": reached("failed"),
        "expired_at": reached("expired"),
        "cancelling_at": reached("cancelling"),
        "cancelled_at": reached("cancelled"),
        "request_counts": {
            "total": sum(counts.values()),
            "completed": counts.get("succeeded", 0),
            "failed": counts.get("errored", 0),
        },
        "metadata": row.metadata,
    }
