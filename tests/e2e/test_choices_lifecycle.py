"""n > 1 end to end: admission takes n slots, and a disconnect aborts every choice."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import ENDLESS
from tests.server import LiveServer
from tests.sse import sse_events


@pytest.fixture(scope="module")
def two_slot_server() -> Iterator[LiveServer]:
    """One rank, two running sequences, no queue: capacity 2, slow steps."""
    with LiveServer(
        "--max-num-seqs", "2", "--max-queued-requests", "0",
        "--sim-itl-ms", "20", "--sim-ttft-ms", "5", "--max-model-len", "8192",
    ) as server:  # fmt: skip
        yield server


def test_n_beyond_capacity_is_400_and_beyond_the_free_slots_429(
    two_slot_server: LiveServer,
) -> None:
    url = two_slot_server.base_url + "/v1/chat/completions"
    # More choices than the server ever admits: no retry could succeed, so not a 429.
    never = httpx.post(url, json={**ENDLESS, "max_tokens": 3, "n": 3}, timeout=30)
    assert never.status_code == 400, never.text
    assert never.json()["error"]["param"] == "n"
    with httpx.stream("POST", url, json={**ENDLESS, "stream": True}, timeout=30) as held:
        events = sse_events(held)  # kept: closing the generator would close the stream
        next(events)
        # One slot is taken: the first choice is admitted, the second refused, so the first
        # is released again.
        busy = httpx.post(url, json={**ENDLESS, "max_tokens": 3, "n": 2}, timeout=30)
        assert busy.status_code == 429, busy.text
        assert int(busy.headers["retry-after"]) >= 1
    # The held stream's slot and the one the refused request took are free again.
    accepted = httpx.post(url, json={**ENDLESS, "max_tokens": 3, "n": 2}, timeout=30)
    assert accepted.status_code == 200, accepted.text


def test_stream_disconnect_aborts_every_choice(two_slot_server: LiveServer) -> None:
    url = two_slot_server.base_url + "/v1/chat/completions"
    with httpx.stream("POST", url, json={**ENDLESS, "n": 2, "stream": True}, timeout=30) as stream:
        events = sse_events(stream)
        next(events)
        next(events)
    # Both endless choices (a minute each) must be gone: the two slots run this one.
    follow_up = httpx.post(url, json={**ENDLESS, "max_tokens": 3, "n": 2}, timeout=20)
    assert follow_up.status_code == 200, follow_up.text
    assert follow_up.json()["usage"]["completion_tokens"] == 6
