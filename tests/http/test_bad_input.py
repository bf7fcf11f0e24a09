"""Bad input never gets a 5xx: property-based bodies over the three POST endpoints, in-process,
and the specific rules (nesting depth, content type, required and unsupported fields)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer_server.protocol.core.validation import MAX_JSON_DEPTH
from tests.http.harness import MODEL, Harness, failures, run, serve
from tests.lanes import require_grammar
from tests.paths import PD_SECRET_ARGS

CHAT, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/responses", "/v1/messages"
JSON = {"content-type": "application/json"}
VALID: dict[str, dict[str, Any]] = {
    CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
    RESPONSES: {"model": MODEL, "input": "hi", "max_output_tokens": 8},
    MESSAGES: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
}
PATHS = list(VALID)
FIELDS = sorted({name for body in VALID.values() for name in body} | {
    "stream", "tools", "tool_choice", "metadata", "temperature", "top_p", "stop", "thinking",
    "response_format", "text", "instructions", "system", "input", "seed", "n", "user",
    "kv_transfer_params",
})  # fmt: skip

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)
#: JSON text (json.dumps: integers beyond 64 bits too, which orjson cannot write).
json_texts = json_values.map(lambda value: json.dumps(value).encode())
part_types = st.sampled_from(["text", "input_text", "image_url", "image", "bogus"]) | json_values


class Client:
    """One in-process app on its own event loop, shared by the examples of a test."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._context = serve()
        self.harness: Harness = self.loop.run_until_complete(self._context.__aenter__())

    def post(self, path: str, content: bytes, headers: dict[str, str] = JSON) -> httpx.Response:
        request = self.harness.client.post(path, content=content, headers=headers)
        return self.loop.run_until_complete(asyncio.wait_for(request, 30))

    def close(self) -> None:
        self.loop.run_until_complete(self._context.__aexit__(None, None, None))
        self.loop.close()


@pytest.fixture(scope="module")
def app() -> Iterator[Client]:
    client = Client()
    yield client
    client.close()


def assert_answered(response: httpx.Response, path: str) -> None:
    """A 2xx, or a 4xx in the path's protocol envelope with the request ID; never a 5xx."""
    assert response.status_code < 500, response.text
    assert "x-request-id" in response.headers
    if response.status_code < 400:
        return
    body = response.json()
    if path == MESSAGES:
        assert body["type"] == "error"
        assert isinstance(body["error"]["type"], str) and isinstance(body["error"]["message"], str)
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}


def nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


def with_nesting(body: dict[str, Any], where: str, depth: int) -> bytes:
    """`body` with a value `depth` levels deep at `where` (JSON text: orjson stops at 255)."""
    marker = "__nested__"
    text = json.dumps({**body, where: marker})
    return text.replace(json.dumps(marker), nested(depth)).encode()


PROPERTY = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@PROPERTY
@given(path=st.sampled_from(PATHS), content=json_texts | st.binary(max_size=64))
def test_arbitrary_bodies_are_answered_without_5xx(app: Client, path: str, content: bytes) -> None:
    assert_answered(app.post(path, content), path)


@PROPERTY
@given(path=st.sampled_from(PATHS), field=st.sampled_from(FIELDS), value=json_values)
def test_any_field_with_any_value_is_answered_without_5xx(
    app: Client, path: str, field: str, value: Any
) -> None:
    assert_answered(app.post(path, json.dumps({**VALID[path], field: value}).encode()), path)


@PROPERTY
@given(path=st.sampled_from(PATHS), part_type=part_types, extra=json_values)
def test_content_parts_of_any_type_are_answered_without_5xx(
    app: Client, path: str, part_type: Any, extra: Any
) -> None:
    part = {"type": part_type, "text": "x", "image_url": extra, "source": extra}
    body = dict(VALID[path])
    if path == RESPONSES:
        body["input"] = [{"role": "user", "content": [part]}, extra]
    else:
        body["messages"] = [{"role": "user", "content": [part]}]
    assert_answered(app.post(path, json.dumps(body).encode()), path)


@PROPERTY
@given(
    path=st.sampled_from(PATHS),
    where=st.sampled_from(["metadata", "tools", "messages", "input", "unknown_field"]),
    depth=st.integers(1, 400),
)
def test_deep_nesting_anywhere_is_answered_without_5xx(
    app: Client, path: str, where: str, depth: int
) -> None:
    response = app.post(path, with_nesting(VALID[path], where, depth))
    assert_answered(response, path)
    if depth > MAX_JSON_DEPTH:
        assert response.status_code == 400
        assert f"more than {MAX_JSON_DEPTH} levels" in response.text


def test_after_the_properties_a_normal_request_works_and_no_5xx_was_counted(app: Client) -> None:
    for path, body in VALID.items():
        assert app.post(path, orjson.dumps(body)).status_code == 200
    assert not [status for status in failures(app.harness.metrics) if status.startswith("5")]


@pytest.mark.parametrize("path", PATHS)
def test_nesting_is_limited_even_in_ignored_fields(path: str) -> None:
    async def body() -> None:
        async with serve() as h:
            deepest = with_nesting(VALID[path], "metadata", MAX_JSON_DEPTH - 1)
            at_limit = await h.client.post(path, content=deepest, headers=JSON)
            assert "levels deep" not in at_limit.text
            over = await h.client.post(
                path, content=with_nesting(VALID[path], "metadata", MAX_JSON_DEPTH), headers=JSON
            )
            assert over.status_code == 400
            assert f"more than {MAX_JSON_DEPTH} levels deep" in over.text

    run(body)


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"],
)
def test_a_body_not_declared_json_is_415(content_type: str | None) -> None:
    async def body() -> None:
        async with serve() as h:
            headers = {} if content_type is None else {"content-type": content_type}
            response = await h.client.post(CHAT, content=orjson.dumps(VALID[CHAT]), headers=headers)
            assert response.status_code == 415
            error = response.json()["error"]
            assert error["code"] == "unsupported_media_type"
            assert "--json" in error["message"]
            assert not h.coordinator.submitted

    run(body)


@pytest.mark.parametrize(
    "content_type", ["application/json", "application/json; charset=utf-8", "application/x+json"]
)
def test_json_content_types_are_accepted(content_type: str) -> None:
    async def body() -> None:
        async with serve() as h:
            response = await h.client.post(
                CHAT, content=orjson.dumps(VALID[CHAT]), headers={"content-type": content_type}
            )
            assert response.status_code == 200

    run(body)


def test_a_trailing_slash_is_a_404_in_the_paths_envelope_not_a_redirect() -> None:
    async def body() -> None:
        async with serve() as h:
            chat = await h.client.post(CHAT + "/", json=VALID[CHAT])
            assert chat.status_code == 404 and "error" in chat.json()
            messages = await h.client.post(MESSAGES + "/", json=VALID[MESSAGES])
            assert messages.status_code == 404 and messages.json()["type"] == "error"

    run(body)


def test_messages_without_max_tokens_is_a_400_as_in_anthropics_api() -> None:
    async def body() -> None:
        async with serve() as h:
            request = {key: value for key, value in VALID[MESSAGES].items() if key != "max_tokens"}
            response = await h.client.post(MESSAGES, json=request)
            assert response.status_code == 400
            assert response.json()["error"] == {
                "type": "invalid_request_error",
                "message": "max_tokens: Field required",
            }

    run(body)


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"input": ["hi", {"type": "bogus"}]}, "input[1].type", "bogus"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "item_reference"),
        ({"input": [{"type": ["message"], "role": "user"}]}, "input[0].type", "['message']"),
    ],
)
def test_responses_rejects_what_it_cannot_honour(
    extra: dict[str, Any], param: str, words: str
) -> None:
    async def body() -> None:
        async with serve() as h:
            response = await h.client.post(RESPONSES, json={**VALID[RESPONSES], **extra})
            assert response.status_code == 400
            error = response.json()["error"]
            assert error["param"] == param
            assert words in error["message"]
            assert not h.coordinator.submitted

    run(body)


def test_responses_accepts_the_item_types_the_recipe_converts() -> None:
    async def body() -> None:
        async with serve() as h:
            items = [
                {"type": "message", "role": "user", "content": "hi"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "ok"},
                {"type": "reasoning", "id": "r1", "summary": []},
            ]
            response = await h.client.post(RESPONSES, json={**VALID[RESPONSES], "input": items})
            assert response.status_code == 200, response.text

    run(body)


COMPLETIONS = "/v1/completions"


@pytest.mark.parametrize("token_id", [2**31, 2**32, 2**64 - 1, -(2**63), -1, "bound"])
def test_a_token_id_outside_the_vocabulary_is_a_400_before_admission(token_id: int | str) -> None:
    """The issue's reproduction (2**31 leaked an admission slot, 2**32 was a 500): refused in
    the protocol layer with the bound the engine applies, before any slot is taken."""

    async def body() -> None:
        async with serve() as h:
            bound = h.state.recipe.prompt_id_bound
            ids = [bound if token_id == "bound" else token_id]
            for prompt in ([1, *ids], [[1, 2], [3, *ids]]):
                response = await h.client.post(
                    COMPLETIONS, json={"model": MODEL, "prompt": prompt, "max_tokens": 1}
                )
                assert response.status_code == 400, response.text
                error = response.json()["error"]
                assert error["param"] == "prompt"
                assert f"[0, {bound})" in error["message"]
            assert not h.coordinator.submitted
            last = await h.client.post(
                COMPLETIONS, json={"model": MODEL, "prompt": [1, bound - 1], "max_tokens": 1}
            )
            assert last.status_code == 200, last.text
            assert failures(h.metrics) == {"400": 2}

    run(body)


def test_the_prompt_id_bound_is_the_checkpoints_vocab_size(tmp_path: Any) -> None:
    """DeepInfer's bound is config.json's text_config.vocab_size, not the tokenizer's size;
    without it, the tokenizer's vocabulary with its added tokens."""
    from deepinfer_server.model.tokenizer import embedded_tokenizer_json, prompt_id_bound
    from deepinfer_server.protocol.core.recipe import RecipeContext

    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 1000}}))
    assert prompt_id_bound(str(tmp_path)) == 1000
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"]}))
    assert prompt_id_bound(str(tmp_path)) is None
    assert prompt_id_bound(None) is None
    recipe = RecipeContext.create(
        embedded_tokenizer_json(), ("m",), 4096, default_thinking=True, prompt_id_bound=None
    )
    assert recipe.prompt_id_bound == 129280  # the tokenizer's size


@pytest.mark.parametrize("role", [["user"], {"name": "user"}, 7, None])
def test_a_role_that_is_not_a_string_is_a_400(role: Any) -> None:
    async def body() -> None:
        async with serve() as h:
            request = {**VALID[CHAT], "messages": [{"role": role, "content": "hi"}]}
            response = await h.client.post(CHAT, json=request)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "messages[0].role"
            assert failures(h.metrics) == {"400": 1}

    run(body)


@pytest.mark.parametrize("calls", [True, False, 0.0, "call", {"id": "x"}])
def test_assistant_tool_calls_that_are_not_an_array_are_a_400(calls: Any) -> None:
    # Found by the fuzz lane: two assistant messages in a row are merged (their tool calls
    # joined), which iterated `true` and answered 500.
    async def body() -> None:
        async with serve() as h:
            turns = [
                {"role": "assistant", "content": "a"},
                {"role": "assistant", "tool_calls": calls},
            ]
            request = {**VALID[CHAT], "messages": [{"role": "user", "content": "hi"}, *turns]}
            response = await h.client.post(CHAT, json=request)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "messages[2].tool_calls"
            assert failures(h.metrics) == {"400": 1}

    run(body)


@pytest.mark.parametrize(
    ("field", "value"),
    [("store", "a"), ("store", 1), ("background", 247), ("background", "true"), ("store", [])],
)
def test_responses_store_and_background_must_be_booleans(field: str, value: Any) -> None:
    async def body() -> None:
        async with serve() as h:
            response = await h.client.post(RESPONSES, json={**VALID[RESPONSES], field: value})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == field and "boolean" in error["message"]
            assert not h.coordinator.submitted
            fine = await h.client.post(RESPONSES, json={**VALID[RESPONSES], field: False})
            assert fine.status_code == 200, fine.text

    run(body)


@pytest.mark.parametrize("path", [*PATHS, COMPLETIONS, "/v1/messages/count_tokens"])
def test_a_compressed_body_is_a_415_that_names_the_encoding(path: str) -> None:
    import gzip

    async def body() -> None:
        async with serve() as h:
            request = VALID.get(path, {"model": MODEL, "prompt": "hi", **VALID[MESSAGES]})
            response = await h.client.post(
                path,
                content=gzip.compress(orjson.dumps(request)),
                headers={**JSON, "content-encoding": "gzip"},
            )
            assert response.status_code == 415, response.text
            assert "Content-Encoding: gzip is not supported" in response.text
            assert "UTF-8" not in response.text

    run(body)


@pytest.mark.parametrize("path", [*PATHS, COMPLETIONS, "/v1/messages/count_tokens"])
def test_every_post_route_refuses_a_body_not_declared_json(path: str) -> None:
    """One body prologue: the 415 of a text/plain body holds on every POST route."""

    async def body() -> None:
        async with serve() as h:
            request = VALID.get(path, {"model": MODEL, "prompt": "hi", **VALID[MESSAGES]})
            response = await h.client.post(
                path, content=orjson.dumps(request), headers={"content-type": "text/plain"}
            )
            assert response.status_code == 415, response.text
            assert "Content-Type: application/json" in response.text
            assert not h.coordinator.submitted

    run(body)


SELF_REF: dict[str, Any] = {"$ref": "#"}


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        (
            CHAT,
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SELF_REF},
                }
            },
            "response_format",
        ),
        (CHAT, {"structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs.grammar"),
        (
            RESPONSES,
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": SELF_REF}}},
            "text.format",
        ),
        (
            MESSAGES,
            {"output_config": {"format": {"type": "json_schema", "schema": SELF_REF}}},
            "output_config.format",
        ),
    ],
)
@pytest.mark.grammar
def test_a_grammar_that_matches_no_text_is_a_400_naming_the_param(
    path: str, extra: dict[str, Any], param: str
) -> None:
    """`{"$ref": "#"}` is `root ::= root`: no token can start it. It compiled, and the engine
    then failed the request (500 `structured_output_failed`); the API's compile refuses it."""
    require_grammar()

    async def body() -> None:
        async with serve() as h:
            answer = await h.client.post(path, json={**VALID[path], **extra})
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert "matches no text" in error["message"]
            if path == MESSAGES:  # Anthropic's envelope has no param
                assert error["type"] == "invalid_request_error"
            else:
                assert error["param"] == param
            assert not h.coordinator.submitted

    run(body, timeout=240)


@pytest.mark.parametrize(
    ("mode", "extra", "words"),
    [
        ("null", {"kv_transfer_params": {"do_remote_decode": True}}, "no prefill/decode"),
        ("decode", {}, "this is a decode server"),
        ("decode", {"kv_transfer_params": {"do_remote_prefill": True}}, "remote_host"),
        ("prefill", {"kv_transfer_params": {"do_remote_prefill": True}}, "prefill server"),
    ],
)
def test_kv_transfer_params_that_do_not_fit_the_servers_role_are_a_400_in_each_shape(
    mode: str, extra: dict[str, Any], words: str
) -> None:
    async def body() -> None:
        async with serve(*PD_SECRET_ARGS, "--disaggregation-mode", mode) as h:
            for path in PATHS:
                response = await h.client.post(path, json={**VALID[path], **extra})
                assert response.status_code == 400, (path, response.text)
                error = response.json()["error"]
                assert words in error["message"]
                if path == MESSAGES:
                    assert error["type"] == "invalid_request_error"
                else:
                    assert error["param"] == "kv_transfer_params"
            assert not h.coordinator.submitted  # nothing was admitted

    run(body)


def test_a_reasoning_budget_on_a_decode_server_is_a_400_in_each_shape() -> None:
    """Ending the reasoning re-adds prompt and reasoning, which a decode engine cannot prefill."""
    budgets: dict[str, dict[str, Any]] = {
        CHAT: {"thinking_token_budget": 4},
        RESPONSES: {"thinking_token_budget": 4},
        MESSAGES: {"thinking": {"type": "enabled", "budget_tokens": 4}},
    }

    async def body() -> None:
        async with serve(*PD_SECRET_ARGS, "--disaggregation-mode", "decode") as h:
            for path in PATHS:
                handoff = {"kv_transfer_params": {"do_remote_prefill": True}}
                response = await h.client.post(
                    path, json={**VALID[path], **budgets[path], **handoff}
                )
                assert response.status_code == 400, (path, response.text)
                assert "cannot honour a reasoning budget" in response.json()["error"]["message"]
            assert not h.coordinator.submitted

    run(body)


def test_a_prefill_server_leaves_the_reasoning_budget_to_the_decode_side() -> None:
    """A prefill engine computes the prompt and its first token for the handoff: a budget
    forced there would change the prompt whose KV is handed off."""

    async def body() -> None:
        async with serve(*PD_SECRET_ARGS, "--disaggregation-mode", "prefill") as h:
            request = {**VALID[CHAT], "max_tokens": 1, "thinking_token_budget": 0}
            response = await h.client.post(CHAT, json=request)
            assert response.status_code == 200, response.text
            (_, _, sampling), *_ = h.coordinator.submitted
            assert sampling.thinking_budget is None

    run(body)
