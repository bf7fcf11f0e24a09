#!/usr/bin/env python3
"""The baseline: a minimal raw ASGI app on the same uvicorn stack (uvloop, httptools).

Every POST streams `tokens` OpenAI-shaped chat.completion.chunk SSE frames (one per token,
as fast as possible, read from the body's "max_tokens") and `data: [DONE]`. No parsing, no
engine, no coordination: the ceiling of the HTTP stack itself.

With `--first-token-ms D` the first chunk is written exactly D ms after the body was read (an
ideal engine's time to first token), which makes it the TTFT baseline: what an ideal server adds
to D is only the HTTP stack, loopback and the client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import uvicorn

CHUNK = (
    b'data: {"id":"chatcmpl-baseline","object":"chat.completion.chunk","created":0,'
    b'"model":"deepseek-flash","system_fingerprint":null,"choices":[{"index":0,'
    b'"delta":{"content":"again"},"logprobs":null,"finish_reason":null}],"usage":null}\n\n'
)


START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"text/event-stream")],
}


async def requested_tokens(receive: Any, default: int) -> int:
    """The request body's "max_tokens" (the whole body is read)."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    return int(json.loads(body or b"{}").get("max_tokens", default))


#: Seconds before the first chunk (--first-token-ms).
FIRST_TOKEN_DELAY = 0.0
#: The last part of the wait is spun: the event loop's timers have millisecond granularity, and
#: the ideal server must not be late (nor pay a wake-up the real one might not).
_SPIN_SECONDS = 0.002


async def _wait_until(deadline: float) -> None:
    if deadline - time.perf_counter() > _SPIN_SECONDS:
        await asyncio.sleep(deadline - time.perf_counter() - _SPIN_SECONDS)
    while time.perf_counter() < deadline:
        pass


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    tokens = await requested_tokens(receive, 256)
    if FIRST_TOKEN_DELAY:
        await _wait_until(time.perf_counter() + FIRST_TOKEN_DELAY)
    await send(START)
    for _ in range(tokens):
        await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--first-token-ms", type=float, default=0.0)
    args = parser.parse_args()
    global FIRST_TOKEN_DELAY
    FIRST_TOKEN_DELAY = args.first_token_ms / 1000
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
