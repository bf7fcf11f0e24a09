"""Server-sent events: OpenAI framing and a lean streaming response.

`SSEResponse` replaces Starlette's StreamingResponse on the hot path: it sends each frame
straight to the ASGI `send`, and stops the stream (aborting the engine request) when the client
leaves, through `until_disconnect`. A client that stops reading is disconnected by the
connection's write deadline (`api/connection.py`), which ends the stream the same way.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterable

from starlette.types import Receive, Scope, Send

from deepinfer_server.api.disconnect import until_disconnect
from deepinfer_server.errors import ClientDisconnected

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

    def __init__(self, frames: AsyncGenerator[bytes, None]) -> None:
        self._frames = frames

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
        try:
            await until_disconnect(receive, self._stream(send))
        except ClientDisconnected:
            return
        finally:
            # Now, not when the garbage collector finalizes it: this closes the request handle
            # (aborting the engine request) however the stream ended.
            await self._frames.aclose()

    async def _stream(self, send: Send) -> None:
        async for frame in self._frames:
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
