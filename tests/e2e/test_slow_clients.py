"""Slow and idle clients on live servers: never-read streams, half-sent headers, connection cap."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.metrics_scrape import scrape
from tests.server import LiveServer, wait_until

MODEL = "deepseek-flash"
NEVER_ENDING = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "go"}],
    "max_tokens": 32000,
    "ignore_eos": True,
    "stream": True,
    "thinking": {"type": "disabled"},
}
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 4,
    "thinking": {"type": "disabled"},
}


def raw_request(port: int, body: dict[str, object], path: str = "/v1/chat/completions") -> bytes:
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


def never_reading_stream(port: int) -> socket.socket:
    """A client with a 4 KiB receive buffer that sends a streaming request and never reads."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(raw_request(port, NEVER_ENDING))
    return sock


def running(server: LiveServer) -> float:
    """Requests running on every DP rank."""
    samples = scrape(server.base_url)
    return sum(v for (name, _), v in samples.items() if name == "deepinfer:num_requests_running")


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """Read what is buffered; True once the server has closed or reset the connection."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def chat_status(server: LiveServer) -> int:
    return httpx.post(server.base_url + "/v1/chat/completions", json=CHAT, timeout=30).status_code


@pytest.fixture()
def readers() -> Iterator[list[socket.socket]]:
    sockets: list[socket.socket] = []
    yield sockets
    for sock in sockets:
        sock.close()


def test_the_write_timeout_frees_the_slots_of_clients_that_stop_reading(
    readers: list[socket.socket],
) -> None:
    args = ("--max-num-seqs", "2", "--max-queued-requests", "0", "--sim-itl-ms", "1")
    args += ("--write-timeout", "2")
    with LiveServer(*args) as server:
        readers.extend(never_reading_stream(server.port) for _ in range(2))
        wait_until(lambda: running(server) == 2, 20, "both streams running")
        assert chat_status(server) == 429  # full while the readers hold their slots
        # The readers never read; within the write timeout their streams end, their slots
        # are freed and their connections dropped. (Reading a socket to see it closed would
        # acknowledge its bytes, and the write timeout counts only unacknowledged ones: the
        # stream then ran to its end, some 40 s.)
        wait_until(lambda: running(server) == 0, 30, "both stalled streams ended, slots freed")
        for sock in readers:
            assert closed_by_server(sock, 10)
        assert [chat_status(server) for _ in range(3)] == [200, 200, 200]
        assert "(--write-timeout)" in server.log


def test_a_stream_the_client_takes_nothing_of_is_ended_before_the_send_buffer_fills(
    readers: list[socket.socket],
) -> None:
    """A reader with an ordinary receive buffer that stops reading: the kernel's send buffer
    (megabytes on loopback) took minutes of tokens to fill before the write timeout started;
    now the clock runs from when the client stops acknowledging data."""
    args = ("--max-num-seqs", "1", "--sim-itl-ms", "2", "--write-timeout", "2")
    with LiveServer(*args) as server:
        sock = socket.create_connection(("127.0.0.1", server.port))
        readers.append(sock)
        sock.sendall(raw_request(server.port, NEVER_ENDING))
        wait_until(lambda: running(server) == 1, 20, "the stream running")
        # Never read: at 2 ms a token the send buffer alone would hold minutes of stream (its
        # 32000 tokens outlast this wait), so only the write timeout can end it in time.
        wait_until(lambda: running(server) == 0, 30, "the stalled stream ended, its slot freed")
        server.wait_for_line("(--write-timeout)", timeout=10)  # the log names the option
        assert closed_by_server(sock, 10)
        assert chat_status(server) == 200


def test_the_request_timeout_aborts_unread_streams_and_the_service_stays_healthy(
    readers: list[socket.socket],
) -> None:
    args = (
        "--max-num-seqs", "2", "--sim-itl-ms", "1", "--request-timeout", "3",
        "--step-timeout", "1", "--write-timeout", "60",
    )  # fmt: skip
    with LiveServer(*args) as server:
        readers.extend(never_reading_stream(server.port) for _ in range(2))
        wait_until(lambda: running(server) == 2, 20, "both streams running")
        # At the request timeout the engine requests are aborted although the writers block.
        wait_until(lambda: running(server) == 0, 15, "gauges back to 0 at the request timeout")
        assert chat_status(server) == 200
        # The ranks are idle now: the liveness watchdog (1 s) must not call them hung.
        # Not a wait: /health is sampled for three watchdog periods and must stay 200 throughout.
        until = time.monotonic() + 3
        while time.monotonic() < until:
            assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
            time.sleep(0.2)
        assert chat_status(server) == 200


def test_half_sent_headers_and_silent_sockets_are_closed_at_the_header_timeout() -> None:
    with LiveServer("--header-timeout", "1") as server:
        silent = socket.create_connection(("127.0.0.1", server.port))
        trickle = socket.create_connection(("127.0.0.1", server.port))
        trickle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        for sock in (silent, trickle):
            with sock:
                assert closed_by_server(sock, 10)
        assert time.monotonic() - started < 8
        # A keep-alive connection that starts a second request and stalls is closed as well.
        with socket.create_connection(("127.0.0.1", server.port)) as kept:
            kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert b"200 OK" in kept.recv(65536)
            kept.sendall(b"GET /health HTTP/1.1\r\n")
            assert closed_by_server(kept, 10)
        assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200


def test_over_the_connection_cap_only_probes_are_answered() -> None:
    with LiveServer("--max-connections", "4", "--header-timeout", "30") as server:
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
        try:
            # Let the server accept them all before the probes connect.
            wait_until(
                lambda: httpx.get(server.base_url + "/v1/models", timeout=5).status_code == 503,
                10,
                "the cap reached",
            )
            health = httpx.get(server.base_url + "/health", timeout=5)
            assert health.status_code == 200
            assert health.headers["connection"] == "close"
            assert httpx.get(server.base_url + "/metrics", timeout=5).status_code == 200
            refused = httpx.post(server.base_url + "/v1/chat/completions", json=CHAT, timeout=5)
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "too_many_connections"
        finally:
            for sock in idle:
                sock.close()
        wait_until(lambda: chat_status(server) == 200, 10, "served again under the cap")


def test_the_cap_fits_the_open_file_limit_so_probes_survive_a_flood_of_idle_sockets() -> None:
    # As in the report: `ulimit -n 512` and 600 idle sockets used to make /health fail.
    with LiveServer("--header-timeout", "30", file_limit=512) as server:
        assert "--max-connections 1000 lowered to 352" in server.log
        idle = []
        try:
            for _ in range(600):
                idle.append(socket.create_connection(("127.0.0.1", server.port)))
            for _ in range(5):
                assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
        finally:
            for sock in idle:
                sock.close()
        wait_until(lambda: chat_status(server) == 200, 15, "served again once they left")
