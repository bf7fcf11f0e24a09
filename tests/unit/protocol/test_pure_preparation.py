"""Preparation is a pure function of the client's body: every protocol's representative bodies
(images, n, tools, roles the recipe spells otherwise, priority...) come out of preparation
exactly as they went in, nested messages and items included."""

from __future__ import annotations

import base64
import copy
from collections.abc import Callable
from functools import cache
from typing import Any

import pytest

from deepinfer_server.errors import BadRequestError
from deepinfer_server.model.tokenizer import embedded_tokenizer_json
from deepinfer_server.protocol.chat.request import prepare_chat
from deepinfer_server.protocol.completions.request import prepare_completion
from deepinfer_server.protocol.core.body import MAX_TOP_LOGPROBS
from deepinfer_server.protocol.core.recipe import RecipeContext
from deepinfer_server.protocol.core.validation import read_priority
from deepinfer_server.protocol.messages.request import count_message_tokens, prepare_messages
from deepinfer_server.protocol.responses.request import prepare_responses
from deepinfer_server.protocol.tokenization.request import tokenize
from tests.e2e.test_images import png

MODEL = "flash"
_IMAGE = "data:image/png;base64," + base64.b64encode(png(40, 30)).decode()
_TOOL = {
    "type": "function",
    "function": {"name": "look", "parameters": {"type": "object", "properties": {}}},
}


@cache
def _recipe() -> RecipeContext:
    return RecipeContext.create(embedded_tokenizer_json(), (MODEL,), 8192, default_thinking=True)


_CHAT_PLAIN: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
_CHAT: dict[str, Any] = {
    "model": MODEL,
    "n": 2,
    "seed": 7,
    "priority": 3,
    "max_completion_tokens": 20,
    "tools": [_TOOL],
    "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _IMAGE}}]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                _CALL := {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "look", "arguments": "{}"},
                }
            ],
        },
        {"role": "assistant", "content": "Looking."},
        {"role": "tool", "tool_call_id": "c1", "content": "a square"},
        {"role": "user", "content": "And?"},
    ],
}
_COMPLETION: dict[str, Any] = {
    "model": MODEL,
    "prompt": ["one", "two"],
    "n": 2,
    "stop": "x",
    "priority": -1,
}
_MESSAGES: dict[str, Any] = {
    "model": MODEL,
    "max_tokens": 20,
    "priority": 1,
    "tools": [
        {"type": "custom", "name": "look", "input_schema": {"type": "object"}},
        {"type": "bash_20250124", "name": "bash"},
    ],
    "messages": [
        {
            "role": "user",
            "content": [
                {
                    "type": "image",
                    "source": {
                        "type": "base64",
                        "media_type": "image/png",
                        "data": _IMAGE.split(",", 1)[1],
                    },
                },
                {"type": "text", "text": "What is it?"},
            ],
        },
        {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]},
        {"role": "user", "content": "Well?"},
    ],
}
_RESPONSES: dict[str, Any] = {
    "model": MODEL,
    "priority": 2,
    "reasoning": {"effort": "high", "summary": "auto"},
    "include": ["message.output_text.logprobs"],
    "tools": [{"type": "function", "name": "look", "parameters": {"type": "object"}}],
    "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": _IMAGE}]},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "hm"}],
        },
        {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "a square"},
    ],
}
_TOKENIZE: dict[str, Any] = {
    "model": MODEL,
    "continue_final_message": True,
    "add_generation_prompt": False,
    "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hel"},
    ],
}

Prepare = Callable[[dict[str, Any], RecipeContext], object]
_CASES: list[tuple[str, Prepare, dict[str, Any]]] = [
    ("chat", prepare_chat, _CHAT),
    ("completions", prepare_completion, _COMPLETION),
    ("messages", prepare_messages, _MESSAGES),
    ("count_tokens", count_message_tokens, {**_MESSAGES, "max_tokens": None}),
    ("responses", prepare_responses, _RESPONSES),
    ("tokenize", tokenize, _TOKENIZE),
]


@pytest.mark.parametrize(("name", "prepare", "body"), _CASES, ids=[c[0] for c in _CASES])
def test_preparation_leaves_the_body_as_sent(
    name: str, prepare: Prepare, body: dict[str, Any]
) -> None:
    sent = copy.deepcopy(body)
    prepared = copy.deepcopy(body)
    read_priority(prepared)
    assert prepared == sent, "read_priority changed the body"
    given = {key: value for key, value in prepared.items() if key != "priority"}
    assert prepare(given, _recipe()) is not None
    assert prepared == sent, f"preparing a {name} body changed it"


def test_each_chat_preparation_gets_the_whole_body() -> None:
    """The same body prepared twice (as after fetching its images) gives the same choices."""
    body = {k: v for k, v in copy.deepcopy(_CHAT).items() if k != "priority"}
    first, second = prepare_chat(body, _recipe()), prepare_chat(body, _recipe())
    assert isinstance(first, list) and isinstance(second, list)
    assert [c.index for c in first] == [c.index for c in second] == [0, 1]
    assert [c.sampling.seed for c in first] == [c.sampling.seed for c in second]


@pytest.mark.parametrize(
    ("prepare", "body"),
    [(prepare_chat, _CHAT_PLAIN), (prepare_completion, _COMPLETION)],
    ids=["chat", "completions"],
)
def test_one_seed_bound_for_every_protocol(prepare: Prepare, body: dict[str, Any]) -> None:
    """The engine masks a seed to 64 bits and the recipe takes [0, 2**63): both protocols
    take 2**63 - 1 and refuse 2**63 in the same words."""
    plain = {k: v for k, v in body.items() if k not in ("priority", "n")}
    assert prepare({**plain, "seed": 2**63 - 1}, _recipe()) is not None
    for seed in (2**63, 2**64):
        with pytest.raises(BadRequestError) as refused:
            prepare({**plain, "seed": seed}, _recipe())
        assert refused.value.param == "seed"
        assert refused.value.message == f"'seed' must be between 0 and {2**63 - 1}"


@pytest.mark.parametrize(
    ("prepare", "field", "extra"),
    [(prepare_chat, "top_logprobs", {"logprobs": True}), (prepare_completion, "logprobs", {})],
    ids=["chat", "completions"],
)
def test_one_top_logprobs_bound(prepare: Prepare, field: str, extra: dict[str, Any]) -> None:
    body = _CHAT_PLAIN if prepare is prepare_chat else {"model": MODEL, "prompt": "one"}
    assert prepare({**body, **extra, field: MAX_TOP_LOGPROBS}, _recipe()) is not None
    with pytest.raises(BadRequestError) as refused:
        prepare({**body, **extra, field: MAX_TOP_LOGPROBS + 1}, _recipe())
    assert refused.value.param == field
    assert refused.value.message == f"'{field}' must be between 0 and {MAX_TOP_LOGPROBS}"
