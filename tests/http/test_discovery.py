"""What a client probing the server finds before its first request: `GET /` and `HEAD /` (Claude
Code sends `HEAD /`), open as /health is, and the context window on every model object of
`/v1/models` as vLLM reports it (`max_model_len`), in both shapes and in the OpenAPI document."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx2
import jsonschema

from deepinfer_server import __version__
from deepinfer_server.api.app import build_app
from tests.http.harness import MODEL, Harness, run, serve

CONTEXT = 4096  # the harness's --max-model-len
ANTHROPIC = {"anthropic-version": "2023-06-01"}


def _document_schema(document: dict[str, Any], path: str) -> jsonschema.Draft202012Validator:
    """A validator of the 200 body the document states for GET `path`."""
    operation = document["paths"][path]["get"]
    schema = operation["responses"]["200"]["content"]["application/json"]["schema"]
    return jsonschema.Draft202012Validator({**schema, "components": document["components"]})


def test_the_root_answers_get_and_head_without_a_key() -> None:
    async def body() -> None:
        async with serve("--api-key", "secret") as h:
            got = await h.client.get("/")
            assert got.status_code == 200
            assert got.json() == {
                "name": "deepinfer-server",
                "version": __version__,
                "links": {"openapi": "/openapi.json", "models": "/v1/models", "health": "/health"},
            }
            head = await h.client.head("/")
            assert head.status_code == 200 and head.content == b""
            assert head.headers["content-type"] == "application/json"
            document = (await h.client.get("/openapi.json")).json()
            _document_schema(document, "/").validate(got.json())
            assert "security" not in document["paths"]["/"]["get"]  # open, as /health is

    run(body)


def _anthropic(h: Harness) -> anthropic.AsyncAnthropic:
    transport = httpx2.ASGITransport(app=build_app(h.state))
    return anthropic.AsyncAnthropic(
        base_url="http://test",
        api_key="unused",
        http_client=httpx2.AsyncClient(transport=transport),
        max_retries=0,
    )


def test_every_model_object_reports_the_context_window() -> None:
    async def body() -> None:
        async with serve("--served-model-name", MODEL, "alias") as h:
            listed = [model async for model in h.openai().models.list()]
            assert [m.id for m in listed] == [MODEL, "alias"]
            assert [(m.model_extra or {})["max_model_len"] for m in listed] == [CONTEXT, CONTEXT]
            one = await h.openai().models.retrieve("alias")
            assert (one.model_extra or {})["max_model_len"] == CONTEXT

            claude = [model async for model in _anthropic(h).models.list()]
            assert [m.max_input_tokens for m in claude] == [CONTEXT, CONTEXT]
            assert [m.max_tokens for m in claude] == [CONTEXT, CONTEXT]

            document = (await h.client.get("/openapi.json")).json()
            schemas = document["components"]["schemas"]
            assert "max_model_len" in schemas["Model"]["required"]
            assert "max_model_len" in schemas["AnthropicModel"]["required"]
            listing = _document_schema(document, "/v1/models")
            for headers in ({}, ANTHROPIC):
                answer = (await h.client.get("/v1/models", headers=headers)).json()
                listing.validate(answer)
                assert [m["max_model_len"] for m in answer["data"]] == [CONTEXT, CONTEXT]
                retrieved = await h.client.get(f"/v1/models/{MODEL}", headers=headers)
                _document_schema(document, "/v1/models/{model_id}").validate(retrieved.json())

    run(body)
