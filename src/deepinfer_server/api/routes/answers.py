"""The answers of the stored-object routes (stored responses, conversations, files, batches): a
JSON body, and OpenAI's list object of one page."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Generic, Literal, TypedDict, TypeVar

import orjson
from starlette.responses import Response

#: One listed object: a JSON object with its `id`.
Listed = TypeVar("Listed", bound=Mapping[str, object])


class ListPage(TypedDict, Generic[Listed]):
    """OpenAI's list object: one page of objects and whether more follow."""

    object: Literal["list"]
    data: Sequence[Listed]
    first_id: object
    last_id: object
    has_more: bool


def json_answer(body: object) -> Response:
    """`body` as a 200 JSON response (orjson: dicts, lists, TypedDicts and Structs alike)."""
    return Response(orjson.dumps(body), media_type="application/json")


def list_page(items: Sequence[Listed], has_more: bool) -> ListPage[Listed]:
    """The list object of `items`, a page of a longer list when `has_more`."""
    return {
        "object": "list",
        "data": items,
        "first_id": items[0].get("id") if items else None,
        "last_id": items[-1].get("id") if items else None,
        "has_more": has_more,
    }


def fetched_page(fetched: Sequence[Listed], limit: int) -> ListPage[Listed]:
    """The list object of a page of `limit` objects, from `fetched`: the store's read of one
    more than `limit`, to tell whether more follow."""
    return list_page(fetched[:limit], len(fetched) > limit)
