"""Anthropic's Message Batches objects: a create request read into lines, the
`message_batch` object and its results, as Anthropic shapes them."""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Literal, TypedDict

from deepinfer_server.errors import BadRequestError
from deepinfer_server.protocol.core.validation import decode_json
from deepinfer_server.store.batches import PENDING, BatchRow, LineResult, NewLine

#: The endpoint every request of a message batch calls.
ENDPOINT = "/v1/messages"
#: Anthropic's window: a batch expires 24 hours after it was created.
WINDOW = 24 * 3600.0
#: Anthropic's form of a `custom_id`.
_CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def rfc3339(seconds: float | None) -> str | None:
    """A time as Anthropic writes it, or None."""
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def body_lines(raw: bytes, limit: int) -> list[NewLine]:
    """A create request's body `raw` as lines (`read_requests`), decoded and read where it is
    called: a worker thread, since the body may be as large as --batch-max-file-mb."""
    return read_requests(decode_json(raw), limit)


def read_requests(body: Mapping[str, Any], limit: int) -> list[NewLine]:
    """`requests: [{custom_id, params}]` as lines (400 for more than `limit` requests, or for a
    request without a well-formed, unique `custom_id` or without `params`: its results could
    not be told apart). The `params` are checked when the request runs; a bad one is an
    `errored` result."""
    requests = body.get("requests")
    if not isinstance(requests, list) or not requests:
        raise BadRequestError("'requests' must be a non-empty array", param="requests")
    extra = sorted(set(body) - {"requests"})
    if extra:
        raise BadRequestError(f"{extra[0]}: Extra inputs are not permitted", param=extra[0])
    if len(requests) > limit:
        raise BadRequestError(
            f"{len(requests)} requests; a batch has at most {limit} (--batch-max-lines)",
            param="requests",
        )
    lines: list[NewLine] = []
    seen: set[str] = set()
    for index, request in enumerate(requests):
        where = f"requests.{index}"
        if not isinstance(request, dict):
            raise BadRequestError(f"{where}: must be an object", param=where)
        custom_id = request.get("custom_id")
        if not isinstance(custom_id, str) or not _CUSTOM_ID.fullmatch(custom_id):
            raise BadRequestError(
                f"{where}.custom_id: 1 to 64 letters, digits, '-' or '_'",
                param=f"{where}.custom_id",
            )
        if custom_id in seen:
            raise BadRequestError(
                f"{where}.custom_id: {custom_id!r} is used by an earlier request",
                param=f"{where}.custom_id",
            )
        seen.add(custom_id)
        params = request.get("params")
        if not isinstance(params, dict):
            raise BadRequestError(f"{where}.params: must be an object", param=f"{where}.params")
        lines.append(NewLine(custom_id, params))
    return lines


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
