"""Operations end to end: metrics across ranks and API processes, drains and signals, the
body-read timeout on a real socket, debug logging of routing, on live servers. The HTTP layer's
own options (API keys, CORS, access log, request IDs, --max-request-bytes, /version) are tested
in-process in tests/http/test_http_options.py."""

from __future__ import annotations

import re
import signal
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.metrics_scrape import scrape, value
from tests.server import API_SERVER_COUNTS, LiveServer
from tests.sse import sse_events

MODEL = "deepseek-flash"
NO_THINKING = {"thinking": {"type": "disabled"}}
MESSAGES = [{"role": "user", "content": "one two three"}]
ENDLESS = {
    "model": MODEL,
    "messages": MESSAGES,
    "max_tokens": 3000,
    "ignore_eos": True,
    **NO_THINKING,
}


@pytest.fixture(scope="module", params=API_SERVER_COUNTS, ids=lambda n: f"api{n}")
def metered(request: pytest.FixtureRequest) -> Iterator[LiveServer]:
    """DP=2, one running sequence per rank (capacity 2), a short request timeout (4 s); one API
    server process, or two whose /metrics must add up to the same numbers."""
    with LiveServer(
        "--ep",
        "2",
        "--dp",
        "2",
        "--max-num-seqs",
        "1",
        "--max-queued-requests",
        "0",
        "--request-timeout",
        # Long enough that the two streams below still run when the third request comes
        # on a loaded machine (2 s was not, once, beside other test runs).
        "4",
        "--sim-itl-ms",
        "5",
        "--sim-ttft-ms",
        "2",
        api_servers=request.param,
    ) as server:
        yield server


def test_metrics_count_exactly_what_requests_did(metered: LiveServer) -> None:
    url = metered.base_url + "/v1/chat/completions"
    before = scrape(metered.base_url)
    usages = []
    for max_tokens in (3, 5, 7):
        reply = httpx.post(url, json={**ENDLESS, "max_tokens": max_tokens}, timeout=30).json()
        usages.append(reply["usage"])
    stop_reply = httpx.post(
        url, json={"model": MODEL, "messages": MESSAGES, **NO_THINKING}, timeout=30
    )
    usages.append(stop_reply.json()["usage"])
    with httpx.stream(
        "POST",
        url,
        json={
            **ENDLESS,
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        timeout=30,
    ) as stream:
        streamed = [e for e in sse_events(stream) if isinstance(e, dict)]
    usages.append(streamed[-1]["usage"])
    assert (
        httpx.post(url, json={"model": "other", "messages": MESSAGES}, timeout=30).status_code
        == 404
    )
    assert (
        httpx.post(url, json={"model": MODEL, "messages": MESSAGES, "n": 0}, timeout=30).status_code
        == 400
    )
    after = scrape(metered.base_url)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("deepinfer:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("deepinfer:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert delta("deepinfer:request_success_total", finished_reason="length") == 4
    assert delta("deepinfer:request_success_total", finished_reason="stop") == 1
    assert delta("deepinfer:e2e_request_latency_seconds_count") == 5
    assert delta("deepinfer:time_to_first_token_seconds_count") == 5
    assert delta("deepinfer:request_generation_tokens_sum") == sum(
        u["completion_tokens"] for u in usages
    )
    assert delta("deepinfer:inter_token_latency_seconds_count") == sum(
        u["completion_tokens"] - 1 for u in usages
    )
    assert delta("deepinfer:request_failure_total", status="404") == 1
    assert delta("deepinfer:request_failure_total", status="400") == 1
    # Both ranks step in lockstep, whichever of them holds the work.
    assert delta("deepinfer:engine_step_seconds_count", dp_rank="0") > 0
    assert delta("deepinfer:engine_step_seconds_count", dp_rank="1") > 0
    assert value(after, "deepinfer:healthy") == 1


def test_metrics_under_overload_disconnects_timeouts_and_stops(metered: LiveServer) -> None:
    url = metered.base_url + "/v1/chat/completions"
    before = scrape(metered.base_url)
    with (
        httpx.stream("POST", url, json={**ENDLESS, "stream": True}, timeout=30) as first,
        httpx.stream("POST", url, json={**ENDLESS, "stream": True}, timeout=30) as second,
    ):
        first_events, second_events = sse_events(first), sse_events(second)
        next(first_events), next(second_events)
        next(first_events), next(second_events)
        during = scrape(metered.base_url)
        assert httpx.post(url, json=ENDLESS, timeout=30).status_code == 429
    # Both streams were closed by the client: two disconnects.
    timed_out = httpx.post(url, json=ENDLESS, timeout=30)
    assert timed_out.status_code == 408
    stopped = httpx.post(url, json={**ENDLESS, "stop": ["three"]}, timeout=30)
    assert stopped.json()["choices"][0]["finish_reason"] == "stop"
    after = scrape(metered.base_url)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    running = [value(during, "deepinfer:num_requests_running", dp_rank=str(r)) for r in (0, 1)]
    assert running == [1, 1]  # least-loaded routing: one stream per rank
    assert delta("deepinfer:request_failure_total", status="429") == 1
    assert delta("deepinfer:request_failure_total", status="408") == 1
    assert delta("deepinfer:request_abort_total", reason="disconnect") == 2
    assert delta("deepinfer:request_abort_total", reason="timeout") == 1
    assert delta("deepinfer:request_abort_total", reason="stop") == 1
    assert value(after, "deepinfer:num_requests_running", dp_rank="0") == 0
    assert value(after, "deepinfer:num_requests_waiting", dp_rank="1") == 0


def _read_http_response(connection: socket.socket) -> str:
    """Headers and the whole Content-Length body, however the bytes arrive."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += connection.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head, re.IGNORECASE).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        body += connection.recv(4096)
    return (head + b"\r\n\r\n" + body).decode()


def test_body_read_timeout_against_a_client_that_drips_its_body() -> None:
    """A real socket that sends part of a declared body and stalls: 408 at --body-read-timeout,
    and the server goes on (--max-request-bytes is tested in-process, tests/http)."""
    with LiveServer("--body-read-timeout", "1") as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as slow:
            slow.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"model"'
            )
            reply = _read_http_response(slow)
        assert reply.startswith("HTTP/1.1 408")
        assert "body_timeout" in reply
        assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200


@pytest.mark.parametrize("api_servers", API_SERVER_COUNTS)
def test_sigterm_drains_in_flight_requests(api_servers: int) -> None:
    with LiveServer(
        "--shutdown-timeout", "20", "--sim-itl-ms", "20", api_servers=api_servers
    ) as server:
        url = server.base_url + "/v1/chat/completions"
        with httpx.stream(
            "POST", url, json={**ENDLESS, "max_tokens": 60, "stream": True}, timeout=30
        ) as stream:
            events = sse_events(stream)
            next(events)
            server.process.send_signal(signal.SIGTERM)
            server.wait_for_health("draining", timeout=10)  # 503 from the drain's start
            refused = httpx.post(url, json=ENDLESS, timeout=30)
            assert refused.status_code == 503
            rest = list(events)
        assert rest[-1] == "[DONE]"
        finish = [
            e["choices"][0]["finish_reason"]
            for e in rest
            if isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"]
        ]
        assert finish == ["length"]  # it finished normally inside the drain window
        assert server.process.wait(30) == 0
        assert "[shutdown] draining 1 request" in server.log  # it says how many it waited for


@pytest.mark.parametrize("api_servers", API_SERVER_COUNTS)
def test_second_sigint_stops_a_drain_at_once(api_servers: int) -> None:
    with LiveServer(
        "--shutdown-timeout", "120", "--sim-itl-ms", "20", api_servers=api_servers
    ) as server:
        url = server.base_url + "/v1/chat/completions"
        with httpx.stream("POST", url, json={**ENDLESS, "stream": True}, timeout=30) as stream:
            events = sse_events(stream)
            next(events)
            server.process.send_signal(signal.SIGINT)
            server.wait_for_health("draining", timeout=10)
            started = time.monotonic()
            server.process.send_signal(signal.SIGINT)
            assert server.process.wait(60) == 0
            assert time.monotonic() - started < 60  # far inside the 120 s drain window
            rest = list(events)
        assert rest and isinstance(rest[-2], dict) and "error" in rest[-2]


def test_debug_log_level_tells_admission_routing_and_aborts() -> None:
    with LiveServer("--log-level", "debug", "--sim-itl-ms", "5") as server:
        url = server.base_url + "/v1/chat/completions"
        headers = {"X-Request-Id": "dbg-1"}
        with httpx.stream(
            "POST", url, json={**ENDLESS, "stream": True}, headers=headers, timeout=30
        ) as s:
            next(sse_events(s))
        # The debug lines are the feature here: waiting for them is what the test checks.
        server.wait_for_line("to DP rank 0", timeout=10)
        line = server.wait_for_line("aborted on DP rank 0 (disconnect)", timeout=10)
        assert "dbg-1" in line
