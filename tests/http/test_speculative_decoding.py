"""Speculation changes speed, never content: the same requests through the official openai
client get the same answers from a simulated engine verifying 3 drafts a step as from one
without drafts, a stop string, max_tokens, EOS and a JSON schema included."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.http.engine_harness import MODEL, SimulatedEngine, serve_engine
from tests.http.harness import run
from tests.lanes import require_grammar

NO_THINKING: dict[str, Any] = {"thinking": {"type": "disabled"}}
TEXT = "Speculative decoding drafts several tokens and the model verifies them in one step."
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "count": {"type": "integer"}},
    "required": ["answer", "count"],
    "additionalProperties": False,
}

#: (case, extra create() arguments): each ends differently, and inside a multi-token step.
CASES: dict[str, dict[str, Any]] = {
    "eos": {},
    "max_tokens": {"max_tokens": 7},
    "stop_string": {"stop": ["verifies"]},
    "thinking": {"extra_body": {}},
    "json_schema": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
        }
    },
}


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[SimulatedEngine, SimulatedEngine]]:
    plain = SimulatedEngine.start()
    speculative = SimulatedEngine.start(speculative_tokens=3, structured=plain.structured)
    yield plain, speculative
    speculative.close()
    plain.close()


async def _answer(engine: SimulatedEngine, extra: dict[str, Any], stream: bool) -> Any:
    arguments = {"extra_body": NO_THINKING, **extra}
    async with serve_engine(engine) as harness:
        if not stream:
            response = await harness.openai.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": TEXT}], **arguments
            )
            choice = response.choices[0]
            message = choice.message
            reasoning = getattr(message, "reasoning_content", None)
            return message.content, reasoning, choice.finish_reason, response.usage
        chunks = await harness.openai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": TEXT}],
            stream=True,
            stream_options={"include_usage": True},
            **arguments,
        )
        text, finish, usage = [], None, None
        async for chunk in chunks:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                text.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        return "".join(text), finish, usage


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=pytest.mark.grammar) if c == "json_schema" else c for c in CASES],
)
def test_speculation_gives_the_same_answer(
    engines: tuple[SimulatedEngine, SimulatedEngine], case: str, stream: bool
) -> None:
    if case == "json_schema":
        require_grammar()
    plain, speculative = engines

    async def body() -> None:
        expected = await _answer(plain, CASES[case], stream)
        assert await _answer(speculative, CASES[case], stream) == expected
        if case == "json_schema":
            assert set(json.loads(expected[0])) == {"answer", "count"}
        if case == "stop_string":
            assert expected[0] is not None and "verifies" not in expected[0]

    run(body, timeout=120)


def test_the_speculative_engine_verified_drafts(
    engines: tuple[SimulatedEngine, SimulatedEngine],
) -> None:
    """The comparison above is not vacuous: the second engine did emit drafts."""
    _, speculative = engines

    async def body() -> None:
        await _answer(speculative, {"max_tokens": 20}, stream=False)

    run(body, timeout=60)
    counters = speculative.driver.counters()
    assert counters is not None and counters.spec_accepted_tokens > 0
