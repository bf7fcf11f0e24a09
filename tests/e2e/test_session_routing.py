"""Session-affine routing end to end on the shared DP=2 server: the turns of a session named by
`prompt_cache_key` (the openai client's own parameter) or by the `x-claude-code-session-id`
header go to the rank of its first turn while the other rank is less loaded, with prompts that
share no prefix to route by; `deepinfer:dp_routing_total` says which rank and why."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai

from tests.conftest import ENDLESS, MODEL, NO_THINKING
from tests.metrics_scrape import scrape, value
from tests.server import LiveServer, wait_until

ROUTED = "deepinfer:dp_routing_total"


def _routed(server: LiveServer) -> dict[tuple[str, str], float]:
    samples = scrape(server.base_url)
    return {
        (reason, rank): value(samples, ROUTED, reason=reason, dp_rank=rank)
        for reason in ("session", "prefix", "load")
        for rank in ("0", "1")
    }


def _load(server: LiveServer) -> int:
    load: int = httpx.get(f"{server.base_url}/get_load", timeout=30).json()["load"]
    return load


@contextmanager
def _holding_a_rank(server: LiveServer) -> Iterator[None]:
    """A long streamed request runs (on rank 0 of an idle server) until the block ends."""
    wait_until(lambda: _load(server) == 0, 20, "the server is idle")
    body = {**ENDLESS, "stream": True}
    with httpx.stream(
        "POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=30
    ) as held:
        lines = held.iter_lines()  # kept: a discarded iterator would close the stream
        next(lines)
        yield
    wait_until(lambda: _load(server) == 0, 20, "the held request no longer counts")


def test_a_sessions_turns_stay_on_the_rank_of_its_first(
    shared_server: LiveServer, client: openai.OpenAI
) -> None:
    key = f"session-{uuid.uuid4().hex}"

    def turn(text: str) -> None:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": text}],
            max_tokens=4,
            prompt_cache_key=key,
            extra_body=NO_THINKING,
        )

    wait_until(lambda: _load(shared_server) == 0, 20, "the server is idle")
    before = _routed(shared_server)
    turn("First turn.")  # an idle server: rank 0, by load
    with _holding_a_rank(shared_server):  # rank 0 runs one request, rank 1 none
        turn("A second turn that shares no prefix with the first.")
        turn("And a third.")
    after = _routed(shared_server)
    assert after[("session", "0")] - before[("session", "0")] == 2
    assert after[("load", "0")] - before[("load", "0")] == 2  # the first turn and the held one
    assert after[("session", "1")] == before[("session", "1")]


def test_claude_codes_session_header_names_a_session(shared_server: LiveServer) -> None:
    headers = {"x-claude-code-session-id": str(uuid.uuid4()), "anthropic-version": "2023-06-01"}

    def turn(text: str) -> None:
        body = {
            "model": MODEL,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": text}],
            **NO_THINKING,
        }
        answer = httpx.post(
            f"{shared_server.base_url}/v1/messages", json=body, headers=headers, timeout=30
        )
        assert answer.status_code == 200, answer.text

    wait_until(lambda: _load(shared_server) == 0, 20, "the server is idle")
    before = _routed(shared_server)
    turn("First turn.")
    with _holding_a_rank(shared_server):
        turn("Second turn.")
    after = _routed(shared_server)
    assert after[("session", "0")] - before[("session", "0")] == 1
    assert after[("session", "1")] == before[("session", "1")]
