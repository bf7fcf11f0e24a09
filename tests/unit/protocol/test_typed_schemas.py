"""Every typed body field is described in the OpenAPI document once, as its declaration says:
its schema is the one generated from the Struct, never a hand-written second description."""

from __future__ import annotations

import msgspec
import pytest

from deepinfer_server.openapi.fields import TYPED_DESCRIPTIONS
from deepinfer_server.openapi.requests import REQUEST_BODIES
from deepinfer_server.openapi.typed_fields import typed_fields
from deepinfer_server.protocol.chat.request import ChatBody
from deepinfer_server.protocol.completions.request import CompletionBody
from deepinfer_server.protocol.core.body import MAX_TOP_LOGPROBS
from deepinfer_server.protocol.core.sampling import SEED_MAX, Api
from deepinfer_server.protocol.messages.request import MessagesBody
from deepinfer_server.protocol.responses.request import ResponsesBody

_TYPED: list[tuple[str, type[msgspec.Struct], Api]] = [
    ("ChatCompletionRequest", ChatBody, Api.CHAT),
    ("CompletionRequest", CompletionBody, Api.COMPLETIONS),
    ("MessagesRequest", MessagesBody, Api.MESSAGES),
    ("CountTokensRequest", MessagesBody, Api.MESSAGES),
    ("ResponsesRequest", ResponsesBody, Api.RESPONSES),
]


@pytest.mark.parametrize(("component", "struct", "api"), _TYPED)
def test_typed_fields_are_described_from_their_declarations(
    component: str, struct: type[msgspec.Struct], api: Api
) -> None:
    documented = REQUEST_BODIES[component]["properties"]
    generated = typed_fields(struct, api, described=TYPED_DESCRIPTIONS)
    for name in struct.__struct_fields__:
        if name in ("max_tokens", "max_completion_tokens") and api is Api.CHAT:
            continue  # deepseek-recipe's narrower bound, documented as the recipe's
        assert _described_as(documented[name]) == _described_as(generated[name]), name


def _described_as(schema: dict[str, object]) -> dict[str, object]:
    """The schema less its top-level description (a protocol may word a field its own way)."""
    return {key: value for key, value in schema.items() if key != "description"}


def _bounds(schema: dict[str, object]) -> tuple[object, object]:
    options = schema.get("anyOf", [schema])
    assert isinstance(options, list)
    return options[0]["minimum"], options[0]["maximum"]


def test_one_bound_per_field_in_the_document() -> None:
    chat = REQUEST_BODIES["ChatCompletionRequest"]["properties"]
    completions = REQUEST_BODIES["CompletionRequest"]["properties"]
    assert _bounds(chat["seed"]) == _bounds(completions["seed"]) == (0, SEED_MAX)
    assert _bounds(chat["top_logprobs"]) == (0, MAX_TOP_LOGPROBS)
    assert _bounds(completions["logprobs"]) == (0, MAX_TOP_LOGPROBS)
