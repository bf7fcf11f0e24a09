#!/usr/bin/env python3
"""The paced floor: the cheapest SSE server on our stack at a realistic decode cadence.

uvicorn + uvloop + httptools, and one ticker task that every `--tick-ms` writes one pre-built
OpenAI-shaped chat.completion.chunk to every open stream (each POST streams its body's
`max_tokens` chunks, then `data: [DONE]`). No parsing, no engine, no coordination, no task per
stream: what serving paced tokens costs the HTTP process at the least, the baseline of the
"realistic cadence" benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import uvicorn
from raw_asgi import CHUNK, START, requested_tokens

_DONE = b"data: [DONE]\n\n"
Send = Callable[[dict[str, Any]], Coroutine[Any, Any, None]]


class _Stream:
    def __init__(self, send: Send, tokens: int) -> None:
        self.send = send
        self.remaining = tokens
        self.done = asyncio.get_running_loop().create_future()


_WAITING: set[asyncio.Future[None]] = set()


def _drive(coroutine: Coroutine[Any, Any, None]) -> None:
    """Run an ASGI send to completion now if it does not wait (the usual case), else as a task."""
    try:
        waits_for = coroutine.send(None)
    except StopIteration:
        return
    task = asyncio.ensure_future(_finish(coroutine, waits_for))
    _WAITING.add(task)
    task.add_done_callback(_WAITING.discard)


async def _finish(coroutine: Coroutine[Any, Any, None], waits_for: Any) -> None:
    while True:
        await waits_for
        try:
            waits_for = coroutine.send(None)
        except StopIteration:
            return


class PacedApp:
    """The ASGI app: registers streams; the ticker writes to them."""

    def __init__(self, tick: float) -> None:
        self._tick = tick
        self._streams: set[_Stream] = set()
        self._ticker: asyncio.Task[None] | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Send) -> None:
        if scope["type"] != "http":
            return
        tokens = await requested_tokens(receive, 200)
        await send(START)
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._run())
        stream = _Stream(send, tokens)
        self._streams.add(stream)
        await stream.done

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_tick = loop.time()
        while True:
            next_tick += self._tick
            await asyncio.sleep(max(0.0, next_tick - loop.time()))
            for stream in list(self._streams):
                stream.remaining -= 1
                last = stream.remaining <= 0
                _drive(
                    stream.send(
                        {
                            "type": "http.response.body",
                            "body": CHUNK + _DONE if last else CHUNK,
                            "more_body": not last,
                        }
                    )
                )
                if last:
                    self._streams.discard(stream)
                    stream.done.set_result(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tick-ms", type=float, default=10.0)
    args = parser.parse_args()
    uvicorn.run(
        PacedApp(args.tick_ms / 1000),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http="httptools",
    )


if __name__ == "__main__":
    main()
