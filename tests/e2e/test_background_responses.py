"""Background responses with real processes and the official openai client: a stream resumed
from every API server process of a server sharing one SQLite store (and one left running at a
stop marked failed), a kill -9 of the server mid-stream (after the restart the response is
failed and its stream resumes to that end, with no gap and no duplicate), and two replicas on
one PostgreSQL database resuming and cancelling each other's."""

from __future__ import annotations

import signal
import sqlite3
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from deepinfer_server.services.background import SHUTDOWN_MESSAGE
from tests.postgres import PostgresServer
from tests.server import LiveServer, wait_until

MODEL = "deepseek-flash"
#: The simulated model echoes the input: a long input is a long answer (20 ms a token).
SLOW = ("--sim-ttft-ms", "5", "--sim-itl-ms", "20", "--max-model-len", "4096")
LONG_INPUT = " ".join(f"word{index}" for index in range(400))


def _client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _sse_events(text: str) -> list[dict[str, Any]]:
    return [
        orjson.loads(line[len("data: ") :])
        for line in text.splitlines()
        if line.startswith("data: ")
    ]


def _start_stream(client: openai.OpenAI, events: int) -> tuple[str, list[Any]]:
    """A background stream left after its first `events` events: its ID and those events."""
    seen = []
    with client.responses.create(
        model=MODEL, input=LONG_INPUT, background=True, stream=True
    ) as stream:
        for event in stream:
            seen.append(event)
            if len(seen) == events:
                break
    return seen[0].response.id, seen


def test_every_api_server_resumes_a_background_stream_and_a_stop_marks_the_rest_failed(
    tmp_path: Path,
) -> None:
    state = ("--state-dir", str(tmp_path), "--shutdown-timeout", "1")
    with LiveServer(*SLOW, *state, api_servers=2) as server, _client(server) as client:
        response_id, seen = _start_stream(client, 8)
        after = seen[-1].sequence_number
        path = f"/v1/responses/{response_id}?stream=true&starting_after={after}"
        answers = server.on_every_api_server("GET", path)
        for index, answer in answers.items():
            rest = _sse_events(answer.text)
            numbers = [event.sequence_number for event in seen] + [
                event["sequence_number"] for event in rest
            ]
            assert numbers == list(range(len(numbers))), index
            assert rest[-1]["type"] == "response.completed", index
        done = client.responses.retrieve(response_id)
        assert done.status == "completed" and done.background is True
        assert "word399" in done.output_text
        # One still running when the server stops (SIGTERM) past its drain is marked failed.
        running, _ = _start_stream(client, 4)
        assert server.stop() == 0
    with sqlite3.connect(tmp_path / "responses.sqlite3") as db:
        (body,) = db.execute("SELECT body FROM responses WHERE id = ?", (running,)).fetchone()
    stopped = orjson.loads(body)
    assert stopped["status"] == "failed"
    assert stopped["error"] == {"code": "server_error", "message": SHUTDOWN_MESSAGE}


def test_a_kill_mid_stream_marks_it_failed_and_the_stream_resumes_to_that_end(
    tmp_path: Path,
) -> None:
    state = ("--state-dir", str(tmp_path))
    with LiveServer(*SLOW, *state) as server, _client(server) as client:
        response_id, seen = _start_stream(client, 12)
        wait_until(
            lambda: client.responses.retrieve(response_id).status == "in_progress",
            10,
            "the response to be in progress",
        )
        server.stop(signal.SIGKILL)
    with LiveServer(*SLOW, *state) as server, _client(server) as client:
        # Failed once its lease has passed without a renewal, by the first process to look.
        wait_until(
            lambda: client.responses.retrieve(response_id).status == "failed",
            30,
            "the killed run to be marked failed",
        )
        failed = client.responses.retrieve(response_id)
        assert failed.error is not None and failed.error.code == "server_error"
        after = seen[-1].sequence_number
        rest = list(client.responses.retrieve(response_id, stream=True, starting_after=after))
    numbers = [event.sequence_number for event in seen + rest]
    assert numbers == list(range(len(numbers)))  # no gap, no duplicate
    assert rest[-1].type == "response.failed"


@pytest.mark.postgres
def test_a_replica_resumes_and_cancels_what_another_runs_on_postgres() -> None:
    """Two servers (replicas behind a router) on one PostgreSQL database: one runs a background
    stream, the other resumes it to its end, then cancels a second one the first runs."""
    database = PostgresServer()
    try:
        store = ("--response-store", database.new_database())
        with (
            LiveServer(*SLOW, *store) as one,
            LiveServer(*SLOW, *store) as two,
            _client(one) as first_client,
            _client(two) as second_client,
        ):
            response_id, seen = _start_stream(first_client, 6)
            after = seen[-1].sequence_number
            rest = list(
                second_client.responses.retrieve(response_id, stream=True, starting_after=after)
            )
            numbers = [event.sequence_number for event in seen + rest]
            assert numbers == list(range(len(numbers)))
            assert rest[-1].type == "response.completed"
            running, _ = _start_stream(first_client, 2)
            cancelled = second_client.responses.cancel(running)
            assert cancelled.status == "cancelled"
            assert first_client.responses.retrieve(running).status == "cancelled"
    finally:
        database.close()
