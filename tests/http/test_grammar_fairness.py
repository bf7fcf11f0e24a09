"""Grammar compilation is fair between API keys, through the official openai
client and the real protocol layer, with real compile worker processes.

One key flooding distinct runaway regexes (`\\w{1,5}-` repeated: tens of seconds and gigabytes
each) used to leave every other key's structured output waiting behind its whole backlog (a
trivial schema had no answer after 420 s). Now the keys take the workers in turn, and a key
already compiling never takes the last free worker: the other key's schema starts at once, not
behind the compiles already running; the flooding key gets a 429 with
Retry-After past its bound of queued compiles, and a 400 naming the field for each regex that
outran the compile time bound.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from deepinfer_server.grammar.compile_queue import QueueLimits
from deepinfer_server.model.tokenizer import embedded_tokenizer_json
from deepinfer_server.protocol.core.structured_outputs import StructuredOutputs
from tests.http.harness import MODEL, Harness, run, serve
from tests.lanes import require_grammar

require_grammar()

#: Real compile worker processes, killed at their time bound.
pytestmark = [pytest.mark.e2e, pytest.mark.grammar]

FLOODER, VICTIM = "key-flooder-1", "key-victim-2"
#: 8 KB of bounded repeats: 26 s and 2.2 GB to compile, so each is cut at the time bound.
RUNAWAY = "\\w{1,5}-" * 700
PER_KEY = 2


@pytest.fixture
def structured(monkeypatch: pytest.MonkeyPatch) -> Iterator[StructuredOutputs]:
    # DEEPINFER_XGRAMMAR_TIMEOUT 4: a compile is killed after 2 s (10 s by default).
    monkeypatch.setenv("DEEPINFER_XGRAMMAR_TIMEOUT", "4")
    outputs = StructuredOutputs(embedded_tokenizer_json(), limits=QueueLimits(PER_KEY, 60.0))
    assert asyncio.run(outputs.wait_ready())  # as a server has once its warm-up ended
    yield outputs
    outputs.close()


async def _chat(client: openai.AsyncOpenAI, extra_body: Any = None, **extra: Any) -> Any:
    return await client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=16,
        extra_body={"thinking": {"type": "disabled"}, **(extra_body or {})},
        **extra,
    )


async def _flood(client: openai.AsyncOpenAI, index: int) -> openai.APIStatusError | None:
    try:
        await _chat(client, extra_body={"structured_outputs": {"regex": RUNAWAY + f"x{index}"}})
    except openai.APIStatusError as exc:
        return exc
    return None


async def _queued(h: Harness, count: int) -> None:
    """Until `count` compiles are queued or running (checked once per loop turn)."""
    while True:
        stats = h.state.structured.queue_stats()
        if stats is not None and stats.waiting + stats.running >= count:
            return
        await asyncio.sleep(0.01)


def test_another_keys_schema_is_answered_while_one_key_floods_runaway_regexes(
    structured: StructuredOutputs,
) -> None:
    async def body() -> None:
        async with serve("--api-key", FLOODER, "--api-key", VICTIM, structured=structured) as h:
            flooder = h.openai(FLOODER)
            flood = [asyncio.ensure_future(_flood(flooder, i)) for i in range(24)]
            await _queued(h, PER_KEY)
            sent = time.monotonic()
            schema = {"name": "any", "schema": {"type": "object"}}
            answer = await _chat(
                h.openai(VICTIM), response_format={"type": "json_schema", "json_schema": schema}
            )
            waited = time.monotonic() - sent
            assert answer.status_code == 200
            # The flood's first compiles run on two of the three workers for 2 s each, until
            # the time bound cuts them; the victim took the third at once, so none of them
            # had ended yet (a 400) when it was answered.
            cut = [f for f in flood if f.done() and (e := f.result()) and e.status_code == 400]
            assert not cut, f"the other key's schema waited {waited:.1f} s, behind the flood"
            assert waited < 15, f"the other key's schema waited {waited:.1f} s"
            refused = [r for r in await asyncio.gather(*flood) if r is not None]
            assert len(refused) == 24
            too_many = [e for e in refused if e.status_code == 429]
            # A key whose compile ends frees its place: a late flood request may take it.
            assert len(too_many) >= 24 - 2 * PER_KEY, [e.status_code for e in refused]
            assert all(e.response.headers.get("retry-after") == "2" for e in too_many)
            assert "grammars compiling or waiting" in too_many[0].message
            timed_out = [e for e in refused if e.status_code == 400]
            assert timed_out, [e.status_code for e in refused]
            for error in timed_out:
                assert isinstance(error.body, dict)
                assert error.body.get("param") == "structured_outputs.regex", error.body
            assert {e.status_code for e in refused} <= {400, 429}

    run(body, timeout=150)
