"""build_app: the Starlette application for one AppState, with its middleware stack."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Route
from starlette.types import ASGIApp

from deepinfer_server.api.auth import ApiKeyMiddleware
from deepinfer_server.api.keepalive import KeepAlive
from deepinfer_server.api.path_errors import (
    handle_api_error,
    handle_http_exception,
    speaks_anthropic,
)
from deepinfer_server.api.request_context import RequestContextMiddleware
from deepinfer_server.api.route import Endpoint
from deepinfer_server.api.route_table import ROUTES
from deepinfer_server.api.sse import keep_server_send
from deepinfer_server.api.state import AppState
from deepinfer_server.errors import ApiError


class _App(Starlette):
    """Starlette whose outermost layer keeps the server's `send` (and its keep-alive policy)
    for streamed bodies."""

    def build_middleware_stack(self) -> ASGIApp:
        state: AppState = self.state.server
        keepalive = KeepAlive(state.config.sse_keepalive_seconds, speaks_anthropic)
        return keep_server_send(super().build_middleware_stack(), keepalive)


def _middleware(state: AppState, endpoints: tuple[Endpoint, ...]) -> list[Middleware]:
    """Outermost first: request ID, error boundary, failure metrics and access log; CORS (when
    origins are configured; it answers preflight requests itself); API keys (when configured)."""
    config = state.config
    middleware = [
        Middleware(
            RequestContextMiddleware,
            access_log=config.access_log,
            on_failure=state.metrics.observe_failure,
        ),
    ]
    if config.allowed_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(config.allowed_origins),
                allow_methods=list(config.allowed_methods or ("*",)),
                allow_headers=list(config.allowed_headers or ("*",)),
                expose_headers=["X-Request-Id"],
            )
        )
    if config.api_keys:
        names = tuple(tenant.name for tenant in config.tenants)
        # The routes the table declares behind the keys; /v1's are by their prefix too.
        protected = frozenset(e.path for e in endpoints if e.protected)
        middleware.append(
            Middleware(
                ApiKeyMiddleware,
                keys=config.api_keys,
                names=names,
                protected=protected,
                speaks_anthropic=speaks_anthropic,
            )
        )
    return middleware


def build_app(state: AppState, endpoints: tuple[Endpoint, ...] = ROUTES) -> Starlette:
    """The ASGI app serving `endpoints` (the route table); every error leaves it in its
    protocol's envelope, with X-Request-Id (`_middleware`)."""
    routes = [Route(e.path, e.handler, methods=[e.method]) for e in endpoints]
    app = _App(
        routes=routes,
        middleware=_middleware(state, endpoints),
        exception_handlers={ApiError: handle_api_error, HTTPException: handle_http_exception},
    )
    # A trailing slash is a 404 in the protocol's envelope, not a 307 to the same POST.
    app.router.redirect_slashes = False
    app.state.server = state
    if state.batches is not None:
        state.batches.bind(app)
    app.state.endpoints = endpoints
    return app
