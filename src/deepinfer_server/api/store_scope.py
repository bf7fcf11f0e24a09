"""The store's scope of a request: its API key as a keyed hash under the store's salt
(`services/store_scope.py`), or "none" on a server without `--api-key`."""

from __future__ import annotations

from starlette.requests import Request

from deepinfer_server.services.store_scope import NO_AUTH_SCOPE, key_scope
from deepinfer_server.store import ResponseStore


async def request_scope(request: Request, store: ResponseStore) -> str:
    """Who may read what this request stores: its API key as a keyed hash, or "none"."""
    key: bytes | None = getattr(request.state, "api_key", None)
    if key is None:
        return NO_AUTH_SCOPE
    return key_scope(await store.scope_salt(), key)
