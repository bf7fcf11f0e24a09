"""A request is prepared off the event loop by what it prepares, not by its body: a turn of a
few bytes that continues a stored conversation of megabytes (or a `previous_response_id` chain)
is expanded and prepared on a preparation worker, while another key's requests are answered."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx

from deepinfer_server.protocol.responses.stored import with_id
from deepinfer_server.services.store_scope import key_scope
from deepinfer_server.store.records import NewResponse
from tests.http.harness import MODEL, Harness
from tests.http.test_stored_responses import KEY_A, KEY_B, run_stored
from tests.loop_lag import LoopLag

RESPONSES = "/v1/responses"
#: One stored item of 3.8 MB, as in the report that a follow-up turn froze every key.
BIG_TEXT = "word " * 760_000
KEYS = ("--api-key", KEY_A, "--api-key", KEY_B)


def _as(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _message(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


async def _while_probed(h: Harness, heavy: dict[str, Any]) -> httpx.Response:
    """`heavy` sent as KEY_A under the loop-lag probe, with KEY_B's small requests alongside
    (each answered); the heavy request's response."""
    gate, prepared_off_loop = h.state.preparation, []
    run = gate.run

    async def counted(*args: Any, **kwargs: Any) -> Any:
        prepared_off_loop.append(kwargs["key"])
        return await run(*args, **kwargs)

    gate.run = counted  # type: ignore[method-assign]
    async with LoopLag() as lag:
        sent = asyncio.ensure_future(h.client.post(RESPONSES, json=heavy, headers=_as(KEY_A)))
        others = [
            await h.client.post(
                RESPONSES, json={"model": MODEL, "input": "hi", "store": False}, headers=_as(KEY_B)
            )
            for _ in range(3)
        ]
        response = await sent
    assert [other.status_code for other in others] == [200, 200, 200]
    assert len(prepared_off_loop) == 1  # the heavy request's, not the small ones'
    lag.check()
    assert lag.wakes > 0
    return response


def test_a_short_turn_of_a_large_conversation_is_prepared_off_the_loop(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        created = await h.client.post(
            "/v1/conversations", json={"items": [_message(BIG_TEXT)]}, headers=_as(KEY_A)
        )
        assert created.status_code == 200, created.text
        turn = {"model": MODEL, "input": "next", "conversation": created.json()["id"]}
        response = await _while_probed(h, turn)
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "context_length_exceeded"
        assert h.state.preparation.pending == 0

    run_stored(tmp_path, test, *KEYS)


async def _store_large_response(h: Harness) -> tuple[str, str]:
    """A stored response of KEY_A whose input is one 3.8 MB item: its ID and the item's."""
    store = h.state.store
    assert store is not None
    scope = key_scope(await store.scope_salt(), KEY_A.encode())
    item = with_id(_message(BIG_TEXT))
    body = {"id": "resp_large", "object": "response", "status": "completed", "output": []}
    await store.save(NewResponse("resp_large", scope, time.time(), body, [item]))
    return "resp_large", str(item["id"])


def test_a_short_turn_continuing_a_large_stored_response_is_prepared_off_the_loop(
    tmp_path: Path,
) -> None:
    async def test(h: Harness) -> None:
        previous, _ = await _store_large_response(h)
        turn = {"model": MODEL, "input": "next", "previous_response_id": previous}
        response = await _while_probed(h, turn)
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "context_length_exceeded"

    run_stored(tmp_path, test, *KEYS)


def test_a_reference_to_a_large_stored_item_is_prepared_off_the_loop(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        _, item_id = await _store_large_response(h)
        turn = {
            "model": MODEL,
            "store": False,
            "input": [{"type": "item_reference", "id": item_id}],
        }
        response = await _while_probed(h, turn)
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "context_length_exceeded"

    run_stored(tmp_path, test, *KEYS)
