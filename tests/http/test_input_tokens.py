"""`POST /v1/responses/input_tokens` through openai-python's `responses.input_tokens.count`: the
prompt tokens of the same Responses request (its `usage.input_tokens`), for plain input, tools
and instructions, a conversation continued from the store; nothing runs and nothing is
stored; errors in OpenAI's envelope."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.http.harness import MODEL, Harness, run, serve
from tests.http.test_stored_responses import run_stored

TOOLS: Any = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
BODIES: list[Any] = [
    {"input": "hello"},
    {"input": [{"role": "user", "content": "hello"}], "instructions": "Be terse.", "tools": TOOLS},
    {"input": "hello", "reasoning": {"effort": "high"}},
]


async def _counts_as_run(client: openai.AsyncOpenAI, body: Any) -> int:
    counted = await client.responses.input_tokens.count(**body)
    assert counted.object == "response.input_tokens"
    answered = await client.responses.create(**{"model": MODEL, **body})
    assert answered.usage is not None
    assert counted.input_tokens == answered.usage.input_tokens
    return counted.input_tokens


@pytest.mark.parametrize("body", BODIES)
def test_the_count_is_the_input_tokens_of_the_same_request(body: Any) -> None:
    async def test() -> None:
        async with serve() as h, h.openai() as client:
            await _counts_as_run(client, {**body, "model": MODEL})
            # `model` is optional in a count; nothing ran for either count.
            assert (await client.responses.input_tokens.count(**body)).input_tokens > 0
            assert len(h.coordinator.submitted) == 1

    run(test)


def test_a_stored_conversation_is_counted_whole_and_nothing_is_stored(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        async with h.openai() as client:
            first = await client.responses.create(model=MODEL, input="My name is Ada.")
            follow = {"input": "What is my name?", "previous_response_id": first.id}
            alone = await client.responses.input_tokens.count(model=MODEL, input=follow["input"])
            whole = await _counts_as_run(client, follow)
            assert whole > alone.input_tokens
            # A count keeps nothing, even asked to (`store`, `background`).
            counted = await h.client.post(
                "/v1/responses/input_tokens",
                json={"input": "hi", "store": True, "stream": True, "background": True},
            )
            assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
            assert _stored_responses(tmp_path) == 2  # the two created, no count

    run_stored(tmp_path, test)


def _stored_responses(tmp_path: Path) -> int:
    with sqlite3.connect(tmp_path / "responses.sqlite3") as db:
        (count,) = db.execute("SELECT COUNT(*) FROM responses").fetchone()
    return int(count)


def test_refusals_take_openais_envelope() -> None:
    async def test() -> None:
        async with serve() as h, h.openai() as client:
            with pytest.raises(openai.NotFoundError, match="does not exist"):
                await client.responses.input_tokens.count(model="other", input="hi")
            with pytest.raises(openai.BadRequestError, match="previous_response_id"):
                await client.responses.input_tokens.count(input="hi", previous_response_id="r")
            assert h.coordinator.submitted == []

    run(test)
