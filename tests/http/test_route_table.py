"""The route table is the one list of endpoints: the app's routes, the OpenAPI document's
operations and the API each path speaks (its error envelope) all follow from it."""

from __future__ import annotations

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from deepinfer_server.api.app import build_app
from deepinfer_server.api.dialects import Dialect, PathDialects
from deepinfer_server.api.error_responses import path_dialects
from deepinfer_server.api.route_table import ROUTES, Endpoint
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
)


def _dialects(endpoints: tuple[Endpoint, ...]) -> PathDialects:
    return PathDialects.of((e.path, e.dialect) for e in endpoints)


def test_a_route_added_to_the_table_is_served_documented_and_speaks_its_api() -> None:
    table = (*ROUTES, _NEW)

    async def body() -> None:
        async with serve() as h:
            app = build_app(h.state, table)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                answer = await client.post("/v2/count/7")
                assert answer.status_code == 200 and answer.json() == {"counted": 7}
                document = (await client.get("/openapi.json")).json()
            assert document["paths"]["/v2/count/{n}"]["post"]["summary"] == "A count"
            # The app built from today's table neither serves nor documents it.
            assert (await h.client.post("/v2/count/7")).status_code == 404
            today = (await h.client.get("/openapi.json")).json()
            assert "/v2/count/{n}" not in today["paths"]

    run(body)
    for path in ("/v2/count/7", "/v2/count/7/", "/v2/count"):
        assert _dialects(table).speaks_anthropic({"path": path, "headers": []})
        assert not path_dialects().speaks_anthropic({"path": path, "headers": []})


def test_the_servers_paths_speak_as_before() -> None:
    assert path_dialects() == PathDialects(anthropic=("/v1/messages",), either=("/v1/models",))
    versioned = [(b"anthropic-version", b"2023-06-01")]
    speaks = path_dialects().speaks_anthropic
    assert speaks({"path": "/v1/messages/count_tokens", "headers": []})
    assert speaks({"path": "/v1/messages/", "headers": []})  # a 404, in Anthropic's envelope
    assert not speaks({"path": "/v1/models/x", "headers": []})
    assert speaks({"path": "/v1/models/x", "headers": versioned})
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
