#!/usr/bin/env python3
"""The baseline: a minimal raw ASGI app on the same uvicorn stack (uvloop, httptools).

Every POST streams `tokens` OpenAI-shaped chat.completion.chunk SSE frames (one per token,
as fast as possible, read from the body's "max_tokens") and `data: [DONE]`. No parsing, no
engine, no coordination: the ceiling of the HTTP stack itself.
"""

from __future__ import annotations

import argparse
import json
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


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    tokens = await requested_tokens(receive, 256)
    await send(START)
    for _ in range(tokens):
        await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
