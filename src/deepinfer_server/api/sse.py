"""Server-sent events: OpenAI framing and a lean streaming response.

`SSEResponse` replaces Starlette's StreamingResponse on the hot path: it sends each frame
straight to the ASGI `send` and watches for the client leaving with one task, cancelling the
stream (and so aborting the engine request) when it does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable

from starlette.types import Receive, Scope, Send

from deepinfer_server.api.disconnect import wait_for_disconnect

DONE_FRAME = b"data: [DONE]\n\n"
_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def data_frames(payloads: Iterable[str]) -> bytes:
    """`data: {json}\\n\\n` for each payload, as one write."""
    return b"".join(b"data: " + payload.encode() + b"\n\n" for payload in payloads)


class SSEResponse:
    """A 200 text/event-stream response whose body is `frames`."""

    def __init__(self, frames: AsyncIterator[bytes]) -> None:
        self._frames = frames

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
        streamer = asyncio.ensure_future(self._stream(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not streamer.done():
                streamer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await streamer
        if not streamer.cancelled():
            streamer.result()

    async def _stream(self, send: Send) -> None:
        async for frame in self._frames:
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
