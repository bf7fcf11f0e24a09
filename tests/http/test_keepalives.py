"""Keep-alives while a streamed request waits (`--sse-keepalive-seconds`): over real uvicorn,
a stream whose request is held (queued: the engine has not taken it) receives Anthropic's `ping`
event on /v1/messages and an SSE comment on the OpenAI routes, each interval, before its first
event; the official clients parse the stream it makes, keep-alives included."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from deepinfer_server.api.keepalive import ANTHROPIC_PING, COMMENT
from deepinfer_server.api.transport import HTTP_PROTOCOL
from deepinfer_server.ipc.messages import Finish, GeneratedTokens
from tests.http.harness import MODEL, Harness, Script, client_http, listening, run, serve

INTERVAL = "0.05"
KEEPALIVES = 3
USER: Any = [{"role": "user", "content": "hello"}]
ROUTES: list[tuple[str, Any, bytes]] = [
    ("/v1/messages", {"max_tokens": 64, "messages": USER}, ANTHROPIC_PING),
    ("/v1/chat/completions", {"messages": USER}, COMMENT),
    ("/v1/responses", {"input": "hello"}, COMMENT),
]


def _answer(h: Harness) -> None:
    """The held request's engine output: taken, then its whole answer."""
    (handle,) = h.coordinator.handles.values()
    handle.started(0)
    tokenizer = h.state.recipe.tokenizer
    ((_, prompt, _),) = h.coordinator.submitted
    thinking = prompt[-1:] == list(tokenizer.encode("<think>"))
    ids = list(tokenizer.encode(("Thinking.</think>" if thinking else "") + "Hi there."))
    handle.deliver(GeneratedTokens(ids), Finish.STOP, time.perf_counter(), 0.001)
    handle.flush()


async def _frames(response: httpx.Response) -> AsyncIterator[bytes]:
    """The stream's frames (each ends with a blank line), as they arrive."""
    buffer = b""
    async for chunk in response.aiter_bytes():
        buffer += chunk
        while b"\n\n" in buffer:
            frame, buffer = buffer.split(b"\n\n", 1)
            yield frame + b"\n\n"


async def _held_stream(h: Harness, port: int, path: str, body: Any, keepalive: bytes) -> bytes:
    """The whole stream of a request held until `KEEPALIVES` keep-alives arrived, which
    must come before any other frame."""
    seen: list[bytes] = []
    url = f"http://127.0.0.1:{port}{path}"
    async with (
        httpx.AsyncClient(timeout=10) as client,
        client.stream("POST", url, json={"model": MODEL, "stream": True, **body}) as response,
    ):
        assert response.status_code == 200
        async for frame in _frames(response):
            seen.append(frame)
            if len(seen) == KEEPALIVES:
                assert seen == [keepalive] * KEEPALIVES
                _answer(h)
    assert len(seen) > KEEPALIVES
    assert keepalive not in seen[KEEPALIVES:]  # the answer's frames keep the stream busy
    return b"".join(seen)


def _replaying(stream: bytes) -> Any:
    """An SDK http client that answers any request with `stream`, as the server sent it."""

    def handler(request: Any) -> Any:
        headers = {"content-type": "text/event-stream"}
        return client_http.Response(200, content=stream, headers=headers)

    return client_http.AsyncClient(transport=client_http.MockTransport(handler))


async def _parsed_by_the_sdk(path: str, body: Any, stream: bytes) -> str:
    """The answer text the official client reads from `stream`."""
    http = _replaying(stream)
    if path == "/v1/messages":
        claude = anthropic.AsyncAnthropic(base_url="http://test", api_key="x", http_client=http)
        async with claude.messages.stream(model=MODEL, **body) as events:
            message = await events.get_final_message()
        return "".join(block.text for block in message.content if block.type == "text")
    client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http)
    if path == "/v1/responses":
        events = await client.responses.create(model=MODEL, stream=True, **body)
        done = [event async for event in events if event.type == "response.completed"]
        return done[0].response.output_text  # type: ignore[union-attr]
    chunks = await client.chat.completions.create(model=MODEL, stream=True, **body)
    return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])


@pytest.mark.parametrize(("path", "body", "keepalive"), ROUTES)
def test_a_queued_stream_receives_keepalives_its_clients_skip(
    path: str, body: Any, keepalive: bytes
) -> None:
    async def test() -> None:
        args = ("--sse-keepalive-seconds", INTERVAL)
        async with serve(*args, script=Script(hold=True)) as h, listening(h, HTTP_PROTOCOL) as port:
            stream = await _held_stream(h, port, path, body, keepalive)
        assert await _parsed_by_the_sdk(path, body, stream) == "Hi there."

    run(test)
