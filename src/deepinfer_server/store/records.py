"""What the Responses store holds and hands back: responses, their items, pages of items, and
the errors of its reads and writes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: A JSON object the store keeps as the client sent or received it, and never reads inside
#: (a response object, an item, a batch's request body or result, its metadata).
JsonObject = dict[str, Any]
#: A Responses item (input or output) as JSON: `{"type": ..., "id": ..., ...}`.
Item = JsonObject


@dataclass(frozen=True)
class NewResponse:
    """A finished response to store, with the request's own input items (each with an `id`)."""

    id: str
    #: Who may read it back (`api.store_scope`): a keyed hash of the API key, or "none".
    scope: str
    created_at: float
    #: The response object as the client received it (its `output` included).
    body: JsonObject
    input_items: list[Item]
    previous_response_id: str | None = None


@dataclass(frozen=True)
class StoredResponse:
    """A stored response read back."""

    id: str
    created_at: float
    body: JsonObject
    previous_response_id: str | None = None
    #: A background response still running: when its process last said so (else None).
    heartbeat_at: float | None = None

    @property
    def output_items(self) -> list[Item]:
        """The items of its `output`."""
        output = self.body.get("output")
        return output if isinstance(output, list) else []


@dataclass(frozen=True)
class ItemPage:
    """One page of a response's input items, in the order asked."""

    items: list[Item] = field(default_factory=list)
    has_more: bool = False


class BrokenHistory(Exception):
    """A response of the chain is stored but one it continues expired or was deleted."""

    def __init__(self, missing: str) -> None:
        super().__init__(missing)
        self.missing = missing


class ResponseTooLarge(Exception):
    """A response (its object and items as JSON) larger than the store keeps for one."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"{size} bytes, over the limit of {limit}")
        self.size = size
        self.limit = limit
