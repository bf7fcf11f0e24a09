"""ApiKeyMiddleware: API keys on every /v1 route and on the other routes the route table
declares protected (`Endpoint.protected`: vLLM's tokenizer endpoints) (pure ASGI; keys are
never logged).

Accepts `Authorization: Bearer KEY` (OpenAI clients) and `x-api-key: KEY` (Anthropic
clients). Every configured key is compared in constant time. /, /health, /metrics and /version
stay open for probes and scrapers. An accepted request's scope says which tenant it belongs to
(`tenant_of`): the key's name and its index in `config.tenants`, never the key.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

import orjson
from starlette.routing import compile_path
from starlette.types import ASGIApp, Receive, Scope, Send

from deepinfer_server.api.error_responses import envelope
from deepinfer_server.errors import AuthenticationError

PROTECTED_PREFIX = "/v1/"


def tenant_of(state: object) -> int:
    """The index in `config.tenants` of a request's tenant (its request.state): its key's, or
    0, the only tenant of a server without keys."""
    tenant: int = getattr(state, "tenant", 0)
    return tenant


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
    """Rejects requests to /v1 or to a `protected` path without one of `keys` with a 401 in the
    path's error envelope."""

    def __init__(
        self,
        app: ASGIApp,
        keys: tuple[str, ...],
        names: tuple[str, ...],
        protected: frozenset[str] = frozenset(),
        speaks_anthropic: Callable[[Scope], bool] = lambda scope: False,
    ) -> None:
        """`keys` and their tenants' `names` in the order of `config.tenants`; `protected`:
        the route paths outside /v1 that need a key too (the route table's protected routes, with
        their parameters: `/x/{n:int}` protects `/x/7`);
        `speaks_anthropic`: whether a request's client speaks Anthropic's API (the route
        table's dialect of its path), for the 401's envelope and wording."""
        self.app = app
        self._speaks_anthropic = speaks_anthropic
        self._keys = [key.encode() for key in keys]
        self._names = names
        self._protected = frozenset(path for path in protected if "{" not in path)
        self._protected_patterns = tuple(compile_path(path)[0] for path in protected if "{" in path)

    def _matching(self, presented: bytes | None) -> int | None:
        """The index of the key presented, or None."""
        if presented is None:
            return None
        # compare_digest on every key, so the time taken does not reveal which one matched.
        matches = [hmac.compare_digest(presented, key) for key in self._keys]
        return matches.index(True) if any(matches) else None

    def _is_protected(self, path: str) -> bool:
        """Whether a path outside /v1 is one of the protected routes'."""
        if path in self._protected:
            return True
        return any(pattern.match(path) for pattern in self._protected_patterns)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if not path.startswith(PROTECTED_PREFIX) and not self._is_protected(path):
            await self.app(scope, receive, send)
            return
        presented = _presented_key(scope)
        index = self._matching(presented)
        if index is not None:
            state = scope.setdefault("state", {})
            # The Responses store's scope is the key (`api.store_scope.request_scope`).
            state["api_key"] = presented
            state["tenant"] = index
            state["tenant_name"] = self._names[index]  # for the access log
            await self.app(scope, receive, send)
            return
        # Each protocol's clients send the key their own way: say it their way.
        anthropic = self._speaks_anthropic(scope)
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
