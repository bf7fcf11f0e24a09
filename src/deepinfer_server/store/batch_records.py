"""What the batch jobs' store holds and hands back: files, batches, their lines."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from deepinfer_server.store.records import JsonObject

#: The statuses whose time the `batches` table keeps (`<status>_at`).
TIMED = frozenset(
    {"in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled"}
)
#: A line not answered yet.
PENDING = "pending"

#: The columns of a batch read back (`batch_row`).
BATCH_COLUMNS = (
    "id, scope, kind, created_at, expires_at, endpoint, input_file_id, metadata, status, "
    + ", ".join(f"{status}_at" for status in sorted(TIMED))
    + ", output_file_id, error_file_id"
)


@dataclass(frozen=True)
class FileRow:
    """A stored file, without its content."""

    id: str
    created_at: float
    purpose: str
    filename: str
    bytes: int


@dataclass(frozen=True)
class NewLine:
    """One request of a new batch: its body, or (a malformed line) its result already."""

    custom_id: str
    body: JsonObject | None
    status: str = PENDING
    result: JsonObject | None = None


@dataclass(frozen=True)
class BatchRow:
    """A stored batch, with its lines counted by status."""

    id: str
    scope: str
    kind: str
    created_at: float
    expires_at: float
    endpoint: str
    input_file_id: str | None
    metadata: JsonObject | None
    status: str
    #: The time it reached each status it went through (`<status>` → seconds).
    times: dict[str, float]
    output_file_id: str | None
    error_file_id: str | None
    #: Its lines by status (`pending`, `succeeded`, `errored`, `canceled`, `expired`).
    counts: dict[str, int]


@dataclass(frozen=True)
class ClaimedLine:
    """A line a process holds: answer it, then `record` with its claim."""

    batch_id: str
    line: int
    custom_id: str
    body: JsonObject
    claim: str


@dataclass(frozen=True)
class LineResult:
    """A line as it ended (or `pending`, not answered)."""

    line: int
    custom_id: str
    status: str
    result: JsonObject | None


def batch_row(row: Sequence[Any], counts: dict[str, int]) -> BatchRow:
    """A batch read back (its `BATCH_COLUMNS`), with its lines counted by status."""
    timed = sorted(TIMED)
    times = {
        status: float(value)
        for status, value in zip(timed, row[9 : 9 + len(timed)], strict=True)
        if value is not None
    }
    return BatchRow(
        id=str(row[0]),
        scope=str(row[1]),
        kind=str(row[2]),
        created_at=float(row[3]),
        expires_at=float(row[4]),
        endpoint=str(row[5]),
        input_file_id=row[6],
        metadata=None if row[7] is None else orjson.loads(row[7]),
        status=str(row[8]),
        times=times,
        output_file_id=row[9 + len(timed)],
        error_file_id=row[10 + len(timed)],
        counts=counts,
    )
