"""GET /v1/models and GET /health."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from deepinfer_server.api.state import AppState


async def list_models(request: Request) -> Response:
    state: AppState = request.app.state.server
    config = state.config
    root = config.model or config.served_model_names[0]
    data = [
        {
            "id": name,
            "object": "model",
            "created": state.started_at,
            "owned_by": "deepinfer-server",
            "root": root,
            "parent": None,
            "max_model_len": config.context_limit,
        }
        for name in config.served_model_names
    ]
    return JSONResponse({"object": "list", "data": data})


async def health(request: Request) -> Response:
    state: AppState = request.app.state.server
    failure = state.engine.failure
    if failure is not None:
        return JSONResponse({"status": "failed", "reason": failure}, status_code=503)
    if state.engine.draining:
        return JSONResponse(
            {"status": "draining", "reason": "the server is shutting down"}, status_code=503
        )
    return JSONResponse({"status": "ok"})
