"""--api-server-count 2 with one API server process stuck: it fails alone (the other's streams
flow on), then the supervisor kills it and fails the service, naming it."""

from __future__ import annotations

import contextlib
import os
import signal

import httpx
import psutil

from tests.e2e.test_api_servers import _hold_one_on_each_api_server
from tests.server import LiveServer


def _api_server_pid(server: LiveServer, index: int) -> int:
    # Only the supervisor's start-up line maps a process number to its pid.
    line = server.wait_for_line(f"API server process {index} started as pid", timeout=10)
    return int(line.rsplit(" ", 1)[1])


def test_a_stopped_api_server_process_fails_alone() -> None:
    """SIGSTOP one API process: the ranks' sends to it back up, and the other process's
    streams flow on regardless; then the supervisor kills the stopped one and fails the
    service, naming it (a lost process loses its requests: the service must be restarted)."""
    # A rank sends the stopped process one message a step, and its socket is full after about
    # 200 (the kernel counts each small message at about 1 KB): at 2 ms a step that is under
    # half a second, where 10 ms steps on a loaded machine took most of the supervisor's 10 s,
    # which then killed the process before the rank had anything waiting to log. 20000 tokens
    # at 2 ms: each stream outlasts the supervisor's bound by far.
    with LiveServer("--sim-itl-ms", "2", "--log-level", "debug", api_servers=2) as server:
        healthy, stopped = _hold_one_on_each_api_server(server, {"max_tokens": 20000})
        pid = _api_server_pid(server, stopped.api_server)
        os.kill(pid, signal.SIGSTOP)
        try:
            # The rank's socket to the stopped process is full and the rank goes on (only the
            # rank's line tells: the service stays healthy until the supervisor acts) ...
            server.wait_for_line(
                f"API server process {stopped.api_server} has read nothing", timeout=30
            )
            # ... so the healthy process's stream keeps its tokens coming.
            for _ in range(50):
                event = next(healthy.events)
                assert isinstance(event, dict) and "choices" in event, event
            # The supervisor's verdict names the process and its pid: the line is checked.
            line = server.wait_for_line("answered the supervisor's pings", timeout=30)
            assert f"API server process {stopped.api_server} (pid {pid})" in line
            psutil.Process(pid).wait(10)  # killed (raises while it lives on)
            ending = [e for e in healthy.events if isinstance(e, dict) and "error" in e]
            assert f"API server process {stopped.api_server}" in ending[0]["error"]["message"]
            health = httpx.get(server.base_url + "/health", timeout=10)
            assert health.status_code == 503
            assert f"API server process {stopped.api_server}" in health.json()["reason"]
            assert "DP rank" not in health.json()["reason"]
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
            healthy.close()
            stopped.close()
        assert server.stop() == 0
