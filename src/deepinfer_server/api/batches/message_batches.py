"""Anthropic's Message Batches objects: the `message_batch` object and its results, as
Anthropic shapes them (a create request is read into lines by `message_requests.py`)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal, TypedDict

from deepinfer_server.store.batches import PENDING, BatchRow, LineResult

#: The endpoint every request of a message batch calls.
ENDPOINT = "/v1/messages"
#: Anthropic's window: a batch expires 24 hours after it was created.
WINDOW = 24 * 3600.0


def rfc3339(seconds: float | None) -> str | None:
    """A time as Anthropic writes it, or None."""
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class MessageRequestCounts(TypedDict):
    """A message batch's requests by what became of them."""

    processing: int
    succeeded: int
    errored: int
    canceled: int
    expired: int


class MessageBatchObject(TypedDict):
    """Anthropic's `message_batch` object (times as RFC 3339)."""

    id: str
    type: Literal["message_batch"]
    processing_status: str
    request_counts: MessageRequestCounts
    ended_at: str | None
    created_at: str | None
    expires_at: str | None
    archived_at: None
    cancel_initiated_at: str | None
    results_url: str | None


class ResultLine(TypedDict):
    """One line of a message batch's results: its `custom_id` and what became of it."""

    custom_id: str
    result: dict[str, Any]


def _processing_status(status: str) -> str:
    if status in ("validating", "in_progress", "finalizing"):
        return "in_progress"
    return "canceling" if status == "cancelling" else "ended"


def _unanswered(status: str) -> str:
    """What a line never answered counts as in a batch of `status`."""
    return "expired" if status == "expired" else "canceled"


def batch_object(row: BatchRow, base_url: str) -> MessageBatchObject:
    """The `message_batch` object."""
    counts = row.counts
    processing = _processing_status(row.status)
    pending = counts.get(PENDING, 0)
    ended = processing == "ended"
    request_counts: MessageRequestCounts = {
        "processing": 0 if ended else pending,
        "succeeded": counts.get("succeeded", 0),
        "errored": counts.get("errored", 0),
        "canceled": 0,
        "expired": 0,
    }
    if ended and row.status == "expired":
        request_counts["expired"] += pending
    elif ended:
        request_counts["canceled"] += pending
    ended_at = next(
        (
            row.times[status]
            for status in ("completed", "cancelled", "expired")
            if status in row.times
        ),
        None,
    )
    return {
        "id": row.id,
        "type": "message_batch",
        "processing_status": processing,
        "request_counts": request_counts,
        "ended_at": rfc3339(ended_at),
        "created_at": rfc3339(row.created_at),
        "expires_at": rfc3339(row.expires_at),
        "archived_at": None,
        "cancel_initiated_at": rfc3339(row.times.get("cancelling")),
        "results_url": f"{base_url}/v1/messages/batches/{row.id}/results" if ended else None,
    }


def result_line(row: BatchRow, line: LineResult) -> ResultLine:
    """One line of a batch's results."""
    result: dict[str, Any]
    response = (line.result or {}).get("response") or {}
    if line.status == "succeeded":
        result = {"type": "succeeded", "message": response.get("body")}
    elif line.status == "errored":
        result = {"type": "errored", "error": response.get("body")}
    else:
        result = {"type": _unanswered(row.status)}
    return {"custom_id": line.custom_id, "result": result}
