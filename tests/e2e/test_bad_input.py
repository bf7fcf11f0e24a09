"""Bad input against the live server: 4xx on a connection that stays usable, and uploads that
the client aborts are a quiet 499."""

from __future__ import annotations

import http.client
import json
import socket

import httpx

from tests.metrics_scrape import scrape
from tests.server import LiveServer

MODEL = "deepseek-flash"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
JSON = "application/json"
GOOD = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 4,
    "thinking": {"type": "disabled"},
}
NASTY: list[tuple[str, bytes, str]] = [
    (CHAT, b'{"model": "x", "metadata": ' + b"[" * 200 + b"]" * 200 + b"}", "application/json"),
    (
        CHAT,
        json.dumps(
            {**GOOD, "messages": [{"role": "user", "content": [{"type": ["text"], "text": "x"}]}]}
        ).encode(),
        "application/json",
    ),
    (CHAT, json.dumps({**GOOD, "max_tokens": 2**70}).encode(), "application/json"),
    (CHAT, b'{"model": "\xff\xfe"}', "application/json"),
    (CHAT, b'{"model": "\\ud800"}', "application/json"),
    (CHAT, json.dumps(GOOD).encode(), "text/plain"),
    ("/v1/messages", json.dumps({**GOOD, "max_tokens": None}).encode(), "application/json"),
    (
        "/v1/responses",
        json.dumps({"model": MODEL, "input": [{"type": "zzz"}]}).encode(),
        "application/json",
    ),
    (CHAT, json.dumps({**GOOD, "messages": [{"role": ["user"], "content": "x"}]}).encode(), JSON),
    # Token IDs beyond int32 (a slot leaked per request) and beyond 32 bits (a 500).
    (COMPLETIONS, json.dumps({"model": MODEL, "prompt": [2**31], "max_tokens": 1}).encode(), JSON),
    (COMPLETIONS, json.dumps({"model": MODEL, "prompt": [2**32], "max_tokens": 1}).encode(), JSON),
]


def server_errors(server: LiveServer) -> float:
    samples = scrape(server.base_url)
    return sum(
        value
        for (name, labels), value in samples.items()
        if name == "deepinfer:request_failure_total" and dict(labels)["status"].startswith("5")
    )


def test_bad_requests_are_4xx_and_keep_the_connection_usable(shared_server: LiveServer) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", shared_server.port, timeout=30)
    connection.connect()
    first_socket = connection.sock
    for path, body, content_type in NASTY:
        connection.request("POST", path, body=body, headers={"Content-Type": content_type})
        response = connection.getresponse()
        payload = response.read()
        assert 400 <= response.status < 500, (path, body[:60], response.status, payload)
        assert response.getheader("x-request-id")
        assert response.getheader("connection") != "close"
        assert "error" in json.loads(payload)
    connection.request(
        "POST", CHAT, body=json.dumps(GOOD), headers={"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    assert response.status == 200 and json.loads(response.read())["choices"]
    assert connection.sock is first_socket  # one keep-alive connection throughout
    connection.close()
    assert server_errors(shared_server) == 0
    # Nothing a refused request took is still held.
    assert httpx.get(f"{shared_server.base_url}/get_load", timeout=30).json() == {"load": 0}


def test_an_upload_aborted_mid_body_is_a_quiet_499(shared_server: LiveServer) -> None:
    with socket.create_connection(("127.0.0.1", shared_server.port)) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n" + b'{"model": '
        )
    # The log lines are the feature: an INFO line and a 499 in the access log, no error.
    line = shared_server.wait_for_line("disconnected while sending its body", 10)
    assert "INFO" in line
    access = shared_server.wait_for_line("POST /v1/chat/completions 499", 10)
    assert "request_id=" in access
    assert "Traceback" not in shared_server.log and " ERROR " not in shared_server.log
    assert server_errors(shared_server) == 0
