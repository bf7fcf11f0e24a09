"""Keep-alives on a stream that has nothing to send yet.

A streamed request sends its first event only once the engine has taken it: while it waits in
the queue or its prompt prefills, the connection carries nothing, and a proxy's idle timeout
(often 60 s) may close it. `KeptAlive` wraps a stream's frame writer and, whenever the stream
has written nothing for `--sse-keepalive-seconds`, writes a frame every client skips:
Anthropic's own `ping` event on the paths Anthropic's clients speak (its SDKs drop it), an SSE
comment elsewhere (every SSE parser drops it). Once tokens flow, frames keep the connection busy
and no keep-alive goes out.

Frames never interleave: a keep-alive is written only while no frame's send is unfinished, and a
frame written while a keep-alive's send is unfinished waits for it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from starlette.types import Scope

#: An SSE comment: a line starting with a colon, which every SSE parser skips.
COMMENT = b": keep-alive\n\n"
#: Anthropic's keep-alive event, which its SDKs skip.
ANTHROPIC_PING = b'event: ping\ndata: {"type": "ping"}\n\n'

#: Where the app keeps the keep-alive policy in `scope["state"]` (`api/sse.keep_server_send`).
KEEPALIVE = "sse_keepalive"

Waiting = Coroutine[Any, Any, None] | None
FrameWriter = Callable[[bytes], Waiting]


@dataclass(frozen=True)
class KeepAlive:
    """The server's keep-alive policy: the quiet seconds before a keep-alive, and whether a
    request's path speaks Anthropic's API (its keep-alive is a `ping` event)."""

    interval: float
    speaks_anthropic: Callable[[Scope], bool]

    def frame(self, scope: Scope) -> bytes:
        """The keep-alive frame the request's clients expect."""
        return ANTHROPIC_PING if self.speaks_anthropic(scope) else COMMENT


class KeptAlive:
    """A stream's frame writer that keeps its connection alive while it is quiet (`run`)."""

    def __init__(
        self,
        write: FrameWriter,
        frame: bytes,
        interval: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._write = write
        self._frame = frame
        self._interval = interval
        self._clock = clock
        self._last = clock()
        #: A stream frame's send has not finished: the stream is not quiet.
        self._sending = False
        #: Set while a keep-alive's send has not finished: frames wait for it.
        self._pinging: asyncio.Event | None = None

    def write(self, frame: bytes) -> Waiting:
        """Write one stream frame (a `FrameWriter`): None once sent, else what completes it."""
        self._last = self._clock()
        if self._pinging is not None:
            return self._after_ping(frame, self._pinging)
        waiting = self._write(frame)
        if waiting is None:
            return None
        self._sending = True
        return self._finish(waiting)

    async def _finish(self, waiting: Coroutine[Any, Any, None]) -> None:
        try:
            await waiting
        finally:
            self._sending = False

    async def _after_ping(self, frame: bytes, pinging: asyncio.Event) -> None:
        await pinging.wait()
        waiting = self.write(frame)
        if waiting is not None:
            await waiting

    def due_in(self) -> float:
        """Seconds until a keep-alive is due (0: now); a whole interval while a send is
        unfinished (the stream is busy, or a keep-alive is on its way)."""
        if self._sending or self._pinging is not None:
            return self._interval
        return max(self._interval - (self._clock() - self._last), 0.0)

    async def run(self) -> None:
        """Write a keep-alive each time the stream has been quiet for the interval (until
        cancelled: the stream's end)."""
        while True:
            wait = self.due_in()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            self._last = self._clock()
            waiting = self._write(self._frame)
            if waiting is not None:
                pinging = self._pinging = asyncio.Event()
                try:
                    await waiting
                finally:
                    self._pinging = None
                    pinging.set()
