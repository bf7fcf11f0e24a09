"""The route table's meta family: models, the root, probes, metrics, version, router info and
the OpenAPI document."""

from __future__ import annotations

from deepinfer_server.api.dialects import Dialect
from deepinfer_server.api.route import Endpoint, with_parameters
from deepinfer_server.api.routes.meta import health, metrics, root, server_version
from deepinfer_server.api.routes.models import list_models, retrieve_model
from deepinfer_server.api.routes.openapi import openapi_json
from deepinfer_server.api.routes.router_info import get_load, model_info, server_info
from deepinfer_server.openapi import operations as op
from deepinfer_server.openapi.schema import one_of, ref

#: In the order the document lists them.
META: tuple[Endpoint, ...] = (
    Endpoint(
        "/v1/models",
        "GET",
        list_models,
        Dialect.EITHER,
        op.get(
            "The served models with their context window, max_model_len (Anthropic's shape "
            "with an anthropic-version header)",
            op.json_content(one_of(ref("ModelList"), ref("AnthropicModelList"))),
        ),
        protected=True,
    ),
    Endpoint(
        "/v1/models/{model_id:path}",
        "GET",
        retrieve_model,
        Dialect.EITHER,
        with_parameters(
            op.get(
                "One served model; 404 for a name not served",
                op.json_content(one_of(ref("Model"), ref("AnthropicModel"))),
            ),
            op.MODEL_ID,
        ),
        protected=True,
    ),
    Endpoint(
        "/",
        "GET",
        root,
        Dialect.OPENAI,
        op.get(
            "The server's name, version and starting links (HEAD / answers 200 without a body)",
            op.json_content(ref("ServerRoot")),
        ),
    ),
    Endpoint(
        "/health", "GET", health, Dialect.OPENAI, op.get("200 {status: ok}, else 503 with a reason")
    ),
    Endpoint(
        "/metrics",
        "GET",
        metrics,
        Dialect.OPENAI,
        op.get("Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}}),
    ),
    Endpoint(
        "/version",
        "GET",
        server_version,
        Dialect.OPENAI,
        op.get("Server, deepseek-recipe and DeepInfer versions"),
    ),
    Endpoint(
        "/get_load",
        "GET",
        get_load,
        Dialect.OPENAI,
        with_parameters(
            op.get("Requests running and waiting, as vLLM Router or the SGLang gateway reads them"),
            op.LOAD_FORMAT,
        ),
    ),
    Endpoint(
        "/server_info",
        "GET",
        server_info,
        Dialect.OPENAI,
        op.get("What the SGLang gateway reads when registering a worker"),
    ),
    Endpoint(
        "/get_server_info", "GET", server_info, Dialect.OPENAI, op.get("Alias of /server_info")
    ),
    Endpoint(
        "/model_info", "GET", model_info, Dialect.OPENAI, op.get("The SGLang gateway's model info")
    ),
    Endpoint("/get_model_info", "GET", model_info, Dialect.OPENAI, op.get("Alias of /model_info")),
    Endpoint("/openapi.json", "GET", openapi_json, Dialect.OPENAI, op.get("This document")),
)
