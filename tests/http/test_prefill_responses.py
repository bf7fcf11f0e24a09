"""Responses on a prefill server (`--disaggregation-mode prefill`), as a PD gateway sends them.

smg re-serialises every Responses body it forwards with `store: true` (OpenAI's default), so
a prefill server takes the store fields: it stores nothing (its one-token answer is the start
of one the decode server gives and stores) and reads the history of `previous_response_id`
from the store the decode servers write. Without a store it says which option it runs with.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from deepinfer_server.store.location import open_store
from deepinfer_server.store.responses import ResponseStore
from tests.conftest import MODEL
from tests.http.agent_harness import last_prompt
from tests.http.harness import Harness, Script, run, serve
from tests.paths import PD_SECRET_ARGS

PREFILL = (*PD_SECRET_ARGS, "--disaggregation-mode", "prefill")


@asynccontextmanager
async def shared_store(tmp_path: Path) -> AsyncIterator[ResponseStore]:
    """One SQLite store, as a prefill server and its decode servers share it."""
    store = open_store(f"sqlite://{tmp_path / 'responses.sqlite3'}", ttl=3600, max_bytes=2**30)
    await store.open()
    try:
        yield store
    finally:
        await store.close()


def test_store_true_is_taken_and_nothing_is_stored(tmp_path: Path) -> None:
    async def body() -> None:
        async with (
            shared_store(tmp_path) as store,
            serve(*PREFILL, script=Script("Hello back"), store=store) as h,
        ):
            request = {"model": MODEL, "input": "Hi", "store": True, "max_output_tokens": 1}
            response = await h.client.post("/v1/responses", json=request)
            assert response.status_code == 200, response.text
            found = await h.client.get(f"/v1/responses/{response.json()['id']}")
            assert found.status_code == 404, found.text

    run(body)


def test_previous_response_id_is_read_from_the_decode_servers_store(tmp_path: Path) -> None:
    async def body() -> None:
        async with shared_store(tmp_path) as store:
            async with serve(script=Script("The sea is wide"), store=store) as decode:
                first = await decode.client.post(
                    "/v1/responses", json={"model": MODEL, "input": "Tell me about the sea"}
                )
                assert first.status_code == 200, first.text
            async with serve(*PREFILL, script=Script("And"), store=store) as prefill:
                second = {
                    "model": MODEL,
                    "input": "And the sky?",
                    "previous_response_id": first.json()["id"],
                    "store": True,
                    "max_output_tokens": 1,
                }
                answer = await prefill.client.post("/v1/responses", json=second)
                assert answer.status_code == 200, answer.text
                prompt = last_prompt(prefill.coordinator)
                assert "Tell me about the sea" in prompt and "The sea is wide" in prompt
                assert "And the sky?" in prompt
                missing = {**second, "previous_response_id": "resp_elsewhere"}
                unknown = await prefill.client.post("/v1/responses", json=missing)
                assert unknown.status_code == 400, unknown.text  # as OpenAI answers it
                error = unknown.json()["error"]
                assert error["param"] == "previous_response_id"
                assert "give it the decode servers' --response-store" in error["message"]

    run(body)


async def _refused(h: Harness, extra: dict[str, object]) -> dict[str, str]:
    request = {"model": MODEL, "input": "Hi", "max_output_tokens": 1, **extra}
    response = await h.client.post("/v1/responses", json=request)
    assert response.status_code == 400, response.text
    error: dict[str, str] = response.json()["error"]
    return error


def test_without_a_store_store_is_taken_and_history_names_the_option() -> None:
    async def body() -> None:
        async with serve(*PREFILL, script=Script("Hello back")) as h:
            request = {"model": MODEL, "input": "Hi", "store": True, "max_output_tokens": 1}
            response = await h.client.post("/v1/responses", json=request)
            assert response.status_code == 200, response.text
            error = await _refused(h, {"previous_response_id": "resp_1"})
            assert error["param"] == "previous_response_id"
            assert "this prefill server has none (--response-store none)" in error["message"]
            error = await _refused(h, {"conversation": "conv_1"})
            assert error["param"] == "conversation"
            error = await _refused(h, {"background": True})
            assert error["param"] == "background"
            assert "a prefill server runs no background responses" in error["message"]
            assert (await _refused(h, {"store": "yes"}))["param"] == "store"

    run(body)
