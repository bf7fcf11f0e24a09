"""ApiKeyMiddleware: API keys on every /v1 route (pure ASGI; keys are never logged).

Accepts `Authorization: Bearer KEY` (OpenAI clients) and `x-api-key: KEY` (Anthropic
clients). Every configured key is compared in constant time. /health, /metrics and /version
stay open for probes and scrapers.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from deepinfer_server.api.error_responses import envelope, speaks_anthropic
from deepinfer_server.errors import AuthenticationError

PROTECTED_PREFIX = "/v1/"
#: The scope of requests without an API key (no key is configured).
NO_KEY_SCOPE = "none"
#: Keys this process's per-key scopes (`key_scope`), so that a scope reveals nothing of its key.
_SCOPE_SALT = secrets.token_bytes(32)


def key_scope(api_key: bytes | None) -> str:
    """The name this process gives an API key's requests where it keeps per-key state (the
    fair grammar-compile queue): a keyed hash, never the key, and "none" without a key."""
    if api_key is None:
        return NO_KEY_SCOPE
    return hmac.new(_SCOPE_SALT, api_key, hashlib.sha256).hexdigest()


def _presented_key(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = bytes(value).partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
        elif name == b"x-api-key" and value:
            return bytes(value).strip()
    return None


class ApiKeyMiddleware:
    """Rejects /v1 requests without one of `keys` with a 401 in the path's error envelope."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        self.app = app
        self._keys = [key.encode() for key in keys]

    def _accepts(self, presented: bytes | None) -> bool:
        if presented is None:
            return False
        # compare_digest on every key, so the time taken does not reveal which one matched.
        matches = [hmac.compare_digest(presented, key) for key in self._keys]
        return any(matches)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIX):
            await self.app(scope, receive, send)
            return
        presented = _presented_key(scope)
        if self._accepts(presented):
            # The Responses store's scope is the key (`api.stored_responses.request_scope`).
            scope.setdefault("state", {})["api_key"] = presented
            await self.app(scope, receive, send)
            return
        # Each protocol's clients send the key their own way: say it their way.
        anthropic = speaks_anthropic(scope)
        how = "'x-api-key: <key>'" if anthropic else "'Authorization: Bearer <key>'"
        error = AuthenticationError(f"Invalid or missing API key: send {how}")
        await send(
            {
                "type": "http.response.start",
                "status": error.status_code,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        body = envelope(anthropic)(error)
        await send({"type": "http.response.body", "body": orjson.dumps(body)})
