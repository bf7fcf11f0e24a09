"""An agent's second turn against the real simulated engine with its prefix cache, in process:
the official openai client reads at least 90% of the first turn's prompt as cached, with and
without thinking (which drops the first prompt's last token), and the engine's counters move."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.http.engine_harness import MODEL, SimulatedEngine, serve_engine
from tests.http.harness import run

SYSTEM = " ".join(f"Rule {n}: keep the answer short and check the tests." for n in range(120))


@pytest.fixture(scope="module")
def engine() -> Iterator[SimulatedEngine]:
    built = SimulatedEngine.start(enable_prefix_caching=True)
    yield built
    built.close()


@pytest.mark.parametrize("thinking", ["enabled", "disabled"])
def test_a_second_turn_reads_the_first_turns_prompt_as_cached(
    engine: SimulatedEngine, thinking: str
) -> None:
    async def body() -> None:
        async with serve_engine(engine) as harness:
            extra = {"thinking": {"type": thinking}}
            first: list[Any] = [
                {"role": "system", "content": f"{thinking}: {SYSTEM}"},
                {"role": "user", "content": "Hello there."},
            ]
            queries, hits, _ = engine.driver._engine.prefix_cache_stats()  # type: ignore[attr-defined]
            one = await harness.openai.chat.completions.create(
                model=MODEL, messages=first, extra_body=extra
            )
            assert one.usage is not None and one.usage.prompt_tokens_details is not None
            assert one.usage.prompt_tokens_details.cached_tokens == 0
            second = [
                *first,
                {"role": "assistant", "content": one.choices[0].message.content},
                {"role": "user", "content": "Now run the tests, please."},
            ]
            stream = await harness.openai.chat.completions.create(
                model=MODEL,
                messages=second,
                extra_body=extra,
                stream=True,
                stream_options={"include_usage": True},
            )
            usage = [chunk async for chunk in stream][-1].usage
            assert usage is not None and usage.prompt_tokens_details is not None
            cached = usage.prompt_tokens_details.cached_tokens
            prompt = one.usage.prompt_tokens
            assert cached >= 0.9 * prompt
            assert cached == (prompt - 1 if thinking == "enabled" else prompt)
            stats = engine.driver._engine.prefix_cache_stats()  # type: ignore[attr-defined]
            assert stats[0] - queries == prompt + usage.prompt_tokens
            assert stats[1] - hits == cached

    run(body)
