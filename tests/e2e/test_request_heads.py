"""Request heads on a live server with two API server processes: an 8 MB header line is a 431
from whichever process takes the connection, a head within the bounds is served, and
connections holding unfinished heads hold at most each process's receive budget."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest

from tests.metrics_scrape import scrape, value
from tests.server import LiveServer, wait_until

MODEL = "deepseek-flash"
LINE = 8 * 1024  # --max-header-line-bytes' default
BUDGET = 1024 * 1024  # --max-receive-buffer-mb 1, per process
PROCESSES = 2


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with LiveServer("--max-receive-buffer-mb", "1", api_servers=PROCESSES) as live:
        yield live


def head(port: int) -> bytes:
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        "Content-Type: application/json\r\nContent-Length: 2\r\n"
    ).encode()


def header_line(name: str, size: int) -> bytes:
    prefix = f"{name}: ".encode()
    return prefix + b"x" * (size - len(prefix) - 2) + b"\r\n"


def status_and_error(received: bytes) -> tuple[int, dict[str, object]]:
    status_line, _, rest = received.partition(b"\r\n")
    body = rest.partition(b"\r\n\r\n")[2]
    return int(status_line.split()[1]), json.loads(body)["error"] if body else {}


def receiving(server: LiveServer) -> float:
    return value(scrape(server.base_url), "deepinfer:receive_buffer_bytes")


def test_an_8mb_header_line_is_a_431_from_every_process(server: LiveServer) -> None:
    huge = head(server.port) + b"X-Big: " + b"a" * (8 * 1024 * 1024) + b"\r\n\r\n{}"

    async def one() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(huge)
        answer = asyncio.ensure_future(reader.read())
        await writer.drain()
        received = await answer
        writer.close()
        return received

    async def several() -> list[bytes]:
        # The kernel picks the process of each connection: eight make both near-certain.
        return await asyncio.gather(*(one() for _ in range(8)))

    for received in asyncio.run(several()):
        status, error = status_and_error(received)
        assert status == 431
        assert error["code"] == "request_header_fields_too_large"
    failures = value(scrape(server.base_url), "deepinfer:request_failure_total", status="431")
    assert failures == 8  # summed over both processes


def test_a_head_within_the_bounds_is_served(server: LiveServer) -> None:
    fill = {f"x-fill-{i}": "x" * (LINE - 20) for i in range(7)}
    answer = httpx.get(server.base_url + "/v1/models", headers=fill, timeout=30)
    assert answer.status_code == 200


def test_unfinished_heads_hold_at_most_each_process_budget(server: LiveServer) -> None:
    """60 connections each hold 57 KiB of an unfinished head (3.4 MB in all, within the header
    bounds): the processes keep at most their budgets and refuse the rest with 503."""
    unfinished = head(server.port) + b"".join(header_line(f"X-F{i}", LINE) for i in range(7))
    connections = 60
    most_held = PROCESSES * (BUDGET // len(unfinished))

    async def hold() -> None:
        holders = [
            await asyncio.open_connection("127.0.0.1", server.port) for _ in range(connections)
        ]
        answers = [asyncio.ensure_future(reader.read()) for reader, _ in holders]
        for _, writer in holders:
            writer.write(unfinished)
        refused: set[asyncio.Future[bytes]] = set()
        while len(refused) < connections - most_held:
            done, _ = await asyncio.wait(
                [a for a in answers if a not in refused], return_when=asyncio.FIRST_COMPLETED
            )
            refused |= done
        for answer in refused:
            status, error = status_and_error(answer.result())
            assert status == 503
            assert error["code"] == "receive_buffer_full"
        held = await asyncio.to_thread(receiving, server)  # /metrics: a probe, never refused
        assert 0 < held <= PROCESSES * BUDGET
        for _, writer in holders:
            writer.close()

    asyncio.run(hold())
    wait_until(lambda: receiving(server) == 0, 10, "the closed connections' bytes given back")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    answer = httpx.post(server.base_url + "/v1/chat/completions", json=chat, timeout=30)
    assert answer.status_code == 200
