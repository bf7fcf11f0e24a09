"""Request heads on real uvicorn (httptools and h11, in process, raw sockets on loopback): the
header bounds (431, 414) and the receive budget that bounds what unfinished requests hold."""

from __future__ import annotations

import asyncio
import json

import pytest
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from deepinfer_server.api import connection
from tests.http.harness import Harness, failures, listening, run, serve

PROTOCOLS = {"httptools": HttpToolsProtocol, "h11": H11Protocol}
LINE = 8 * 1024  # --max-header-line-bytes' default
HEAD = 64 * 1024  # --max-header-bytes' default
CHAT = json.dumps(
    {"model": "deepseek-flash", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
).encode()


def header_line(name: str, size: int) -> bytes:
    """`name: xxx…\\r\\n`, `size` bytes in all."""
    prefix = f"{name}: ".encode()
    return prefix + b"x" * (size - len(prefix) - 2) + b"\r\n"


def post_head(
    path: str = "/v1/chat/completions", length: int = len(CHAT), close: bool = True
) -> bytes:
    """A POST's request line and headers (without the blank line that ends them)."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n"
    )
    return (head + ("Connection: close\r\n" if close else "")).encode()


async def exchange(port: int, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send `data` on a new connection, then read until the server closes it: the status,
    headers and body of its (first) response."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        answer = asyncio.ensure_future(reader.read())
        await writer.drain()
        received = await answer
    finally:
        writer.close()
    return parse(received)


def parse(received: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines)
    return int(status_line.split()[1]), headers, body


def served(test: object, protocol: str, *args: str) -> None:
    """Run `test(harness, port)` against the app served by uvicorn's `protocol`."""

    async def body() -> None:
        async with serve(*args) as harness, listening(harness, PROTOCOLS[protocol]) as port:
            await test(harness, port)  # type: ignore[operator]

    run(body, timeout=60)


@pytest.fixture(params=sorted(PROTOCOLS))
def protocol(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_an_8mb_header_line_is_a_431_in_the_openai_envelope(protocol: str) -> None:
    """Before, one 8 MB header line was read in full and the request served."""

    async def test(harness: Harness, port: int) -> None:
        huge = post_head() + b"X-Big: " + b"a" * (8 * 1024 * 1024) + b"\r\n\r\n" + CHAT
        status, headers, body = await exchange(port, huge)
        assert status == 431
        assert headers["connection"] == "close"
        error = json.loads(body)["error"]
        assert error["code"] == "request_header_fields_too_large"
        assert error["type"] == "invalid_request_error"
        assert f"longer than {LINE} bytes" in error["message"]
        assert failures(harness.metrics) == {"431": 1.0}
        assert harness.coordinator.submitted == []
        assert harness.state.receiving.used == 0

    served(test, protocol)


def test_a_head_at_the_bounds_is_served_and_one_byte_more_is_refused(protocol: str) -> None:
    """Lines of exactly --max-header-line-bytes (CRLF included) in a head of exactly
    --max-header-bytes are served (h11's own 16 KiB bound raised above ours); one byte more in
    a line, or in the head, is a 431."""
    start = post_head()
    room = HEAD - len(start) - 2  # the blank line
    full_lines = [header_line(f"X-Fill-{i}", LINE) for i in range(room // LINE)]
    rest = room - LINE * len(full_lines)
    head = start + b"".join(full_lines) + header_line("X-Rest", rest)
    assert len(head) + 2 == HEAD

    async def test(harness: Harness, port: int) -> None:
        status, _, body = await exchange(port, head + b"\r\n" + CHAT)
        assert status == 200, body
        longer_line = start + header_line("X-Long", LINE + 1) + b"\r\n" + CHAT
        assert (await exchange(port, longer_line))[0] == 431
        longer_head = head + b"Y: \r\n" + b"\r\n" + CHAT
        status, _, body = await exchange(port, longer_head)
        assert status == 431
        assert f"larger than {HEAD} bytes" in json.loads(body)["error"]["message"]

    served(test, protocol)


def test_a_request_line_over_the_line_bound_is_a_414(protocol: str) -> None:
    async def test(harness: Harness, port: int) -> None:
        line = b"GET /v1/models?" + b"q" * LINE + b" HTTP/1.1\r\nHost: test\r\n\r\n"
        status, _, body = await exchange(port, line)
        assert status == 414
        assert json.loads(body)["error"]["code"] == "uri_too_long"

    served(test, protocol)


def test_messages_and_anthropic_clients_get_anthropics_envelope(protocol: str) -> None:
    async def test(harness: Harness, port: int) -> None:
        big = header_line("X-Big", LINE * 2)
        status, _, body = await exchange(port, post_head("/v1/messages") + big)
        assert status == 431
        assert json.loads(body)["type"] == "error"
        assert json.loads(body)["error"]["type"] == "invalid_request_error"
        models = b"GET /v1/models HTTP/1.1\r\nanthropic-version: 2023-06-01\r\n" + big
        assert json.loads((await exchange(port, models))[2])["type"] == "error"
        status, _, body = await exchange(port, b"GET /v1/models HTTP/1.1\r\n" + big)
        assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"

    served(test, protocol)


def test_a_keep_alive_connection_bounds_each_request_head_and_not_the_bodies(
    protocol: str,
) -> None:
    """The head bound restarts with each request on a connection, and a body larger than a
    head bound is a body (bounded by --max-request-bytes), never counted as a head."""
    big_body = CHAT[:-1] + b" " * (2 * HEAD) + b"}"  # JSON whitespace: the same request

    async def test(harness: Harness, port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            filler = b"".join(header_line(f"X-F{i}", LINE // 2) for i in range(12))
            for body in (big_body, CHAT, big_body):
                writer.write(post_head(length=len(body), close=False) + filler + b"\r\n" + body)
                status_line = await reader.readline()
                assert status_line.startswith(b"HTTP/1.1 200"), status_line
                length = 0
                while (line := await reader.readline()) != b"\r\n":
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
        finally:
            writer.close()
        assert harness.state.receiving.used == 0

    served(test, protocol)


def test_unfinished_heads_hold_at_most_the_receive_budget(protocol: str) -> None:
    """Connections that each hold an unfinished head within the header bounds: once their
    bytes fill --max-receive-buffer-mb, more are refused (503, Retry-After) rather than kept,
    probes are still answered, and closing the holders gives their bytes back."""
    budget = 1024 * 1024
    unfinished = post_head() + b"".join(header_line(f"X-F{i}", LINE) for i in range(7))
    connections = 24  # 24 x 57 KiB: a third more than the budget

    async def test(harness: Harness, port: int) -> None:
        holders = [await asyncio.open_connection("127.0.0.1", port) for _ in range(connections)]
        answers = [asyncio.ensure_future(reader.read()) for reader, _ in holders]
        for _, writer in holders:
            writer.write(unfinished)
        refused: set[asyncio.Future[bytes]] = set()
        while len(refused) < connections - budget // len(unfinished):
            done, _ = await asyncio.wait(
                [a for a in answers if a not in refused], return_when=asyncio.FIRST_COMPLETED
            )
            refused |= done
        assert harness.state.receiving.used <= budget
        for answer in refused:
            status, headers, body = parse(answer.result())
            assert status == 503
            assert headers["retry-after"] == "1"
            assert json.loads(body)["error"]["code"] == "receive_buffer_full"
        health = b"GET /health HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"
        assert (await exchange(port, health))[0] == 200
        for (_, writer), answer in zip(holders, answers, strict=True):
            writer.write_eof()
            await answer  # the server closed its side: the connection is gone
            writer.close()
        assert harness.state.receiving.used == 0
        request = post_head() + b"\r\n" + CHAT
        assert (await exchange(port, request))[0] == 200

    served(test, protocol, "--max-receive-buffer-mb", "1")


def test_a_refused_client_that_keeps_sending_is_cut_off_after_the_linger(
    protocol: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refused connection reads and drops what its client still sends, for a bounded
    time: a client that never stops is then cut off."""
    monkeypatch.setattr(connection, "LINGER_SECONDS", 0.2)

    async def test(harness: Harness, port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post_head() + b"X-Big: " + b"a" * (2 * LINE))
        await writer.drain()
        status_line = await reader.readline()
        assert status_line.startswith(b"HTTP/1.1 431")
        with pytest.raises(ConnectionError):
            while True:  # the server reads (and drops) all of this, then resets
                writer.write(b"a" * 65536)
                await writer.drain()
        writer.close()

    served(test, protocol)
