"""Hard reasoning budgets on the simulated engine, through the official clients and the real
protocol layer and engine driver, in process (the driver is the one that drives DeepInfer).

The simulated model echoes the last user turn: a turn "word word ... </think>answer" is a
reasoning of that many words, then the answer, so a budget has a long reasoning to cut.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import anthropic
import httpx
import httpx2
import pytest

from tests.http.engine_harness import MODEL, EngineHarness, SimulatedEngine, serve_engine
from tests.http.harness import run

REASONING = "step " * 200
ANSWER = "The answer is 42."
TURN = f"{REASONING}</think>{ANSWER}"


@pytest.fixture(scope="module")
def engine() -> Iterator[SimulatedEngine]:
    engine = SimulatedEngine.start()
    yield engine
    engine.close()


def _anthropic(h: EngineHarness) -> anthropic.AsyncAnthropic:
    app = cast(httpx.ASGITransport, h.client._transport).app  # the harness's app, in process
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app))
    return anthropic.AsyncAnthropic(
        base_url="http://test", api_key="unused", http_client=http, max_retries=0
    )


def _tokens(h: EngineHarness, text: str) -> int:
    return len(h.coordinator.recipe.decoder.encode(text, add_special_tokens=False).ids)


def _reasoning(h: EngineHarness, count: int) -> str:
    """The text of the first `count` reasoning tokens the simulated model says for TURN."""
    decoder = h.coordinator.recipe.decoder
    ids = decoder.encode(REASONING, add_special_tokens=False).ids
    assert len(ids) > count
    return str(decoder.decode(ids[:count]))


def test_a_messages_budget_caps_the_thinking_and_the_answer_follows(
    engine: SimulatedEngine,
) -> None:
    async def body() -> None:
        async with serve_engine(engine) as h:
            client = _anthropic(h)
            request: dict[str, Any] = {
                "model": MODEL,
                "max_tokens": 1024,
                "messages": [{"role": "user", "content": TURN}],
            }
            free = await client.messages.create(**request, thinking={"type": "adaptive"})
            assert free.content[0].thinking == REASONING  # type: ignore[union-attr]

            thinking: Any = {"type": "enabled", "budget_tokens": 64}
            message = await client.messages.create(**request, thinking=thinking)
            assert [block.type for block in message.content] == ["thinking", "text"]
            assert message.content[0].thinking == _reasoning(h, 64)  # type: ignore[union-attr]
            assert message.content[1].text == ANSWER  # type: ignore[union-attr]
            assert message.stop_reason == "end_turn"
            # 64 reasoning tokens, the forced </think> and the answer.
            assert message.usage.output_tokens == 64 + 1 + _tokens(h, ANSWER)

            async with client.messages.stream(**request, thinking=thinking) as stream:
                streamed = await stream.get_final_message()
            assert [block.type for block in streamed.content] == ["thinking", "text"]
            assert streamed.content[1].text == ANSWER  # type: ignore[union-attr]
            assert not h.coordinator.handles and not engine.driver.num_live

    run(body)


def test_the_budget_leaves_the_answer_half_of_max_tokens(engine: SimulatedEngine) -> None:
    """A budget at max_tokens would leave no answer: it is capped at half the limit."""

    async def body() -> None:
        async with serve_engine(engine) as h:
            message = await _anthropic(h).messages.create(
                model=MODEL,
                max_tokens=100,
                messages=[{"role": "user", "content": TURN}],
                thinking={"type": "enabled", "budget_tokens": 99},
            )
            assert message.content[0].thinking == _reasoning(h, 50)  # type: ignore[union-attr]
            assert message.content[1].text == ANSWER  # type: ignore[union-attr]

    run(body)


@pytest.mark.parametrize("budget", [0, 1, 7])
def test_chats_thinking_token_budget(engine: SimulatedEngine, budget: int) -> None:
    async def body() -> None:
        async with serve_engine(engine) as h:
            completion = await h.openai.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": TURN}],
                extra_body={"thinking_token_budget": budget},
            )
            message = completion.choices[0].message
            reasoning = getattr(message, "reasoning_content", None) or ""
            assert reasoning == _reasoning(h, budget)
            assert message.content == ANSWER
            assert completion.usage is not None
            assert completion.usage.completion_tokens == budget + 1 + _tokens(h, ANSWER)

    run(body)


def test_a_responses_budget_and_a_reasoning_that_ends_within_it(engine: SimulatedEngine) -> None:
    async def body() -> None:
        async with serve_engine(engine) as h:
            capped = await h.openai.responses.create(
                model=MODEL, input=TURN, store=False, extra_body={"thinking_token_budget": 16}
            )
            assert capped.output_text == ANSWER
            assert capped.usage is not None
            assert capped.usage.output_tokens_details.reasoning_tokens == 16
            # A reasoning shorter than the budget is left alone.
            short = await h.openai.responses.create(
                model=MODEL,
                input="few words</think>Done.",
                store=False,
                extra_body={"thinking_token_budget": 500},
            )
            assert short.output_text == "Done."

    run(body)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"thinking_token_budget": -1}, "thinking_token_budget"),
        ("/v1/chat/completions", {"thinking_token_budget": "64"}, "thinking_token_budget"),
        ("/v1/completions", {"thinking_token_budget": 1.5}, "thinking_token_budget"),
        ("/v1/responses", {"thinking_token_budget": True}, "thinking_token_budget"),
    ],
)
def test_a_bad_budget_is_a_400_naming_it(
    engine: SimulatedEngine, path: str, body: dict[str, Any], param: str
) -> None:
    base: dict[str, Any] = {"model": MODEL}
    if path == "/v1/chat/completions":
        base["messages"] = [{"role": "user", "content": "hi"}]
    elif path == "/v1/completions":
        base["prompt"] = "hi"
    else:
        base["input"] = "hi"

    async def go() -> None:
        async with serve_engine(engine) as h:
            response = await h.client.post(path, json={**base, **body})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == param

    run(go)


def test_a_bad_anthropic_budget_is_a_400_in_anthropics_shape(engine: SimulatedEngine) -> None:
    async def go() -> None:
        async with serve_engine(engine) as h:
            response = await h.client.post(
                "/v1/messages",
                json={
                    "model": MODEL,
                    "max_tokens": 64,
                    "messages": [{"role": "user", "content": "hi"}],
                    "thinking": {"type": "enabled", "budget_tokens": "many"},
                },
            )
            assert response.status_code == 400, response.text
            assert response.json()["type"] == "error"
            assert response.json()["error"]["type"] == "invalid_request_error"

    run(go)


def test_chats_thinking_object_takes_anthropics_budget_too(engine: SimulatedEngine) -> None:
    """Chat Completions' `thinking` (DeepSeek's, Anthropic-shaped) carries `budget_tokens`."""

    async def body() -> None:
        async with serve_engine(engine) as h:
            completion = await h.openai.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": TURN}],
                extra_body={"thinking": {"type": "enabled", "budget_tokens": 5}},
            )
            message = completion.choices[0].message
            assert getattr(message, "reasoning_content", None) == _reasoning(h, 5)
            assert message.content == ANSWER
            both = {"type": "enabled", "budget_tokens": 5}
            response = await h.client.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "hi"}],
                    "thinking": both,
                    "thinking_token_budget": 6,
                },
            )
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "thinking.budget_tokens"

    run(body)
