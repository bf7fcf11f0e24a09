"""The sampling-field declaration walked: every declared field reaches the engine's options (or
is refused beyond its neutral value) and the OpenAPI document of every protocol that takes it.

A field added to a protocol's sampling Struct without a `SamplingOptions` field, a protocol that
drops it on the way to the engine, or a body schema that misses it, fails here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import cache
from typing import Annotated, Any

import msgspec
import pytest

from deepinfer_server.api.route_table import ROUTES
from deepinfer_server.api.routes.openapi import openapi_document
from deepinfer_server.errors import BadRequestError, ErrorKind
from deepinfer_server.ipc.messages import SamplingOptions
from deepinfer_server.model.tokenizer import embedded_tokenizer_json
from deepinfer_server.openapi.fields import sampling_field
from deepinfer_server.protocol.chat.request import prepare_chat
from deepinfer_server.protocol.completions.request import prepare_completion
from deepinfer_server.protocol.core.recipe import RecipeContext
from deepinfer_server.protocol.core.sampling import (
    SAMPLING,
    SAMPLING_FIELDS,
    Api,
    SamplingField,
    sampling_fields_of,
)
from deepinfer_server.protocol.messages.request import prepare_messages
from deepinfer_server.protocol.responses.request import prepare_responses

MODEL = "flash"
_USER = [{"role": "user", "content": "Hello"}]

#: Per protocol: its preparation, a minimal valid body and its OpenAPI body component.
PROTOCOLS: dict[Api, tuple[Callable[[dict[str, Any], RecipeContext], Any], dict[str, Any], str]] = {
    Api.CHAT: (prepare_chat, {"model": MODEL, "messages": _USER}, "ChatCompletionRequest"),
    Api.COMPLETIONS: (prepare_completion, {"model": MODEL, "prompt": "Hi"}, "CompletionRequest"),
    Api.MESSAGES: (
        prepare_messages,
        {"model": MODEL, "max_tokens": 16, "messages": _USER},
        "MessagesRequest",
    ),
    Api.RESPONSES: (prepare_responses, {"model": MODEL, "input": "Hello"}, "ResponsesRequest"),
}


#: Fields that reach the engine only for a request that thinks (a reasoning budget), and what
#: makes each protocol's minimal body think (a raw prompt thinks when it ends in `<think>`).
_NEEDS_THINKING = frozenset({"thinking_token_budget"})
_THINKING: dict[Api, dict[str, Any]] = {
    Api.CHAT: {"thinking": {"type": "enabled"}},
    Api.RESPONSES: {"reasoning": {"effort": "high"}},
    Api.COMPLETIONS: {"prompt": "Hi<think>"},
}


@cache
def _recipe() -> RecipeContext:
    return RecipeContext.create(embedded_tokenizer_json(), (MODEL,), 4096, default_thinking=False)


def _first(prepared: Any) -> Any:
    """The first engine request of a preparation (chat and completions may make several)."""
    return prepared[0] if isinstance(prepared, list) else prepared


def _cases(neutral: bool) -> Iterator[Any]:
    for field in SAMPLING_FIELDS:
        if (field.neutral is not None) == neutral:
            for api in sorted(field.apis):
                yield pytest.param(field, api, id=f"{field.name}-{api}")


def test_every_protocol_is_walked() -> None:
    assert set(PROTOCOLS) == set(Api)
    assert all(field.apis for field in SAMPLING_FIELDS)


@pytest.mark.parametrize(("field", "api"), list(_cases(neutral=False)))
def test_each_tunable_field_reaches_the_engine(field: SamplingField, api: Api) -> None:
    prepare, minimal, _ = PROTOCOLS[api]
    assert field.option in SamplingOptions.__struct_fields__
    if field.name in _NEEDS_THINKING:
        minimal = {**minimal, **_THINKING[api]}
    if api in field.recipe_checked:
        # deepseek-recipe resolves it (V4.1's top_p is always 1.0): its value must be the engine's.
        prepared = _first(prepare({**minimal, field.name: field.maximum}, _recipe()))
        resolved = getattr(prepared.request.inference_options, field.option)
        assert resolved is not None
        assert getattr(prepared.sampling, field.option) == resolved
        return
    default = getattr(_first(prepare(dict(minimal), _recipe())).sampling, field.option)
    # Each bound is in range; one of them differs from what the engine gets without the field.
    for value in (field.minimum, field.maximum):
        sent = int(value) if field.kind is int else value
        expected = field.to_engine(float(sent) if field.kind is float else sent)
        if expected == default:
            continue
        sampling = _first(prepare({**minimal, field.name: sent}, _recipe())).sampling
        assert getattr(sampling, field.option) == expected, f"{field.name}={sent} in {api}"
        return
    pytest.fail(f"neither bound of {field.name} changes the engine's options")


@pytest.mark.parametrize(("field", "api"), list(_cases(neutral=True)))
def test_each_neutral_only_field_is_honoured_or_refused(field: SamplingField, api: Api) -> None:
    prepare, minimal, _ = PROTOCOLS[api]
    assert field.neutral is not None
    prepare({**minimal, field.name: field.neutral}, _recipe())
    with pytest.raises(BadRequestError) as refused:
        prepare({**minimal, field.name: field.neutral + 1}, _recipe())
    assert refused.value.param == field.name
    assert refused.value.kind is ErrorKind.UNSUPPORTED
    assert refused.value.message.startswith(f"'{field.name}' is not supported")


@pytest.mark.parametrize(("field", "api"), [*_cases(neutral=False), *_cases(neutral=True)])
def test_each_field_is_in_the_openapi_body_of_its_protocols(field: SamplingField, api: Api) -> None:
    component = _components()[PROTOCOLS[api][2]]
    assert component["properties"].get(field.name) == sampling_field(field, api)


def test_a_field_is_refused_with_its_own_messages() -> None:
    """The declaration keeps the messages the HTTP tests pin."""
    prepare, minimal, _ = PROTOCOLS[Api.COMPLETIONS]
    cases = {
        "temperature": (3, "'temperature' must be a number between 0 and 2"),
        "top_p": (0, "'top_p' must be a number between 1e-09 and 1"),
        "top_k": (-2, f"'top_k' must be -1 or 0 (disabled) or between 1 and {2**31 - 1}"),
        "min_tokens": ("1", "'min_tokens' must be a number"),
        "seed": (-1, f"'seed' must be between 0 and {2**63 - 1}"),
    }
    cases_of_type = {"top_k": 1.5, "seed": "1"}
    for name, value in cases_of_type.items():
        with pytest.raises(BadRequestError, match=f"^'{name}' must be an integer$"):
            prepare({**minimal, name: value}, _recipe())
    for name, (value, message) in cases.items():
        with pytest.raises(BadRequestError) as refused:
            prepare({**minimal, name: value}, _recipe())
        assert (refused.value.message, refused.value.param) == (message, name)


def test_top_k_zero_is_off_for_the_engine() -> None:
    prepare, minimal, _ = PROTOCOLS[Api.CHAT]
    assert _first(prepare({**minimal, "top_k": 0}, _recipe())).sampling.top_k == -1


@cache
def _components() -> dict[str, Any]:
    schemas: dict[str, Any] = openapi_document((MODEL,), ROUTES)["components"]["schemas"]
    return schemas


_PROBES: tuple[object, ...] = (None, True, "1", 1.5, -2, -1, 0, 0.0, 1, 2, 3, 2**31, 2**63, 2**64)


@pytest.mark.parametrize("api", list(Api))
def test_the_struct_accepts_and_refuses_as_each_field_declares(api: Api) -> None:
    """msgspec's conversion of the protocol's Struct (the fast path) reads what each field's
    own check reads, and refuses what it refuses, with the field's own 400."""
    protocol = SAMPLING[api]
    assert protocol.fields and {f.name for f in protocol.fields} == set(
        protocol.body.__struct_fields__
    )
    for field in protocol.fields:
        for value in _PROBES:
            body = {"model": MODEL, field.name: value}
            try:
                expected = {} if value is None else {field.option: field.check(value)}
            except BadRequestError as exc:
                if api in field.recipe_checked:  # deepseek-recipe's 400, later
                    assert protocol.read(body) == {}
                    continue
                with pytest.raises(BadRequestError) as refused:
                    protocol.read(body)
                assert (refused.value.message, refused.value.param) == (exc.message, field.name)
                continue
            if field.option is None or api in field.recipe_checked:
                expected = {}
            assert protocol.read(body) == expected, f"{field.name}={value!r} in {api}"


def test_a_struct_field_without_its_engine_mapping_is_refused_at_declaration() -> None:
    class Unmapped(msgspec.Struct, kw_only=True):
        top_a: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None

    with pytest.raises(TypeError, match="'top_a'"):
        sampling_fields_of(Unmapped, {"top_a": frozenset({Api.CHAT})})
