"""The query parameters of the list endpoints (stored responses' input items, conversations'
items, batches, message batches): OpenAI's `limit`, `order` and `include`."""

from __future__ import annotations

from typing import Literal

from starlette.requests import Request

from deepinfer_server.errors import BadRequestError

#: The most items one page lists (OpenAI's bound), and a page's default.
MAX_PAGE = 100
DEFAULT_PAGE = 20


def page_limit(request: Request) -> int:
    """`limit`: how many items a page holds (default 20; a 400 outside 1 to 100)."""
    raw = request.query_params.get("limit")
    if raw is None:
        return DEFAULT_PAGE
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_PAGE:
        raise BadRequestError(f"'limit' must be an integer from 1 to {MAX_PAGE}", param="limit")
    return limit


def page_order(request: Request) -> Literal["asc", "desc"]:
    """`order`: oldest first (`asc`) or newest first (`desc`, the default)."""
    order = request.query_params.get("order", "desc")
    if order == "asc":
        return "asc"
    if order == "desc":
        return "desc"
    raise BadRequestError("'order' must be 'asc' or 'desc'", param="order")


def include_values(request: Request) -> list[str]:
    """`include`, repeated (`include=a&include=b`) or in the bracket form (`include[]=a`)."""
    params = request.query_params
    return [*params.getlist("include"), *params.getlist("include[]")]
