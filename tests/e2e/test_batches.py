"""Batches with real processes and the official openai client: a kill -9 of the server in the
middle of a batch, and a restart on the same store that finishes it with every line answered
once (the lines recorded before the kill are kept as they were, none is answered twice); two
replicas on one PostgreSQL database working through one batch together, no line run twice."""

from __future__ import annotations

import io
import signal
import sqlite3
from pathlib import Path

import openai
import orjson
import pytest

from tests.metrics_scrape import scrape, value
from tests.postgres import PostgresServer
from tests.server import LiveServer, wait_until

MODEL = "deepseek-flash"
#: The simulated model echoes the input, 20 ms a token: each line takes about half a second.
SLOW = ("--sim-ttft-ms", "5", "--sim-itl-ms", "20", "--batch-concurrency", "2")
LINES = 12


def _client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _input(lines: int) -> bytes:
    words = " ".join(f"word{index}" for index in range(20))
    return b"".join(
        orjson.dumps(
            {
                "custom_id": f"line-{n}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"{n} {words}"}],
                    "max_tokens": 24,
                },
            }
        )
        + b"\n"
        for n in range(lines)
    )


def _answered(tmp_path: Path, batch_id: str) -> dict[int, str]:
    """The lines recorded in the store so far, with their results as stored."""
    with sqlite3.connect(tmp_path / "responses.sqlite3", timeout=5) as db:
        rows = db.execute(
            "SELECT line, result FROM batch_lines WHERE batch_id = ? AND status != 'pending'",
            (batch_id,),
        ).fetchall()
    return {int(line): str(result) for line, result in rows}


def test_a_batch_killed_midway_finishes_after_a_restart_with_every_line_answered_once(
    tmp_path: Path,
) -> None:
    state = ("--state-dir", str(tmp_path))
    data = _input(LINES)
    with LiveServer(*SLOW, *state) as server, _client(server) as client:
        upload = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        batch = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        wait_until(lambda: len(_answered(tmp_path, batch.id)) >= 3, 60, "three lines answered")
        server.stop(signal.SIGKILL)
    before = _answered(tmp_path, batch.id)
    assert len(before) < LINES
    with LiveServer(*SLOW, *state) as server, _client(server) as client:
        # The lines the killed server held are claimed again once their lease has passed.
        wait_until(
            lambda: client.batches.retrieve(batch.id).status == "completed",
            90,
            "the batch to complete after the restart",
        )
        done = client.batches.retrieve(batch.id)
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed) == (LINES, LINES)
        assert done.output_file_id is not None and done.error_file_id is None
        output = [
            orjson.loads(line)
            for line in client.files.content(done.output_file_id).text.splitlines()
        ]
    assert sorted(line["custom_id"] for line in output) == sorted(f"line-{n}" for n in range(LINES))
    after = _answered(tmp_path, batch.id)
    assert all(after[line] == result for line, result in before.items())  # never answered again
    for line in output:
        assert line["response"]["status_code"] == 200
        assert line["response"]["body"]["choices"][0]["message"]["content"]


@pytest.mark.postgres
def test_two_replicas_work_through_one_batch_without_running_a_line_twice() -> None:
    database = PostgresServer()
    try:
        store = ("--response-store", database.new_database())
        with (
            LiveServer(*SLOW, *store) as one,
            LiveServer(*SLOW, *store) as two,
            _client(one) as client,
        ):
            upload = client.files.create(
                file=("in.jsonl", io.BytesIO(_input(LINES))), purpose="batch"
            )
            batch = client.batches.create(
                input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            wait_until(
                lambda: client.batches.retrieve(batch.id).status == "completed",
                90,
                "the batch to complete",
            )
            done = client.batches.retrieve(batch.id)
            assert done.request_counts is not None and done.request_counts.completed == LINES
            answered = [
                value(scrape(server.base_url), "deepinfer:batch_lines_finished_total", result=r)
                for server in (one, two)
                for r in ("succeeded", "errored")
            ]
            generated = [
                count
                for server in (one, two)
                for (name, _), count in scrape(server.base_url).items()
                if name == "deepinfer:request_success_total"
            ]
        assert sum(answered) == LINES
        assert answered[0] > 0 and answered[2] > 0  # both replicas answered lines
        assert sum(generated) == LINES  # no line went to the engine twice
    finally:
        database.close()
