"""ResponseRows: how a response is written to the store (`response_tables.py`), and its
images read back; the root of `ResponseStore` (`responses.py`).

A response's size counts its object and items as JSON, and each inline image (`blobs.py`)
once in its scope: in the response that stored it first. `save()` refuses a response larger
than the cap of one response (`ResponseTooLarge`) before it writes anything.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import orjson

from deepinfer_server.store.blobs import extract, inflate, references
from deepinfer_server.store.database import Step
from deepinfer_server.store.records import Item, JsonObject, NewResponse, ResponseTooLarge
from deepinfer_server.store.root import StoreRoot


@dataclass(frozen=True)
class _Encoded:
    """A response as the rows that store it: its object, then its items (inputs first), as
    JSON, with its inline images taken out (`images`: data URL by content hash)."""

    body: str
    inputs: list[str]
    rows: list[tuple[str, int, str, str, str]]
    images: dict[str, str] = field(default_factory=dict)

    @property
    def size(self) -> int:
        """The bytes of its object and items, without the images."""
        return len(self.body) + sum(len(row[4]) for row in self.rows)


class ResponseRows(StoreRoot):
    """The store root with the responses' writes (within its `response_max_bytes`)."""

    def check_size(self, size: int) -> None:
        """Raise ResponseTooLarge when a response of `size` bytes would not be stored."""
        if size > self.response_max_bytes:
            raise ResponseTooLarge(size, self.response_max_bytes)

    async def save(self, response: NewResponse) -> None:
        """Store a finished response and its items (one transaction); ResponseTooLarge, with
        nothing written, past the cap of one response."""
        steps = await self.insert_steps(response)
        async with self._failures("store a response", write=True):
            await self._db.write(steps)

    async def insert_steps(self, response: NewResponse) -> list[Step]:
        """The statements that store `response` (ResponseTooLarge past the cap of one)."""
        encoded = _encode(response)
        self.check_size(encoded.size + sum(len(data) for data in encoded.images.values()))
        async with self._failures("read stored images"):
            await self._prepare()
            stored = await self._stored_blobs(response.scope, encoded.images)
        # A blob counts once in its scope: in the response that stored it first.
        size = encoded.size + sum(
            len(data) for digest, data in encoded.images.items() if digest not in stored
        )
        return _insert_rows(response, encoded, size)

    async def _stored_blobs(self, scope: str, wanted: Collection[str]) -> dict[str, str]:
        """The blobs of this scope with these hashes that are stored (by hash)."""
        if not wanted:
            return {}
        ordered = sorted(wanted)
        rows = await self._db.fetch(
            "SELECT hash, data FROM blobs WHERE scope = ? AND hash IN ("
            + ", ".join("?" * len(ordered))
            + ")",
            (scope, *ordered),
        )
        return {str(digest): str(data) for digest, data in rows}

    async def _inflated(self, scope: str, items: list[Item]) -> list[Item]:
        """The items with their images' data URLs back in place of references."""
        wanted: set[str] = set()
        for item in items:
            references(item, wanted)
        if not wanted:
            return items
        found = await self._stored_blobs(scope, wanted)
        return [inflate(item, found) for item in items]


def output_items(body: JsonObject) -> list[Item]:
    """The output items of a response object."""
    output = body.get("output")
    return [item for item in output if isinstance(item, dict)] if isinstance(output, list) else []


def _encode(response: NewResponse) -> _Encoded:
    images: dict[str, str] = {}
    inputs = [orjson.dumps(extract(item, images)).decode() for item in response.input_items]
    outputs = output_items(response.body)
    texts = [*inputs, *(orjson.dumps(item).decode() for item in outputs)]
    rows = [
        (response.id, position, str(item.get("id", "")), response.scope, text)
        for position, (item, text) in enumerate(
            zip([*response.input_items, *outputs], texts, strict=True)
        )
    ]
    return _Encoded(orjson.dumps(response.body).decode(), inputs, rows, images)


def _insert_rows(response: NewResponse, encoded: _Encoded, size: int) -> list[Step]:
    steps = [
        Step(
            "INSERT INTO responses (id, scope, created_at, previous_response_id, "
            "input_count, bytes, body) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                response.id,
                response.scope,
                response.created_at,
                response.previous_response_id,
                len(encoded.inputs),
                size,
                encoded.body,
            ),
        )
    ]
    if encoded.rows:
        steps.append(
            Step(
                "INSERT INTO items (response_id, position, item_id, scope, body) "
                "VALUES (?, ?, ?, ?, ?)",
                encoded.rows,
                many=True,
            )
        )
    if encoded.images:
        steps += [
            Step(
                "INSERT INTO blobs (scope, hash, data) VALUES (?, ?, ?) "
                "ON CONFLICT (scope, hash) DO NOTHING",
                [(response.scope, digest, data) for digest, data in encoded.images.items()],
                many=True,
            ),
            Step(
                "INSERT INTO response_blobs (response_id, scope, hash) VALUES (?, ?, ?)",
                [(response.id, response.scope, digest) for digest in encoded.images],
                many=True,
            ),
        ]
    return steps
