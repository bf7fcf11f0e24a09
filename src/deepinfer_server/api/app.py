"""build_app: the Starlette application for one AppState."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.routing import Route

from deepinfer_server.api.errors import handle_api_error, handle_http_exception
from deepinfer_server.api.routes.chat import chat_completions
from deepinfer_server.api.routes.meta import health, list_models
from deepinfer_server.api.state import AppState
from deepinfer_server.errors import ApiError


def build_app(state: AppState) -> Starlette:
    """The ASGI app; every error leaves it as an OpenAI-shaped envelope."""
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={
            ApiError: handle_api_error,
            HTTPException: handle_http_exception,
            Exception: handle_api_error,
        },
    )
    app.state.server = state
    return app
