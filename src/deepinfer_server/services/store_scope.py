"""The store's scope of an API key: its keyed hash under the store's salt (the key is never
stored), or `NO_AUTH_SCOPE` on a server without `--api-key`."""

from __future__ import annotations

import hashlib
import hmac

#: The scope of every request on a server without API keys.
NO_AUTH_SCOPE = "none"


def key_scope(salt: bytes, key: bytes) -> str:
    """The store's scope of an API key."""
    return hmac.new(salt, key, hashlib.sha256).hexdigest()
