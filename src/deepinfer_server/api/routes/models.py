"""GET /v1/models and /v1/models/{model_id}: the served names, in OpenAI's or Anthropic's shape.

Anthropic's SDKs and Claude Code send `anthropic-version` on every request; with that header the
answers take the shape of Anthropic's models endpoint (`type: "model"`, `display_name`,
`created_at` as RFC 3339, a list with `has_more`, `first_id`, `last_id`), as Anthropic's own API
does. Without it they are OpenAI's model objects. Both carry the context window as vLLM reports
it (`max_model_len`); Anthropic's shape also as `max_input_tokens` and `max_tokens`, its fields.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal, TypedDict

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from deepinfer_server.api.dialects import sends_anthropic_version
from deepinfer_server.api.state import AppState
from deepinfer_server.protocol.core.validation import check_model


class OpenAIModel(TypedDict):
    """OpenAI's model object, with vLLM's `root`, `parent` and `max_model_len`."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: None
    max_model_len: int


class AnthropicModel(TypedDict):
    """Anthropic's model object, with the context window as vLLM reports it too."""

    type: Literal["model"]
    id: str
    display_name: str
    created_at: str
    max_input_tokens: int
    max_tokens: int
    max_model_len: int


def _openai_model(state: AppState, name: str) -> OpenAIModel:
    config = state.config
    return {
        "id": name,
        "object": "model",
        "created": state.started_at,
        "owned_by": "deepinfer-server",
        "root": config.model or config.served_model_name,
        "parent": None,
        "max_model_len": config.max_model_len,
    }


def _anthropic_model(state: AppState, name: str) -> AnthropicModel:
    created = datetime.fromtimestamp(state.started_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    window = state.config.max_model_len
    return {
        "type": "model",
        "id": name,
        "display_name": name,
        "created_at": created,
        # The output limit is the window too: a request's is lowered to what its prompt leaves.
        "max_input_tokens": window,
        "max_tokens": window,
        "max_model_len": window,
    }


async def list_models(request: Request) -> Response:
    """The served model names, in the shape of the API the client speaks."""
    state: AppState = request.app.state.server
    names = state.config.served_model_names
    # Served on the paths both APIs share: the header tells Anthropic's clients apart.
    if sends_anthropic_version(request.scope):
        data = [_anthropic_model(state, name) for name in names]
        return JSONResponse(
            {"data": data, "has_more": False, "first_id": names[0], "last_id": names[-1]}
        )
    return JSONResponse({"object": "list", "data": [_openai_model(state, n) for n in names]})


async def retrieve_model(request: Request) -> Response:
    """One served model (404 for a name not served), in the client's API's shape."""
    state: AppState = request.app.state.server
    name: str = request.path_params["model_id"]
    check_model({"model": name}, state.config.served_model_names)
    if sends_anthropic_version(request.scope):
        return JSONResponse(_anthropic_model(state, name))
    return JSONResponse(_openai_model(state, name))
