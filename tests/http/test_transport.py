"""The transport seam (`api/transport.py`) under real uvicorn on loopback.

On uvicorn's httptools protocol a streamed answer's chunks take the fast path (written to the
transport by the seam); where uvicorn's internals are not there (its h11 protocol, no httptools
module, a cycle without a field the fast path reads) the portable path streams the same answer
through the ASGI `send`.
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass, field

import httpx
import openai
import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from deepinfer_server.api import sse, transport
from deepinfer_server.api.transport import PortableChannel, ResponseChannel, UvicornChannel
from tests.http.harness import MODEL, listening, run, serve

_TEXT = "Hello from the fake engine"


@dataclass
class _Writes:
    """The channels the streams were given, and what their `write_chunk` did."""

    channels: list[ResponseChannel] = field(default_factory=list)
    fast: int = 0
    through_send: int = 0


class _Counting:
    def __init__(self, inner: ResponseChannel, writes: _Writes) -> None:
        self._inner = inner
        self._writes = writes

    @property
    def write_paused(self) -> bool:
        return self._inner.write_paused

    @property
    def disconnected(self) -> bool:
        return self._inner.disconnected

    def write_chunk(self, chunk: bytes) -> bool:
        written = self._inner.write_chunk(chunk)
        if written:
            self._writes.fast += 1
        else:
            self._writes.through_send += 1
        return written


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> _Writes:
    seen = _Writes()
    choose = transport.response_channel

    def counting(send: object) -> ResponseChannel:
        channel = choose(send)  # type: ignore[arg-type]
        seen.channels.append(channel)
        return _Counting(channel, seen)

    monkeypatch.setattr(sse, "response_channel", counting)
    return seen


async def _stream(port: int) -> tuple[str, str | None, list[str]]:
    """The answer's text and finish reason through the openai client, and the raw `data:`
    payloads of a second stream."""
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
    text, finish = "", None
    async with client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        async for chunk in stream:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as raw:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        response = await raw.post("/v1/chat/completions", json=body)
        assert response.headers["transfer-encoding"] == "chunked"
        frames = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    return text, finish, frames


def _serve_stream(protocol: type[asyncio.Protocol]) -> tuple[str, str | None, list[str]]:
    async def body() -> tuple[str, str | None, list[str]]:
        async with serve() as harness, listening(harness, protocol) as port:
            return await _stream(port)

    result: tuple[str, str | None, list[str]] = run(body)
    return result


def test_on_httptools_every_chunk_takes_the_fast_path(writes: _Writes) -> None:
    text, finish, frames = _serve_stream(HttpToolsProtocol)
    assert (text, finish, frames[-1]) == (_TEXT, "stop", "[DONE]")
    assert len(writes.channels) == 2
    assert all(isinstance(channel, UvicornChannel) for channel in writes.channels)
    assert writes.fast >= len(frames) // 2 > 1  # frames of one step may share a write
    assert writes.through_send == 0


@pytest.mark.parametrize("without", ["h11", "no_httptools_module", "a_changed_cycle"])
def test_without_uvicorns_internals_the_portable_path_streams_the_same_answer(
    without: str, writes: _Writes, monkeypatch: pytest.MonkeyPatch
) -> None:
    protocol: type[asyncio.Protocol] = HttpToolsProtocol
    if without == "h11":
        protocol = H11Protocol
    elif without == "no_httptools_module":
        monkeypatch.setattr(transport, "_HttptoolsCycle", None)
    else:
        monkeypatch.setattr(transport, "_CYCLE_FIELDS", (*transport._CYCLE_FIELDS, "gone"))
    text, finish, frames = _serve_stream(protocol)
    assert (text, finish, frames[-1]) == (_TEXT, "stop", "[DONE]")
    assert len(writes.channels) == 2
    assert all(isinstance(channel, PortableChannel) for channel in writes.channels)
    assert writes.fast == 0 and writes.through_send >= len(frames) // 2 > 1


def test_the_portable_channel_writes_nothing_itself() -> None:
    channel = PortableChannel()
    assert not channel.write_chunk(b"data: x\n\n")
    assert not channel.write_paused and not channel.disconnected


class _Server(transport.HookedServer):
    def __init__(self, signals: tuple[signal.Signals, ...]) -> None:
        super().__init__(uvicorn.Config(app="unused:app"), signals)
        self.stop_signals = 0

    def on_stop_signal(self) -> None:
        self.stop_signals += 1


@pytest.mark.parametrize(
    ("signals", "first", "second", "stops_now"),
    [
        # Own signals: a second Ctrl-C stops the drain, a second SIGTERM does not.
        ((signal.SIGINT, signal.SIGTERM), signal.SIGTERM, signal.SIGINT, True),
        ((signal.SIGINT, signal.SIGTERM), signal.SIGTERM, signal.SIGTERM, False),
        # A supervisor forwards every signal as SIGTERM: the second one stops the drain.
        ((signal.SIGTERM,), signal.SIGTERM, signal.SIGTERM, True),
    ],
)
def test_a_second_stop_signal_stops_the_drain_as_the_signals_say(
    signals: tuple[signal.Signals, ...],
    first: signal.Signals,
    second: signal.Signals,
    stops_now: bool,
) -> None:
    async def body() -> None:
        server = _Server(signals)
        server.handle_exit(first, None)
        await asyncio.sleep(0)  # one turn: `stop_now` is set by a callback on the loop
        assert server.should_exit and not server.stop_now.is_set()
        server.handle_exit(second, None)
        await asyncio.sleep(0)
        assert server.stop_now.is_set() is stops_now
        assert server.stop_signals == 2

    run(body)
