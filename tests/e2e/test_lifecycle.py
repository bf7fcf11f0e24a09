"""Processes and coordination end to end: capacity, cancellation, timeouts, failure, shutdown."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.conftest import ENDLESS, MODEL, NO_THINKING
from tests.server import API_SERVER_COUNTS, LiveServer, wait_until
from tests.sse import sse_events


def _alive(pids: list[int]) -> list[int]:
    """The processes of `pids` that still run (an exited one is gone or a zombie)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _assert_no_processes(pids: list[int]) -> None:
    alive = _alive(pids)
    assert alive == [], f"processes left behind: {alive}"


@pytest.fixture(scope="module", params=API_SERVER_COUNTS, ids=lambda n: f"api{n}")
def one_slot_server(request: pytest.FixtureRequest) -> Iterator[LiveServer]:
    """One rank, one running sequence, no queue: capacity 1, slow steps."""
    with LiveServer(
        "--max-num-seqs",
        "1",
        "--max-queued-requests",
        "0",
        "--sim-itl-ms",
        "20",
        "--sim-ttft-ms",
        "5",
        "--max-model-len",
        "8192",
        api_servers=request.param,
    ) as server:
        yield server


def test_over_capacity_is_429_with_retry_after(one_slot_server: LiveServer) -> None:
    url = one_slot_server.base_url + "/v1/chat/completions"
    with httpx.stream("POST", url, json={**ENDLESS, "stream": True}, timeout=30) as holding:
        events = sse_events(holding)  # kept referenced: closing it would close the stream
        assert isinstance(next(events), dict)
        rejected = httpx.post(url, json={**ENDLESS, "max_tokens": 5}, timeout=30)
        assert rejected.status_code == 429
        assert int(rejected.headers["retry-after"]) >= 1
        assert rejected.json()["error"]["code"] == "rate_limit_exceeded"
        assert set(rejected.json()["error"]) == {"message", "type", "param", "code"}


def test_stream_disconnect_aborts_the_engine_request(one_slot_server: LiveServer) -> None:
    url = one_slot_server.base_url + "/v1/chat/completions"
    request_id = f"left-{uuid.uuid4().hex[:8]}"
    body = {**ENDLESS, "stream": True}
    headers = {"x-request-id": request_id}
    with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as stream:
        events = sse_events(stream)
        next(events)
        next(events)
    # The endless request (3000 tokens at 20 ms a step: a minute) must be gone from the engine:
    # with one running sequence per rank, this request only runs once it was aborted.
    follow_up = httpx.post(url, json={**ENDLESS, "max_tokens": 3}, timeout=20)
    assert follow_up.status_code == 200, follow_up.text
    assert follow_up.json()["usage"]["completion_tokens"] == 3
    # The access log says the client left (its stream had started with a 200): the line is
    # the feature, and the follow-up already showed the abort.
    access = one_slot_server.wait_for_line(f"request_id={request_id}", 10)
    assert "POST /v1/chat/completions 499 " in access, access


def test_non_streaming_disconnect_aborts_the_engine_request(one_slot_server: LiveServer) -> None:
    url = one_slot_server.base_url + "/v1/chat/completions"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=ENDLESS, timeout=httpx.Timeout(30, read=0.5))
    follow_up = httpx.post(url, json={**ENDLESS, "max_tokens": 3}, timeout=20)
    assert follow_up.status_code == 200, follow_up.text


def test_stop_sequence_frees_the_slot(one_slot_server: LiveServer) -> None:
    url = one_slot_server.base_url + "/v1/chat/completions"
    body = {
        **ENDLESS,
        "messages": [{"role": "user", "content": "alpha beta gamma"}],
        "stop": ["beta"],
    }
    done = httpx.post(url, json=body, timeout=20)
    assert done.json()["choices"][0]["message"]["content"] == "alpha "
    follow_up = httpx.post(url, json={**ENDLESS, "max_tokens": 3}, timeout=20)
    assert follow_up.status_code == 200, follow_up.text


@pytest.mark.parametrize("api_servers", API_SERVER_COUNTS)
def test_burst_over_capacity(api_servers: int) -> None:
    with LiveServer(
        "--ep",
        "2",
        "--dp",
        "2",
        "--max-num-seqs",
        "2",
        "--max-queued-requests",
        "1",
        "--sim-itl-ms",
        "20",
        api_servers=api_servers,
    ) as server:
        capacity = 2 * 2 + 1

        async def burst() -> list[int]:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
                body = {**ENDLESS, "max_tokens": 40}
                responses = await asyncio.gather(
                    *(http.post("/v1/chat/completions", json=body) for _ in range(capacity + 4))
                )
            return [r.status_code for r in responses]

        statuses = asyncio.run(burst())
        assert statuses.count(200) == capacity
        assert statuses.count(429) == 4


def test_request_timeout() -> None:
    with LiveServer("--request-timeout", "1", "--sim-itl-ms", "20") as server:
        url = server.base_url + "/v1/chat/completions"
        response = httpx.post(url, json=ENDLESS, timeout=30)
        assert response.status_code == 408
        assert response.json()["error"]["code"] == "request_timeout"
        with httpx.stream("POST", url, json={**ENDLESS, "stream": True}, timeout=30) as stream:
            events = list(sse_events(stream))
        assert events[-1] == "[DONE]"
        error = events[-2]
        assert isinstance(error, dict) and error["error"]["code"] == "request_timeout"  # type: ignore[index]
        follow_up = httpx.post(url, json={**ENDLESS, "max_tokens": 3}, timeout=20)
        assert follow_up.status_code == 200


def test_queue_timeout_is_429_and_leaves_the_engine() -> None:
    """A request queued behind the one running sequence past --queue-timeout ends with 429
    queue_timeout (an error event once its stream started); the engine drops it."""
    args = ("--max-num-seqs", "1", "--queue-timeout", "1", "--sim-itl-ms", "20")
    with LiveServer(*args) as server:
        url = server.base_url + "/v1/chat/completions"
        with httpx.stream("POST", url, json={**ENDLESS, "stream": True}, timeout=30) as holding:
            running = sse_events(holding)
            next(running)  # the role chunk
            next(running)  # a token: this one started within the queue timeout
            queued = httpx.post(url, json={**ENDLESS, "max_tokens": 5}, timeout=30)
            assert queued.status_code == 429, queued.text
            assert queued.json()["error"]["code"] == "queue_timeout"
            assert int(queued.headers["retry-after"]) >= 1
            body = {**ENDLESS, "max_tokens": 5, "stream": True}
            with httpx.stream("POST", url, json=body, timeout=30) as stream:
                events = list(sse_events(stream))
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["code"] == "queue_timeout"  # type: ignore[index]
            token = next(running)  # the running request goes on: a token, not an error
            assert isinstance(token, dict) and "choices" in token, token
        # The queued requests left the engine: the next one runs at once, alone.
        follow_up = httpx.post(url, json={**ENDLESS, "max_tokens": 3}, timeout=20)
        assert follow_up.status_code == 200, follow_up.text


@pytest.mark.parametrize("api_servers", API_SERVER_COUNTS)
def test_rank_killed_mid_stream_fails_the_service(api_servers: int) -> None:
    with LiveServer(
        "--ep", "2", "--dp", "2", "--sim-itl-ms", "20", api_servers=api_servers
    ) as server:
        ranks = server.rank_processes()
        api_processes = server.api_processes()
        assert len(api_processes) == (api_servers if api_servers > 1 else 0)
        assert len(ranks) == 2
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "again"}],
            max_tokens=3000,
            stream=True,
            extra_body={"ignore_eos": True, **NO_THINKING},
        )
        next(iter(stream))
        ranks[1].kill()
        with pytest.raises(openai.APIError) as excinfo:
            for _ in stream:
                pass
        assert "rank" in str(excinfo.value)
        for health in server.on_every_api_server("GET", "/health").values():
            assert health.status_code == 503
            assert "DP rank 1" in health.json()["reason"]
        refusals = server.on_every_api_server("POST", "/v1/chat/completions", json=ENDLESS)
        for refused in refusals.values():
            assert refused.status_code == 503
            assert refused.json()["error"]["type"] == "service_unavailable"
        pids = [p.pid for p in [*ranks, *api_processes]]
        assert server.stop(signal.SIGTERM) == 0
        _assert_no_processes(pids)


@pytest.mark.parametrize("api_servers", API_SERVER_COUNTS)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_everything(sig: signal.Signals, api_servers: int) -> None:
    with LiveServer(
        "--ep", "2", "--dp", "2", "--sim-itl-ms", "20", api_servers=api_servers
    ) as server:
        pids = [p.pid for p in [*server.rank_processes(), *server.api_processes()]]
        assert len(pids) == 2 + (api_servers if api_servers > 1 else 0)
        url = server.base_url + "/v1/chat/completions"
        with httpx.stream("POST", url, json={**ENDLESS, "stream": True}, timeout=30) as stream:
            events = sse_events(stream)
            next(events)
            server.process.send_signal(sig)
            rest = list(events)
        assert rest[-1] == "[DONE]"
        assert isinstance(rest[-2], dict) and "error" in rest[-2]
        assert server.process.wait(30) == 0
        _assert_no_processes(pids)
        assert "[shutdown] done" in server.log


@pytest.mark.parametrize("api_servers", API_SERVER_COUNTS)
def test_a_killed_server_leaves_no_process_behind(api_servers: int) -> None:
    with LiveServer("--ep", "2", "--dp", "2", api_servers=api_servers) as server:
        pids = [p.pid for p in [*server.rank_processes(), *server.api_processes()]]
        server.process.kill()
        server.process.wait(10)
        # Other processes' exits (the ranks are not the test's children): polled.
        wait_until(lambda: not _alive(pids), 15, "every process of the server exited")


@pytest.mark.parametrize("api_servers", API_SERVER_COUNTS)
def test_rank_that_fails_to_start_ends_the_server(api_servers: int) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepinfer_server",
            "--engine",
            "simulated",
            "--port",
            "0",
            "--ep",
            "2",
            "--dp",
            "2",
            "--sim-fault",
            "startup",
            "--sim-fault-rank",
            "1",
            "--api-server-count",
            str(api_servers),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "start-up failure" in result.stderr
    assert "ready (EP=" not in result.stderr  # the start-up line: it never served


@pytest.mark.parametrize("api_servers", API_SERVER_COUNTS)
def test_engine_error_in_step_fails_the_service(api_servers: int) -> None:
    with LiveServer(
        "--sim-fault", "step-error", "--sim-fault-after-steps", "3", api_servers=api_servers
    ) as server:
        response = httpx.post(server.base_url + "/v1/chat/completions", json=ENDLESS, timeout=30)
        assert response.status_code == 503
        assert "simulated engine failure" in response.json()["error"]["message"]
        for health in server.on_every_api_server("GET", "/health").values():
            assert health.status_code == 503
            assert "simulated engine failure" in health.json()["reason"]


def test_a_supervisor_whose_api_processes_fail_to_start_stops_its_ranks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With --api-server-count 2, the ranks start before the API server processes; when
    spawning those fails, the ranks must go too, or they outlive the failed server."""
    from deepinfer_server.cli import parse_config
    from deepinfer_server.server.startup import prepare
    from deepinfer_server.server.supervisor import Supervisor, supervise

    config = parse_config(
        [
            *("--engine", "simulated", "--api-server-count", "2", "--dp", "2"),
            *("--host", "127.0.0.1", "--port", "0", "--state-dir", str(tmp_path)),
        ]
    )

    async def spawn_fails(self: Supervisor, *args: object) -> None:
        raise OSError("cannot spawn an API server process")

    monkeypatch.setattr(Supervisor, "start_workers", spawn_fails)
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    try:
        with pytest.raises(OSError, match="cannot spawn"):
            asyncio.run(supervise(config, prepare(config)))
        left = [
            child
            for child in psutil.Process().children(recursive=True)
            if child.pid not in before
            and child.is_running()
            and child.status() != psutil.STATUS_ZOMBIE
            # multiprocessing's resource tracker serves this test process, not the server.
            and not any("resource_tracker" in part for part in child.cmdline())
        ]
        assert left == [], [child.cmdline() for child in left]
    finally:
        for child in psutil.Process().children(recursive=True):
            if child.pid not in before and "resource_tracker" not in " ".join(child.cmdline()):
                child.kill()
