"""The Responses store with real processes: one SQLite file shared by two API server processes,
surviving a restart of the server; one PostgreSQL database shared by two replicas."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.postgres import PostgresServer
from tests.server import LiveServer

MODEL = "deepseek-flash"
FAST = ("--sim-ttft-ms", "5", "--sim-itl-ms", "1", "--max-model-len", "4096")


def _client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_the_store_is_shared_by_api_processes_and_survives_a_restart(tmp_path: Path) -> None:
    state = ("--state-dir", str(tmp_path))
    with LiveServer(*FAST, *state, api_servers=2) as server, _client(server) as client:
        first = client.responses.create(model=MODEL, input="Remember PELICAN")
        assert first.store is True
        # Every API server process reads what one of them stored.
        answers = server.on_every_api_server("GET", f"/v1/responses/{first.id}")
        assert {index: r.status_code for index, r in answers.items()} == {0: 200, 1: 200}
        assert all(r.json()["output"] == first.model_dump()["output"] for r in answers.values())
        second = client.responses.create(
            model=MODEL, input="And OSPREY", previous_response_id=first.id
        )
        assert server.stop() == 0
    assert (tmp_path / "responses.sqlite3").exists()

    with LiveServer(*FAST, *state, api_servers=2) as server, _client(server) as client:
        assert client.responses.retrieve(second.id).output_text == second.output_text
        third = client.responses.create(
            model=MODEL, input="What did I say?", previous_response_id=second.id
        )
        assert third.previous_response_id == second.id
        items = list(client.responses.input_items.list(first.id))
        assert [item.content[0].text for item in items] == ["Remember PELICAN"]  # type: ignore[union-attr]
        # Each turn's prompt holds the whole history before it.
        assert first.usage is not None and second.usage is not None and third.usage is not None
        assert third.usage.input_tokens > second.usage.input_tokens > first.usage.input_tokens


@pytest.mark.postgres
def test_replicas_share_a_postgres_store() -> None:
    """Two servers (replicas behind a router) on one PostgreSQL database: a conversation started
    on one continues on the other."""
    database = PostgresServer()
    try:
        store = ("--response-store", database.new_database())
        with (
            LiveServer(*FAST, *store) as one,
            LiveServer(*FAST, *store) as two,
            _client(one) as first_client,
            _client(two) as second_client,
        ):
            first = first_client.responses.create(model=MODEL, input="Remember HERON")
            second = second_client.responses.create(
                model=MODEL, input="And EGRET", previous_response_id=first.id
            )
            assert second.previous_response_id == first.id
            assert first_client.responses.retrieve(second.id).output_text == second.output_text
            assert "Responses store: postgresql://" in one.log
    finally:
        database.close()
