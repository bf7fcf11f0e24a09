"""OpenAI's Files and Batches objects: a batch input file read into lines, the `file` and
`batch` objects as OpenAI shapes them."""

from __future__ import annotations

from typing import Any, Literal, TypedDict

import orjson

from deepinfer_server.store.batches import BatchRow, FileRow, NewLine

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


def _malformed(number: int, custom_id: str | None, message: str) -> NewLine:
    return NewLine(
        custom_id if custom_id is not None else f"line-{number}",
        None,
        "errored",
        {"error": {"code": "invalid_request", "message": f"line {number}: {message}"}},
    )


def read_lines(content: str, endpoint: str) -> list[NewLine]:
    """A batch input file's requests, one per non-empty line; a malformed line (not a JSON
    object, no string `custom_id`, one already used, `method` not POST, `url` not the batch's
    endpoint, `body` not an object) is kept with its error, for the error file."""
    lines: list[NewLine] = []
    seen: set[str] = set()
    for number, text in enumerate(content.splitlines(), start=1):
        if not text.strip():
            continue
        try:
            record = orjson.loads(text)
        except orjson.JSONDecodeError:
            lines.append(_malformed(number, None, "not valid JSON"))
            continue
        if not isinstance(record, dict):
            lines.append(_malformed(number, None, "not a JSON object"))
            continue
        custom_id = record.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            lines.append(_malformed(number, None, "`custom_id` must be a non-empty string"))
            continue
        if custom_id in seen:
            lines.append(
                _malformed(number, custom_id, "this `custom_id` is used by an earlier line")
            )
            continue
        seen.add(custom_id)
        if record.get("method") != "POST":
            lines.append(_malformed(number, custom_id, "`method` must be 'POST'"))
        elif record.get("url") != endpoint:
            lines.append(
                _malformed(number, custom_id, f"`url` must be the batch's endpoint {endpoint!r}")
            )
        elif not isinstance(record.get("body"), dict):
            lines.append(_malformed(number, custom_id, "`body` must be a JSON object"))
        else:
            lines.append(NewLine(custom_id, record["body"]))
    return lines
