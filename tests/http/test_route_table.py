"""The route table is the one list of endpoints: the app's routes, the OpenAPI document's
operations, the paths behind the API keys and the API each path speaks (its error envelope) all
follow from it, so that a new endpoint is one entry plus its handler."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from deepinfer_server.api.app import build_app
from deepinfer_server.api.dialects import Dialect, PathDialects
from deepinfer_server.api.path_errors import path_dialects
from deepinfer_server.api.route import Endpoint
from deepinfer_server.api.route_table import ROUTES
from deepinfer_server.openapi import operations
from tests.http.harness import run, serve


async def _echo_count(request: Request) -> Response:
    return JSONResponse({"counted": request.path_params["n"]})


#: An endpoint the server does not have, in a dialect and under a prefix of its own.
_NEW = Endpoint(
    "/v2/count/{n:int}",
    "POST",
    _echo_count,
    Dialect.ANTHROPIC,
    operations.count_tokens("A count", "AnthropicError"),
    protected=True,
)


def _dialects(endpoints: tuple[Endpoint, ...]) -> PathDialects:
    return PathDialects.of((e.path, e.dialect) for e in endpoints)


def test_a_route_added_to_the_table_is_served_documented_and_speaks_its_api() -> None:
    table = (*ROUTES, _NEW)

    async def body() -> None:
        async with serve("--api-key", "k") as h:
            app = build_app(h.state, table)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                assert (await client.post("/v2/count/7")).status_code == 401  # protected
                keyed = {"authorization": "Bearer k"}
                answer = await client.post("/v2/count/7", headers=keyed)
                assert answer.status_code == 200 and answer.json() == {"counted": 7}
                document = (await client.get("/openapi.json")).json()
            operation = document["paths"]["/v2/count/{n}"]["post"]
            assert operation["summary"] == "A count" and operation["security"]
            # The app built from today's table neither serves nor documents it.
            keyed = {"authorization": "Bearer k"}
            assert (await h.client.post("/v2/count/7", headers=keyed)).status_code == 404
            today = (await h.client.get("/openapi.json")).json()
            assert "/v2/count/{n}" not in today["paths"]

    run(body)
    for path in ("/v2/count/7", "/v2/count/7/", "/v2/count"):
        assert _dialects(table).speaks_anthropic({"path": path, "headers": []})
        assert not path_dialects().speaks_anthropic({"path": path, "headers": []})


def test_the_servers_paths_speak_as_before() -> None:
    assert path_dialects() == PathDialects(
        anthropic=("/v1/messages",), either=("/v1/files", "/v1/models")
    )
    versioned = [(b"anthropic-version", b"2023-06-01")]
    speaks = path_dialects().speaks_anthropic
    assert speaks({"path": "/v1/messages/count_tokens", "headers": []})
    assert speaks({"path": "/v1/messages/", "headers": []})  # a 404, in Anthropic's envelope
    assert not speaks({"path": "/v1/models/x", "headers": []})
    assert speaks({"path": "/v1/models/x", "headers": versioned})
    assert speaks({"path": "/v1/files", "headers": versioned})
    assert not speaks({"path": "/v1/files/file-1/content", "headers": []})
    assert not speaks({"path": "/v1/chat/completions", "headers": versioned})


def test_an_openai_route_under_an_anthropic_prefix_is_refused() -> None:
    clash = Endpoint(
        "/v2/count/openai", "GET", _echo_count, Dialect.OPENAI, operations.get("Clash")
    )
    with pytest.raises(ValueError, match="/v2/count/openai"):
        _dialects((*ROUTES, _NEW, clash))


@pytest.mark.parametrize("endpoint", [e for e in ROUTES if "requestBody" in e.operation])
def test_each_documented_error_envelope_is_the_one_its_path_answers_in(endpoint: Endpoint) -> None:
    envelope = "AnthropicError" if endpoint.dialect is Dialect.ANTHROPIC else "OpenAIError"
    for status, response in endpoint.operation["responses"].items():
        if status != "200":
            schema = response["content"]["application/json"]["schema"]
            assert schema["$ref"].endswith("/" + envelope), (endpoint.path, status)


def test_the_document_lists_the_tables_operations_in_its_order() -> None:
    async def body() -> list[str]:
        async with serve() as h:
            return list((await h.client.get("/openapi.json")).json()["paths"])

    assert run(body) == list(dict.fromkeys(e.openapi_path for e in ROUTES))


def test_each_entry_has_a_handler_and_a_documented_operation_once() -> None:
    seen = set()
    for endpoint in ROUTES:
        assert callable(endpoint.handler), endpoint.path
        assert endpoint.operation["summary"] and "200" in endpoint.operation["responses"]
        assert (endpoint.path, endpoint.method) not in seen, endpoint.path
        seen.add((endpoint.path, endpoint.method))


def test_the_protected_routes_are_the_ones_the_table_declares_and_documents() -> None:
    outside_v1 = {e.path for e in ROUTES if e.protected and not e.path.startswith("/v1/")}
    assert outside_v1 == {"/tokenize", "/detokenize", "/tokenizer_info"}
    # Every /v1 route is behind the keys by its prefix: its entry must say so too.
    assert all(e.protected for e in ROUTES if e.path.startswith("/v1/"))

    async def body() -> dict[str, Any]:
        async with serve() as h:
            document: dict[str, Any] = (await h.client.get("/openapi.json")).json()
            return document

    document = run(body)
    for endpoint in ROUTES:
        operation = document["paths"][endpoint.openapi_path][endpoint.method.lower()]
        assert ("security" in operation) is endpoint.protected, endpoint.path


def test_a_protected_route_outside_v1_needs_a_key_and_an_open_one_does_not() -> None:
    async def body() -> None:
        async with serve("--api-key", "k") as h:
            assert (await h.client.get("/tokenizer_info")).status_code == 401
            assert (await h.client.get("/version")).status_code == 200
            keyed = {"authorization": "Bearer k"}
            assert (await h.client.get("/tokenizer_info", headers=keyed)).status_code == 200

    run(body)
