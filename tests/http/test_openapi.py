"""GET /openapi.json, and the document kept in step with the code.

- Routes: the Starlette app's routes and the document's operations are the same set.
- Fields: every request-body field the protocol layer reads (recorded by running the real
  preparation functions on bodies that reach deep into them) is described in the document.
- Bounds: every numeric bound and enum the document states for a top-level field is where the
  validation draws it (the bound accepted, one past it a 400).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator
from functools import cache
from typing import Any

import jsonschema
import msgspec
import msgspec.inspect
import pytest
from starlette.routing import Route

from deepinfer_server.api.app import build_app
from deepinfer_server.api.route_table import ROUTES
from deepinfer_server.api.routes.openapi import openapi_document
from deepinfer_server.errors import ApiError, ContextLengthError
from deepinfer_server.model.tokenizer import embedded_tokenizer_json
from deepinfer_server.protocol.chat.request import prepare_chat
from deepinfer_server.protocol.completions.request import prepare_completion
from deepinfer_server.protocol.core import sampling as sampling_module
from deepinfer_server.protocol.core.body import read_body
from deepinfer_server.protocol.core.recipe import RecipeContext
from deepinfer_server.protocol.core.validation import read_priority
from deepinfer_server.protocol.messages.request import count_message_tokens, prepare_messages
from deepinfer_server.protocol.responses.request import prepare_responses
from tests.http.harness import MODEL, run, serve

Prepare = Callable[[dict[str, Any], RecipeContext], object]

#: Route → (request body component, its preparation function, a minimal valid body).
POST_APIS: dict[str, tuple[str, Prepare, dict[str, Any]]] = {
    "/v1/chat/completions": (
        "ChatCompletionRequest",
        prepare_chat,
        {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}]},
    ),
    "/v1/completions": (
        "CompletionRequest",
        prepare_completion,
        # echo: max_tokens 0 (the documented minimum) needs it.
        {"model": MODEL, "prompt": "Hello", "echo": True},
    ),
    "/v1/responses": ("ResponsesRequest", prepare_responses, {"model": MODEL, "input": "Hello"}),
    "/v1/messages": (
        "MessagesRequest",
        prepare_messages,
        {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "Hello"}]},
    ),
    "/v1/messages/count_tokens": (
        "CountTokensRequest",
        count_message_tokens,
        {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}]},
    ),
}

_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}}
_FUNCTION = {"name": "lookup", "description": "Look up", "parameters": _SCHEMA, "strict": True}
_USER = {"role": "user", "content": "Hello, answer in JSON"}
_HISTORY = [
    {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
    _USER,
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Think.",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "42"},
    {"role": "assistant", "content": "Done."},
    _USER,
]

#: Bodies that take each preparation function down its branches (tools, formats, streams,
#: reasoning, history), on top of the minimal ones: the fields read are recorded on all of them.
DEEP_BODIES: dict[str, list[dict[str, Any]]] = {
    "/v1/chat/completions": [
        {
            "model": MODEL,
            "messages": _HISTORY,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "n": 2,
            "seed": 1,
            "logprobs": True,
            "top_logprobs": 2,
            "max_completion_tokens": 32,
            "tools": [{"type": "function", "function": _FUNCTION}],
            "tool_choice": {"type": "function", "function": {"name": "lookup"}},
            "parallel_tool_calls": False,
            "thinking": {"type": "disabled"},
            "logit_bias": {"1": 0},
        },
        {
            "model": MODEL,
            "messages": [_USER],
            "response_format": {"type": "json_schema", "json_schema": {"schema": _SCHEMA}},
        },
        {"model": MODEL, "messages": [_USER], "structured_outputs": {"choice": ["a", "b"]}},
        {"model": MODEL, "messages": [_USER], "guided_regex": "a+"},
    ],
    "/v1/completions": [
        {
            "model": MODEL,
            "prompt": [[1, 2, 3], [4, 5]],
            "stream": True,
            "stream_options": {"include_usage": True},
            "stop": ["\n"],
            "logprobs": 2,
            "n": 2,
            "best_of": 2,
            "seed": 3,
            "max_tokens": 8,
        },
    ],
    "/v1/responses": [
        {
            "model": MODEL,
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": "Hello"},
                {
                    "type": "reasoning",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "Think."}],
                    "encrypted_content": "not-a-blob",
                },
                {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "42"},
            ],
            "include": ["reasoning.encrypted_content", "message.output_text.logprobs"],
            "reasoning": {"effort": "high", "summary": "auto"},
            "tools": [{"type": "function", **_FUNCTION}],
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "stream": True,
        },
        {
            "model": MODEL,
            "input": "Answer in JSON",
            "text": {"format": {"type": "json_schema", "name": "a", "schema": _SCHEMA}},
        },
    ],
    "/v1/messages": [
        {
            "model": MODEL,
            "max_tokens": 32,
            "system": "Be brief.",
            "messages": [
                {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]},
                {"role": "user", "content": [{"type": "text", "text": "Again"}]},
            ],
            "tools": [
                {"name": "lookup", "input_schema": _SCHEMA, "strict": True},
                {"type": "bash_20250124", "name": "bash"},
            ],
            "tool_choice": {"type": "tool", "name": "lookup", "disable_parallel_tool_use": True},
            "thinking": {"type": "enabled", "budget_tokens": 64},
            "top_k": 5,
            "stream": True,
        },
        {
            "model": MODEL,
            "max_tokens": 32,
            "messages": [_USER],
            "output_config": {"format": {"type": "json_schema", "schema": _SCHEMA}},
        },
        {
            "model": MODEL,
            "max_tokens": 32,
            "messages": [_USER],
            "output_format": {"type": "json_schema", "schema": _SCHEMA},
        },
    ],
}


@cache
def _recipe() -> RecipeContext:
    # A context that holds the largest max_tokens the document allows.
    return RecipeContext.create(
        embedded_tokenizer_json(), (MODEL,), 2**20, default_thinking=True, reasoning_secret="s"
    )


def _components() -> dict[str, Any]:
    schemas: dict[str, Any] = openapi_document((MODEL,), ROUTES)["components"]["schemas"]
    return schemas


def _route_operations() -> set[tuple[str, str]]:
    async def routes() -> list[Route]:
        async with serve() as h:
            return [r for r in build_app(h.state).routes if isinstance(r, Route)]

    found = set()
    for route in run(routes):
        for method in route.methods or ():
            if method != "HEAD":  # Starlette adds HEAD to every GET
                found.add((method.lower(), route.path_format))
    return found


def test_the_document_describes_exactly_the_routes_the_app_serves() -> None:
    assert _route_operations() == {(e.method.lower(), e.openapi_path) for e in ROUTES}


def test_openapi_json_is_served_without_an_api_key() -> None:
    async def body() -> None:
        async with serve("--api-key", "secret") as h:
            response = await h.client.get("/openapi.json")
            assert response.status_code == 200, response.text
            assert response.headers["content-type"] == "application/json"
            assert response.json() == openapi_document((MODEL,), ROUTES)

    run(body)


def test_the_model_names_are_the_served_ones() -> None:
    async def body() -> None:
        async with serve("--served-model-name", "alpha", "beta") as h:
            document = (await h.client.get("/openapi.json")).json()
            assert document["components"]["schemas"]["ModelName"]["enum"] == ["alpha", "beta"]

    run(body)


def test_every_schema_in_the_document_is_valid_json_schema_2020_12() -> None:
    document = openapi_document((MODEL,), ROUTES)
    assert document["openapi"].startswith("3.1")
    for schema in _components().values():
        jsonschema.Draft202012Validator.check_schema(schema)
    assert _components()["ModelName"]["enum"] == [MODEL]
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            body = operation.get("requestBody")
            if method == "post" and not path.endswith("/cancel"):  # cancel takes no body
                assert body is not None, path
            if body is not None:
                (content,) = body["content"].values()  # JSON, or a file upload's form
                name = content["schema"]["$ref"].split("/")[-1]
                assert name in _components(), path


def test_the_minimal_bodies_are_valid_by_the_document_and_by_the_server() -> None:
    for path, (component, prepare, minimal) in POST_APIS.items():
        _validator(component).validate(minimal)
        prepare(copy.deepcopy(minimal), _recipe())  # raises on a 400
        for deep in DEEP_BODIES.get(path, []):
            _validator(component).validate(deep)


class _Reads(dict[str, Any]):
    """A request body (or a part of it) that records which keys the code reads, as paths."""

    def __init__(self, data: dict[str, Any], path: str, seen: set[str]) -> None:
        super().__init__(data)
        self._path = path
        self._seen = seen

    def _note(self, key: object) -> None:
        if isinstance(key, str):
            self._seen.add(f"{self._path}{key}")

    def get(self, key: str, default: Any = None) -> Any:
        self._note(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self._note(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self._note(key)
        return super().__contains__(key)

    def pop(self, key: str, *default: Any) -> Any:
        self._note(key)
        return super().pop(key, *default)

    def setdefault(self, key: str, default: Any = None) -> Any:
        self._note(key)
        return super().setdefault(key, default)


def _recording(value: Any, path: str, seen: set[str]) -> Any:
    if isinstance(value, dict):
        children = {k: _recording(v, f"{path}{k}.", seen) for k, v in value.items()}
        return _Reads(children, path, seen)
    if isinstance(value, list):
        return [_recording(item, f"{path[:-1]}[].", seen) for item in value]
    return value


#: count_tokens converts a copy of its body with `max_tokens` and `stream` set, as /v1/messages
#: does (the copy is a plain dict, so its reads are recorded through prepare_messages).
_COUNT_TOKENS_SETS = frozenset({"max_tokens", "stream"})


def _fields_read(path: str) -> set[str]:
    if path == "/v1/messages/count_tokens":
        return _fields_read("/v1/messages") - _COUNT_TOKENS_SETS
    _, prepare, minimal = POST_APIS[path]
    seen: set[str] = set()
    for body in [minimal, *DEEP_BODIES.get(path, [])]:
        with contextlib.suppress(ApiError):  # the reads before a 400 count too
            prepare(_recording(copy.deepcopy(body), "", seen), _recipe())
    return seen


def _alternatives(schema: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The schema and every anyOf branch, resolved."""
    if "$ref" in schema:
        schema = _components()[schema["$ref"].split("/")[-1]]
    yield schema
    for branch in schema.get("anyOf", []):
        yield from _alternatives(branch)


def _described(schema: dict[str, Any], field_path: str) -> bool:
    """True when `field_path` (`a.b[].c`) names properties described in `schema`."""
    if not field_path:
        return True
    head, _, rest = field_path.partition(".")
    name, _, brackets = head.partition("[")
    for alternative in _alternatives(schema):
        child = alternative.get("properties", {}).get(name)
        if child is None:
            continue
        for _ in range(brackets.count("]")):
            child = next((a["items"] for a in _alternatives(child) if "items" in a), None)
            if child is None:
                break
        if child is not None and _described(child, rest):
            return True
    return False


@pytest.mark.parametrize("path", list(POST_APIS))
def test_every_field_the_protocol_layer_reads_is_described(path: str) -> None:
    component = _components()[POST_APIS[path][0]]
    read = _fields_read(path)
    assert "model" in read  # the recording works
    missing = sorted(field for field in read if not _described(component, field))
    assert missing == [], f"{path} reads fields its OpenAPI schema does not describe: {missing}"


def _typed_structs(path: str, monkeypatch: pytest.MonkeyPatch) -> set[type[msgspec.Struct]]:
    """The Structs `path`'s preparation reads its body as (msgspec reads the dict below
    Python, so the recording above does not see those fields)."""
    used: set[type[msgspec.Struct]] = set()
    real = read_body

    def recording(body: Any, struct: type[msgspec.Struct], **options: Any) -> Any:
        used.add(struct)
        return real(body, struct, **options)

    monkeypatch.setattr(sampling_module, "read_body", recording)
    _, prepare, minimal = POST_APIS[path]
    prepare(copy.deepcopy(minimal), _recipe())
    return used


def _struct_paths(struct: type[msgspec.Struct], prefix: str = "") -> Iterator[str]:
    """Every field of `struct` as a path (`stream_options.include_usage`), nested Structs too."""
    info = msgspec.inspect.type_info(struct)
    assert isinstance(info, msgspec.inspect.StructType)
    for field in info.fields:
        yield f"{prefix}{field.name}"
        kinds = (
            field.type.types if isinstance(field.type, msgspec.inspect.UnionType) else (field.type,)
        )
        for kind in kinds:
            if isinstance(kind, msgspec.inspect.StructType):
                yield from _struct_paths(kind.cls, f"{prefix}{field.name}.")


@pytest.mark.parametrize("path", list(POST_APIS))
def test_every_typed_body_field_is_described(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    component = _components()[POST_APIS[path][0]]
    structs = _typed_structs(path, monkeypatch)
    assert structs, f"{path}'s preparation reads no typed body"
    fields = {field for struct in structs for field in _struct_paths(struct)}
    missing = sorted(field for field in fields if not _described(component, field))
    assert missing == [], f"{path}'s typed body has fields its schema lacks: {missing}"


def _scalar(schema: dict[str, Any]) -> dict[str, Any] | None:
    """The one non-null alternative of a top-level property, if it has bounds, a const or an
    enum (a field that may also be an object or array is left to the other tests)."""
    branches = [a for a in _alternatives(schema) if "anyOf" not in a and a.get("type") != "null"]
    if len(branches) != 1:
        return None
    for alternative in branches:
        if any(k in alternative for k in ("minimum", "maximum", "exclusiveMinimum", "const")):
            return alternative
        if alternative.get("type") == "string" and "enum" in alternative:
            return alternative
    return None


def _bound_cases(schema: dict[str, Any]) -> Iterator[tuple[Any, bool]]:
    """(value, accepted?) at and just past each bound the schema states."""
    if schema.get("type") == "boolean":
        yield schema["const"], True
        yield not schema["const"], False
        yield "no", False  # a string is not a boolean
        return
    if "const" in schema:
        yield schema["const"], True
        yield schema["const"] + 1, False
        return
    if "enum" in schema:
        yield from ((value, True) for value in schema["enum"])
        yield "not-one-of-them", False
        return
    step = 1 if schema["type"] == "integer" else 0.5
    if "minimum" in schema:
        yield schema["minimum"], True
        yield schema["minimum"] - step, False
    if "exclusiveMinimum" in schema:
        yield schema["exclusiveMinimum"], False
        yield schema["exclusiveMinimum"] + 1e-6, True
    if "maximum" in schema:
        yield schema["maximum"], True
        yield schema["maximum"] + step, False


#: Cases where today's validation is known to disagree with the document (open bugs).
def _bound_params() -> Iterator[tuple[str, str, Any, bool]]:
    for path, (component, _, _) in POST_APIS.items():
        for name, schema in _components()[component]["properties"].items():
            scalar = _scalar(schema)
            if scalar is not None:
                for value, accepted in _bound_cases(scalar):
                    yield path, name, value, accepted


@pytest.mark.parametrize(("path", "field", "value", "accepted"), list(_bound_params()))
def test_each_documented_bound_is_where_the_validation_draws_it(
    path: str, field: str, value: Any, accepted: bool
) -> None:
    component, prepare, minimal = POST_APIS[path]
    body = {**copy.deepcopy(minimal), field: value}
    if field == "top_logprobs":
        body["logprobs"] = True
    assert not (isinstance(value, float) and math.isnan(value))
    prepared = copy.deepcopy(body)
    try:
        read_priority(prepared)  # the endpoint's, before every protocol's preparation
        prepare({k: v for k, v in prepared.items() if k != "priority"}, _recipe())
    except ContextLengthError:
        # In range for the field; the prompt plus max_tokens is another rule.
        assert accepted, f"{field}={value!r} passed the field's own check"
    except ApiError as exc:
        assert exc.status_code in (400, 404), exc
        assert not accepted, f"{field}={value!r} is documented as accepted: {exc.message}"
    else:
        assert accepted, f"{field}={value!r} is documented as a 400 but was accepted"
    valid = _validator(component).is_valid(body)
    assert valid == accepted, f"the document disagrees about {field}={value!r}"


@cache
def _validator(component: str) -> jsonschema.Draft202012Validator:
    schema = {**_components()[component], "components": {"schemas": _components()}}
    resolved = _resolve_refs(schema)
    return jsonschema.Draft202012Validator(resolved)


def _resolve_refs(value: Any) -> Any:
    if isinstance(value, dict):
        if "$ref" in value:
            return _resolve_refs(_components()[value["$ref"].split("/")[-1]])
        return {k: _resolve_refs(v) for k, v in value.items() if k != "components"}
    if isinstance(value, list):
        return [_resolve_refs(item) for item in value]
    return value
