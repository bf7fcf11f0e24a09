"""RequestHandle's one timer: the queue deadline first (no first token by then: 429
queue_timeout, the engine request aborted), then the request deadline."""

from __future__ import annotations

import asyncio

import pytest

from deepinfer_server.coordinator.handle import RequestHandle
from deepinfer_server.errors import QueueTimeoutError, RequestTimeoutError
from deepinfer_server.ipc.messages import AbortReason, GeneratedTokens

Closed = list[tuple[bool, AbortReason]]


def _handle(closed: Closed, queue_in: float, end_in: float) -> RequestHandle:
    now = asyncio.get_running_loop().time()
    return RequestHandle(
        "r",
        0,
        lambda _, aborted, reason: closed.append((aborted, reason)),
        now + end_in,
        queue_deadline=now + queue_in,
    )


def test_no_first_token_by_the_queue_deadline_is_a_queue_timeout() -> None:
    async def body() -> Closed:
        closed: Closed = []
        handle = _handle(closed, queue_in=0.01, end_in=60)
        with pytest.raises(QueueTimeoutError) as raised:
            await handle.next_batch()
        assert raised.value.status_code == 429 and raised.value.code == "queue_timeout"
        assert raised.value.headers()["Retry-After"]
        return closed

    assert asyncio.run(body()) == [(True, AbortReason.TIMEOUT)]


def test_a_request_that_started_in_time_runs_on_to_its_request_deadline() -> None:
    async def body() -> Closed:
        closed: Closed = []
        handle = _handle(closed, queue_in=0.01, end_in=0.05)
        handle.deliver(GeneratedTokens([7]), None, 0.0, 0.0)
        assert (await handle.next_batch()).tokens.token_ids == [7]
        # The queue deadline passes without effect; the request deadline still ends it.
        with pytest.raises(RequestTimeoutError):
            await handle.next_batch()
        return closed

    assert asyncio.run(body()) == [(True, AbortReason.TIMEOUT)]
