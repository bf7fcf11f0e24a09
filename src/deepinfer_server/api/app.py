"""build_app: the Starlette application for one AppState, with its middleware stack."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Route
from starlette.types import ASGIApp

from deepinfer_server.api.auth import ApiKeyMiddleware
from deepinfer_server.api.error_responses import handle_api_error, handle_http_exception
from deepinfer_server.api.request_context import RequestContextMiddleware
from deepinfer_server.api.routes.count_tokens import count_tokens
from deepinfer_server.api.routes.generation import (
    chat_completions,
    completions,
    messages,
    responses,
)
from deepinfer_server.api.routes.meta import health, metrics, server_version
from deepinfer_server.api.routes.models import list_models, retrieve_model
from deepinfer_server.api.routes.openapi import openapi_json
from deepinfer_server.api.routes.router_info import get_load, model_info, server_info
from deepinfer_server.api.routes.stored_responses import (
    delete_response,
    list_input_items,
    retrieve_response,
)
from deepinfer_server.api.sse import keep_server_send
from deepinfer_server.api.state import AppState
from deepinfer_server.errors import ApiError


class _App(Starlette):
    """Starlette whose outermost layer keeps the server's `send` for streamed bodies."""

    def build_middleware_stack(self) -> ASGIApp:
        return keep_server_send(super().build_middleware_stack())


def build_app(state: AppState) -> Starlette:
    """The ASGI app; every error leaves it in its protocol's envelope, with X-Request-Id.

    Middleware, outermost first: request ID, error boundary, failure metrics and access log;
    CORS (when origins are configured; it answers preflight requests itself); API keys (when
    configured).
    """
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
        middleware.append(Middleware(ApiKeyMiddleware, keys=config.api_keys, names=names))
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", list_input_items, methods=["GET"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/version", server_version, methods=["GET"]),
        Route("/get_load", get_load, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/openapi.json", openapi_json, methods=["GET"]),
    ]
    app = _App(
        routes=routes,
        middleware=middleware,
        exception_handlers={ApiError: handle_api_error, HTTPException: handle_http_exception},
    )
    # A trailing slash is a 404 in the protocol's envelope, not a 307 to the same POST.
    app.router.redirect_slashes = False
    app.state.server = state
    return app
