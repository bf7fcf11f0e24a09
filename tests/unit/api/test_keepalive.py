"""KeptAlive: a keep-alive is due after a quiet interval, never while a frame's send is
unfinished, and a frame written while a keep-alive's send is unfinished goes after it."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from deepinfer_server.api.keepalive import ANTHROPIC_PING, COMMENT, KeepAlive, KeptAlive

PING = b": keep-alive\n\n"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Sends:
    """A frame writer whose sends finish at once, or when `gate` is set (`held`)."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.held: set[bytes] = set()
        self.gate = asyncio.Event()
        self.written = asyncio.Event()

    def __call__(self, frame: bytes) -> Coroutine[Any, Any, None] | None:
        self.frames.append(frame)
        self.written.set()
        return self._wait() if frame in self.held else None

    async def _wait(self) -> None:
        await self.gate.wait()


def test_a_keepalive_is_due_after_a_quiet_interval_and_not_while_a_send_is_unfinished() -> None:
    async def body() -> None:
        clock, sends = Clock(), Sends()
        kept = KeptAlive(sends, PING, 15.0, clock)
        clock.now += 10
        assert kept.due_in() == 5.0
        assert kept.write(b"a") is None
        clock.now += 14
        assert kept.due_in() == 1.0  # the frame restarted the interval
        clock.now += 1
        assert kept.due_in() == 0.0
        sends.held.add(b"slow")
        waiting = kept.write(b"slow")
        assert waiting is not None
        clock.now += 60
        assert kept.due_in() == 15.0  # the client reads slowly: the stream is not quiet
        sends.gate.set()
        await waiting
        assert kept.due_in() == 0.0

    asyncio.run(body())


def test_a_frame_written_while_a_keepalive_is_sent_goes_after_it() -> None:
    async def body() -> None:
        sends = Sends()
        sends.held.add(PING)
        kept = KeptAlive(sends, PING, 0.001)
        pump = asyncio.create_task(kept.run())
        await sends.written.wait()
        waiting = kept.write(b"data")
        assert waiting is not None and sends.frames == [PING]
        sends.gate.set()
        await waiting
        pump.cancel()
        assert sends.frames[:2] == [PING, b"data"]

    asyncio.run(body())


def test_the_frame_follows_the_path_s_api() -> None:
    policy = KeepAlive(15.0, lambda scope: scope["path"].startswith("/v1/messages"))
    assert policy.frame({"path": "/v1/messages"}) == ANTHROPIC_PING
    assert policy.frame({"path": "/v1/responses"}) == COMMENT
