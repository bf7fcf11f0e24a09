"""The store's scope of a request: its API key as a keyed hash under the store's salt (the key
is never stored), or `NO_AUTH_SCOPE` on a server without `--api-key`."""

from __future__ import annotations

import hashlib
import hmac

from starlette.requests import Request

from deepinfer_server.store import ResponseStore

#: The scope of every request on a server without API keys.
NO_AUTH_SCOPE = "none"


def key_scope(salt: bytes, key: bytes) -> str:
    """The store's scope of an API key."""
    return hmac.new(salt, key, hashlib.sha256).hexdigest()


async def request_scope(request: Request, store: ResponseStore) -> str:
    """Who may read what this request stores: its API key as a keyed hash, or "none"."""
    key: bytes | None = getattr(request.state, "api_key", None)
    if key is None:
        return NO_AUTH_SCOPE
    return key_scope(await store.scope_salt(), key)
