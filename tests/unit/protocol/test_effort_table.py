"""The one effort table (protocol/core/effort.py): every value of every API reaches the prompt
the engine gets as the table says, through the real deepseek-recipe, in process."""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cache
from typing import Any

import pytest

from deepinfer_server.errors import BadRequestError
from deepinfer_server.model.tokenizer import embedded_tokenizer_json
from deepinfer_server.protocol.chat.request import PreparedChat, prepare_chat
from deepinfer_server.protocol.core.effort import DEFAULT_EFFORT_PROMPT, EFFORT_PROMPT
from deepinfer_server.protocol.core.recipe import RecipeContext
from deepinfer_server.protocol.messages.request import prepare_messages
from deepinfer_server.protocol.responses.request import prepare_responses

_EFFORT_LINE = re.compile(r"Reasoning Effort: (\d+) \(range 1-100")


@cache
def recipe() -> RecipeContext:
    return RecipeContext.create(embedded_tokenizer_json(), ("flash",), 4096, default_thinking=True)


def _chat(effort: str | None) -> list[int]:
    body: dict[str, Any] = {"model": "flash", "messages": [{"role": "user", "content": "hi"}]}
    if effort is not None:
        body["reasoning_effort"] = effort
    prepared = prepare_chat(body, recipe())
    assert isinstance(prepared, PreparedChat)
    return prepared.prompt_token_ids


def _responses(effort: str | None) -> list[int]:
    body: dict[str, Any] = {"model": "flash", "input": "hi"}
    if effort is not None:
        body["reasoning"] = {"effort": effort}
    return prepare_responses(body, recipe()).prompt_token_ids


def _messages(effort: str | None) -> list[int]:
    """Anthropic thinks only when asked: `adaptive` with the effort, `none` as thinking off."""
    body: dict[str, Any] = {
        "model": "flash",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}],
    }
    if effort != "none":
        body["thinking"] = {"type": "adaptive"}
    if effort is not None:
        body["output_config"] = {"effort": effort}
    return prepare_messages(body, recipe()).prompt_token_ids


API: dict[str, tuple[Callable[[str | None], list[int]], str]] = {
    "chat": (_chat, "reasoning_effort"),
    "responses": (_responses, "reasoning.effort"),
    "messages": (_messages, "output_config.effort"),
}


def _rendered_effort(prompt_token_ids: list[int]) -> int | None:
    """The `Reasoning Effort: N` of the prompt, None when the prompt is the non-thinking one."""
    text = recipe().decoder.decode(prompt_token_ids, skip_special_tokens=False)
    found = _EFFORT_LINE.search(text)
    if found is None:
        assert text.endswith("<｜Assistant｜></think>"), text
        return None
    assert text.endswith("<｜Assistant｜><think>"), text
    return int(found.group(1))


@pytest.mark.parametrize("effort", list(EFFORT_PROMPT))
@pytest.mark.parametrize("api", list(API))
def test_each_effort_of_each_api_renders_the_tables_prompt(api: str, effort: str) -> None:
    prepare, _ = API[api]
    assert _rendered_effort(prepare(effort)) == EFFORT_PROMPT[effort]


@pytest.mark.parametrize("api", list(API))
def test_no_effort_renders_the_default(api: str) -> None:
    prepare, _ = API[api]
    assert _rendered_effort(prepare(None)) == DEFAULT_EFFORT_PROMPT


@pytest.mark.parametrize("value", ["extreme", "HIGH", 3, ""])
@pytest.mark.parametrize("api", list(API))
def test_an_unknown_effort_is_a_400_naming_the_param(api: str, value: object) -> None:
    prepare, param = API[api]
    with pytest.raises(BadRequestError) as raised:
        prepare(value)  # type: ignore[arg-type]
    assert raised.value.param == param


@pytest.mark.parametrize(
    ("thinking", "effort"),
    [({"type": "disabled"}, "low"), ({"type": "disabled"}, "max"), ({"type": "enabled"}, "none")],
)
def test_an_effort_contradicting_chats_thinking_is_a_400(
    thinking: dict[str, str], effort: str
) -> None:
    """The recipe would let `thinking` win and drop the effort unseen."""
    body = {
        "model": "flash",
        "messages": [{"role": "user", "content": "hi"}],
        "thinking": thinking,
        "reasoning_effort": effort,
    }
    with pytest.raises(BadRequestError) as raised:
        prepare_chat(body, recipe())
    assert raised.value.param == "reasoning_effort"
