"""The prefix-cache partition of a request: its API key's scope and its `cache_salt`.

Requests in different partitions never share cached prompt prefixes, on either engine and in
the prefix-aware routing (`AddRequest.cache_salt`). With `--prefix-cache-scope key` (the
default) a request's API key is part of it, so that one tenant can neither reuse nor time what
another sent; the key itself never leaves the API process: its scope is its position among the
configured keys, the same in every API server process. `global` leaves the key out. A client's
`cache_salt` (vLLM's field) splits either further. The partition is a digest of both; a request
with neither has none and shares with every other such request.
"""

from __future__ import annotations

import hashlib

import orjson
from starlette.requests import Request

from deepinfer_server.config import ResolvedConfig

_PERSON = b"prefix-partition"


def cache_partition(
    request: Request, config: ResolvedConfig, cache_salt: str | None
) -> bytes | None:
    """The partition of an authenticated request with this `cache_salt`, or None for none."""
    tenant = _key_scope(request, config) if config.prefix_cache_scope == "key" else None
    if tenant is None and cache_salt is None:
        return None
    return hashlib.blake2b(
        orjson.dumps([tenant, cache_salt]), digest_size=16, person=_PERSON
    ).digest()


def _key_scope(request: Request, config: ResolvedConfig) -> int | None:
    """The position of the request's API key among the configured ones (None without keys).
    The key was already accepted, in constant time, by `api.auth.ApiKeyMiddleware`."""
    presented: bytes | None = getattr(request.state, "api_key", None)
    if presented is None:
        return None
    return config.api_keys.index(presented.decode())
