"""--api-server-count 2 end to end: what must be global across the API server processes is.

Which process takes a connection is the kernel's choice, so these tests find out from the log
(the debug line of each submitted request and the access log name the process) and open fresh
connections until each process has what the test needs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from deepinfer_server.protocol.core.reasoning_seal import ReasoningSeal
from deepinfer_server.protocol.responses.reasoning import conversation_digest
from tests.conftest import ENDLESS
from tests.metrics_scrape import Samples, parse_metrics, scrape, value
from tests.server import LiveServer, wait_until
from tests.sse import sse_events


@pytest.fixture(scope="module")
def two_api_servers() -> Iterator[LiveServer]:
    """Two API server processes, DP=2, one running sequence per rank: capacity 2."""
    with LiveServer(
        "--ep",
        "2",
        "--dp",
        "2",
        "--max-num-seqs",
        "1",
        "--max-queued-requests",
        "0",
        "--sim-itl-ms",
        "5",
        "--sim-ttft-ms",
        "2",
        "--log-level",
        "debug",
        api_servers=2,
    ) as server:
        yield server


class _Held:
    """A streaming request kept open on a connection of its own."""

    def __init__(
        self,
        server: LiveServer,
        request_id: str,
        extra: dict[str, object],
        headers: dict[str, str] | None = None,
    ) -> None:
        self.request_id = request_id
        self.client = httpx.Client(base_url=server.base_url, timeout=30)
        request = self.client.build_request(
            "POST",
            "/v1/chat/completions",
            json={**ENDLESS, "stream": True, **extra},
            headers={"X-Request-Id": request_id, **(headers or {})},
        )
        self.response = self.client.send(request, stream=True)
        assert self.response.status_code == 200
        self.events = sse_events(self.response)
        next(self.events)
        # Which process and rank took it: only the debug routing line tells (its first token
        # came, so the line was written).
        line = server.wait_for_line(f"request chatcmpl-{request_id}-", timeout=10)
        api = re.search(r"\[api (\d+)\]", line)
        rank = re.search(r"to DP rank (\d+)", line)
        assert api is not None and rank is not None, line
        self.api_server, self.rank = int(api.group(1)), int(rank.group(1))

    def close(self) -> None:
        self.response.close()
        self.client.close()


def _hold_one_on_each_api_server(
    server: LiveServer,
    extra: dict[str, object] | None = None,
    headers: dict[str, str] | None = None,
    prefix: str = "hold",
) -> list[_Held]:
    """One stream held open on each of the two API server processes (`extra` joins each
    request's body, `headers` its headers)."""
    held: dict[int, _Held] = {}
    for attempt in range(30):
        stream = _Held(server, f"{prefix}-{attempt}", extra or {}, headers)
        if stream.api_server in held:
            stream.close()  # the same process again: try another connection
        else:
            held[stream.api_server] = stream
        if len(held) == 2:
            return list(held.values())
    raise AssertionError("the kernel never gave the second API server process a connection")


def test_admission_and_rank_choice_are_global(two_api_servers: LiveServer) -> None:
    held = _hold_one_on_each_api_server(two_api_servers)
    try:
        # Each process holds one request, under capacity 2 on its own: only shared counts
        # send the second request to the other rank and refuse a third in both processes.
        assert sorted(h.rank for h in held) == [0, 1]
        refusals = two_api_servers.on_every_api_server(
            "POST", "/v1/chat/completions", json={**ENDLESS, "max_tokens": 3}
        )
        for refused in refusals.values():
            assert refused.status_code == 429
            assert int(refused.headers["retry-after"]) >= 1
        loads = two_api_servers.on_every_api_server("GET", "/get_load", params={"format": "sglang"})
        for load in loads.values():
            assert [rank["num_reqs"] for rank in load.json()] == [1, 1]
    finally:
        for stream in held:
            stream.close()


def test_a_slot_freed_in_one_process_starts_the_request_due_in_the_other(
    tmp_path: Path,
) -> None:
    """Fair admission across processes: a heavy key's streams hold both running slots (one
    per process) and a light key's request waits; when the heavy stream of the process that
    does not hold the light request ends, that process wakes the other to start it."""
    keys = tmp_path / "keys"
    keys.write_text("heavy sk-e2e-heavy-1\nlight sk-e2e-light-2\n")
    heavy = {"Authorization": "Bearer sk-e2e-heavy-1"}
    light = {"Authorization": "Bearer sk-e2e-light-2"}
    args = ("--max-num-seqs", "2", "--key-running-share", "1", "--api-key-file", str(keys))
    woken = False
    with LiveServer(*args, "--sim-itl-ms", "5", "--log-level", "debug", api_servers=2) as server:
        for attempt in range(10):
            held = _hold_one_on_each_api_server(server, headers=heavy, prefix=f"heavy{attempt}")
            request_id = f"light-{attempt}"
            with ThreadPoolExecutor(1) as pool:
                answer = pool.submit(
                    httpx.post,
                    server.base_url + "/v1/chat/completions",
                    json={**ENDLESS, "max_tokens": 2},
                    headers={**light, "X-Request-Id": request_id},
                    timeout=60,
                )

                def queued() -> float:
                    metrics = scrape(server.base_url)
                    return value(metrics, "deepinfer:tenant_requests_queued", tenant="light")

                wait_until(lambda: queued() == 1, 30, "the light key's request queued")
                held[0].close()  # frees a slot in process held[0].api_server
                assert answer.result(timeout=60).status_code == 200
            # It started in the slot freed, not in the other one once its stream ended.
            assert f"request_id={held[1].request_id} " not in server.log
            held[1].close()
            if server.answered_by(request_id) != held[0].api_server:
                woken = True  # it waited in the other process, which was woken
                break
    assert woken, "the light request was never queued in the other process"
    assert "sk-e2e-light-2" not in server.log and "sk-e2e-heavy-1" not in server.log


def test_metrics_count_each_request_once_whichever_process_answers(
    two_api_servers: LiveServer,
) -> None:
    url = two_api_servers.base_url + "/v1/chat/completions"
    before = scrape(two_api_servers.base_url)
    answered_by: set[int] = set()
    requests = 0
    while answered_by != {0, 1}:  # fresh connections until both processes served some
        assert requests < 30, "the kernel gave every request to one API server process"
        request_id = f"counted-{requests}"
        reply = httpx.post(
            url, json={**ENDLESS, "max_tokens": 2}, headers={"X-Request-Id": request_id}, timeout=30
        )
        assert reply.status_code == 200
        answered_by.add(two_api_servers.answered_by(request_id))
        requests += 1
    for response in two_api_servers.on_every_api_server("GET", "/metrics").values():
        after = parse_metrics(response.text)

        def delta(name: str, after: Samples = after, **labels: str) -> float:
            return value(after, name, **labels) - value(before, name, **labels)

        assert delta("deepinfer:request_success_total", finished_reason="length") == requests
        assert delta("deepinfer:generation_tokens_total") == 2 * requests
        assert delta("deepinfer:e2e_request_latency_seconds_count") == requests
        assert value(after, "deepinfer:healthy") == 1  # the same in every process: not summed


def test_every_server_process_encodes_serially(two_api_servers: LiveServer) -> None:
    expected = os.environ.get("TOKENIZERS_PARALLELISM", "false")  # an exported value is kept
    # /proc shows a process's environment as it started: the API server processes (which encode
    # the prompts) and the ranks are started after the supervisor set the variable.
    spawned = [*two_api_servers.api_processes(), *two_api_servers.rank_processes()]
    assert len(spawned) == 4
    for process in spawned:
        assert process.environ().get("TOKENIZERS_PARALLELISM") == expected


def test_a_dead_api_server_process_fails_the_service() -> None:
    with LiveServer("--sim-itl-ms", "20", api_servers=2) as server:
        first, second = server.api_processes()
        first.kill()
        first.wait(10)
        health = server.wait_for_health("failed", timeout=10)
        assert "API server process" in health["reason"]
        # What the operator reads: the log's failure line names the process too.
        assert "API server process" in server.wait_for_line("service failed", timeout=10)
        assert second.is_running()
        assert server.stop() == 0


def _replay_input_tokens(server: LiveServer, blob: str) -> dict[int, int]:
    """Each API server process's prompt size for a Codex-style next turn replaying `blob`."""
    history = [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": blob},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "result"},
    ]
    body = {**REASONING_TURN, "input": history, "tools": [TOOL]}
    answers = server.on_every_api_server("POST", "/v1/responses", json=body)
    return {index: reply.json()["usage"]["input_tokens"] for index, reply in answers.items()}


TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}
REASONING_TURN = {
    "model": "deepseek-flash",
    "input": "hi",
    "store": False,
    "max_output_tokens": 24,
    "include": ["reasoning.encrypted_content"],
    "reasoning": {"effort": "high"},
}


def test_reasoning_sealed_by_one_process_opens_in_the_other(two_api_servers: LiveServer) -> None:
    """Without --reasoning-secret the server makes one key for all its API server processes:
    a blob sealed by either verifies in both (its reasoning reaches the prompt)."""
    sealed = two_api_servers.on_every_api_server("POST", "/v1/responses", json=REASONING_TURN)
    forged = ReasoningSeal.from_secret("not this server's").seal(
        "Some reasoning text here.", conversation_digest("hi")
    )
    ignored = _replay_input_tokens(two_api_servers, forged)
    for sealer, reply in sealed.items():
        (item,) = [i for i in reply.json()["output"] if i["type"] == "reasoning"]
        assert item["encrypted_content"], item
        restored = _replay_input_tokens(two_api_servers, item["encrypted_content"])
        for opener in (0, 1):
            assert restored[opener] > ignored[opener], (sealer, opener, restored, ignored)
