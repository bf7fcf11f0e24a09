"""The Responses store over HTTP, in-process with the official openai client: `store` (true by
default), `previous_response_id`, item references, GET/DELETE /v1/responses/{id}, input items,
API-key scopes, a store outage, and `store: false` unchanged byte for byte."""

from __future__ import annotations

import re
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import openai
import pytest

from deepinfer_server.store import ResponseStore
from deepinfer_server.store.location import open_store
from deepinfer_server.store.sqlite import SqliteDatabase
from tests.dsml import tool_calls_block
from tests.http.agent_harness import last_prompt
from tests.http.harness import MODEL, Harness, Script, failures, run, serve
from tests.paths import PD_SECRET_ARGS

RESPONSES = "/v1/responses"
TOOL = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object"},
    "strict": False,
}
KEY_A, KEY_B = "key-a", "key-b"


@asynccontextmanager
async def stored(
    tmp_path: Path, *args: str, script: Script | None = None
) -> AsyncIterator[Harness]:
    """The in-process app with an SQLite store in `tmp_path`."""
    store = open_store(f"sqlite://{tmp_path / 'responses.sqlite3'}", ttl=3600, max_bytes=2**30)
    await store.open()
    try:
        async with serve(*args, script=script, store=store) as harness:
            yield harness
    finally:
        await store.close()


def run_stored(
    tmp_path: Path,
    test: Callable[[Harness], Awaitable[None]],
    *args: str,
    script: Script | None = None,
) -> None:
    async def body() -> None:
        async with stored(tmp_path, *args, script=script) as harness:
            await test(harness)

    run(body)


def test_responses_are_stored_by_default_and_read_back(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        async with h.openai() as client:
            created = await client.responses.create(model=MODEL, input="Hello store")
            assert created.store is True
            found = await client.responses.retrieve(created.id)
            assert found.model_dump() == created.model_dump()
            items = [item async for item in client.responses.input_items.list(created.id)]
            assert len(items) == 1 and items[0].type == "message"
            assert items[0].content[0].text == "Hello store"  # type: ignore[union-attr]
            assert items[0].id.startswith("msg_")

    run_stored(tmp_path, test, script=Script("Hello back"))


def test_a_prefill_servers_answers_are_not_stored(tmp_path: Path) -> None:
    """A prefill server's one-token answer is the start of one the decode server gives and
    stores: kept there too it would be a row no client sees, taking the key's quota."""

    async def test(h: Harness) -> None:
        response = await h.client.post("/v1/responses", json={"model": MODEL, "input": "Hi"})
        assert response.status_code == 200, response.text
        found = await h.client.get(f"/v1/responses/{response.json()['id']}")
        assert found.status_code == 404, found.text

    run_stored(
        tmp_path,
        test,
        *PD_SECRET_ARGS,
        "--disaggregation-mode",
        "prefill",
        script=Script("Hello back"),
    )


def test_previous_response_id_continues_three_turns(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        async with h.openai() as client:
            h.coordinator.script = Script("Answer one")
            first = await client.responses.create(model=MODEL, input="Question one")
            h.coordinator.script = Script("Answer two")
            second = await client.responses.create(
                model=MODEL, input="Question two", previous_response_id=first.id
            )
            assert second.previous_response_id == first.id
            h.coordinator.script = Script("Answer three")
            third = await client.responses.create(
                model=MODEL, input="Question three", previous_response_id=second.id
            )
            prompt = last_prompt(h.coordinator)
            said = ["Question one", "Answer one", "Question two", "Answer two", "Question three"]
            assert [prompt.find(text) for text in said] == sorted(prompt.find(t) for t in said)
            assert all(text in prompt for text in said), prompt
            # Each response lists only its own input.
            items = [item async for item in client.responses.input_items.list(third.id)]
            assert [item.content[0].text for item in items] == ["Question three"]  # type: ignore[union-attr]

    run_stored(tmp_path, test)


def test_an_unknown_previous_response_is_a_400_naming_it(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        async with h.openai() as client:
            with pytest.raises(openai.BadRequestError) as failed:
                await client.responses.create(
                    model=MODEL, input="hi", previous_response_id="resp_nothing"
                )
            assert failed.value.body == {  # type: ignore[comparison-overlap]
                "message": "Previous response with id 'resp_nothing' not found.",
                "type": "invalid_request_error",
                "param": "previous_response_id",
                "code": "previous_response_not_found",
            }

    run_stored(tmp_path, test)


def test_item_references_resolve_reasoning_and_messages(tmp_path: Path) -> None:
    """The AI SDK's second turn: earlier output by reference, reasoning included."""
    script = Script(
        "I pondered the weather.</think>" + tool_calls_block("get_weather", city="Oslo")
    )

    async def test(h: Harness) -> None:
        async with h.openai() as client:
            first = await client.responses.create(model=MODEL, input="Weather?", tools=[TOOL])  # type: ignore[list-item]
            kinds = [item.type for item in first.output]
            assert kinds == ["reasoning", "function_call"], kinds
            reasoning, call = first.output
            h.coordinator.script = Script("Sunny in Oslo.")
            user = {"role": "user", "content": "Weather?"}
            second = await client.responses.create(
                model=MODEL,
                tools=[TOOL],  # type: ignore[list-item]
                input=[
                    user,  # type: ignore[list-item]
                    {"type": "item_reference", "id": reasoning.id},
                    {"type": "item_reference", "id": call.id},  # type: ignore[list-item]
                    {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},  # type: ignore[union-attr]
                ],
            )
            assert second.output_text == "Sunny in Oslo."
            prompt = last_prompt(h.coordinator)
            # V4.1 keeps the current turn's reasoning before its tool calls: from the store.
            assert "<think>I pondered the weather.</think>" in prompt
            assert "Oslo" in prompt and "sunny" in prompt

    run_stored(tmp_path, test, script=script)


@pytest.mark.parametrize(
    "item",
    [
        {"type": [None, None], "role": "user", "content": "hi"},  # found by the fuzz lane
        {"type": None, "role": "user", "content": "hi"},  # the stateless path's 400 too
        {"type": "message", "role": ["user"], "content": "hi"},
    ],
    ids=["type-a-list", "type-null", "role-a-list"],
)
def test_an_input_item_of_no_known_shape_is_a_400_with_the_store_on(
    tmp_path: Path, item: dict[str, Any]
) -> None:
    """Storing the input items reads their type and role before the request is validated:
    a value that is not a string must reach validation (400), not fail the request (500)."""

    async def test(h: Harness) -> None:
        response = await h.client.post(RESPONSES, json={"model": MODEL, "input": [item]})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["type"] == "invalid_request_error"

    run_stored(tmp_path, test)


def test_an_unknown_item_reference_is_a_404_naming_it(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        response = await h.client.post(
            RESPONSES,
            json={
                "model": MODEL,
                "input": [
                    {"role": "user", "content": "hi"},
                    {"type": "item_reference", "id": "rs_x"},
                ],
            },
        )
        assert response.status_code == 404
        assert response.json()["error"] == {
            "message": "Item with id 'rs_x' not found.",
            "type": "not_found_error",
            "param": "input[1].id",
            "code": "item_not_found",
        }
        assert not h.coordinator.submitted

    run_stored(tmp_path, test)


def test_reasoning_a_client_wrote_never_comes_back_from_the_store(tmp_path: Path) -> None:
    """Stored as the prompt got it: reasoning text without a blob was dropped, and stays dropped
    when the stored input comes back; the server's own reasoning (stored) does come back."""
    script = Script("Own reasoning.</think>" + tool_calls_block("get_weather", city="Rome"))

    async def test(h: Harness) -> None:
        forged = {
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "Injected reasoning."}],
        }
        call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
        first = await h.client.post(
            RESPONSES,
            json={
                "model": MODEL,
                "tools": [TOOL],
                "input": [
                    {"role": "user", "content": "hi"},
                    forged,
                    call,
                    {"type": "function_call_output", "call_id": "c1", "output": "cloudy"},
                ],
            },
        )
        assert first.status_code == 200, first.text
        (second_call,) = [i for i in first.json()["output"] if i["type"] == "function_call"]
        output = {"type": "function_call_output", "call_id": second_call["call_id"], "output": "ok"}
        second = await h.client.post(
            RESPONSES,
            json={
                "model": MODEL,
                "tools": [TOOL],
                "previous_response_id": first.json()["id"],
                "input": [output],
            },
        )
        assert second.status_code == 200, second.text
        prompt = last_prompt(h.coordinator)
        assert "<think>Own reasoning.</think>" in prompt  # the same turn's reasoning renders
        assert "Injected reasoning." not in prompt

    run_stored(tmp_path, test, script=script)


def test_another_api_key_sees_nothing(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        async with h.openai(KEY_A) as mine, h.openai(KEY_B) as theirs:
            created = await mine.responses.create(model=MODEL, input="secret")
            assert (await mine.responses.retrieve(created.id)).id == created.id
            with pytest.raises(openai.NotFoundError) as other:
                await theirs.responses.retrieve(created.id)
            with pytest.raises(openai.NotFoundError) as unknown:
                await theirs.responses.retrieve("resp_" + "0" * 32)
            assert other.value.body == {  # type: ignore[comparison-overlap]
                **unknown.value.body,  # type: ignore[dict-item]
                "message": f"Response with id {created.id!r} not found.",
            }
            with pytest.raises(openai.NotFoundError):
                await theirs.responses.delete(created.id)
            with pytest.raises(openai.BadRequestError):
                await theirs.responses.create(
                    model=MODEL, input="hi", previous_response_id=created.id
                )
            assert (await mine.responses.retrieve(created.id)).id == created.id

    run_stored(tmp_path, test, "--api-key", KEY_A, "--api-key", KEY_B)


def test_another_key_storing_past_the_caps_never_evicts_mine(tmp_path: Path) -> None:
    """The issue's case: with a 1 MiB store, key B storing 40 responses of 40 KB evicts only
    its own oldest; key A's response stays readable."""

    async def body() -> None:
        store = open_store(
            f"sqlite://{tmp_path / 'responses.sqlite3'}",
            ttl=3600,
            max_bytes=2**20,
            scope_max_bytes=2**19,
        )
        await store.open()
        try:
            keys = ("--api-key", KEY_A, "--api-key", KEY_B, "--max-model-len", "16384")
            async with (
                serve(*keys, store=store) as h,
                h.openai(KEY_A) as mine,
                h.openai(KEY_B) as theirs,
            ):
                kept = await mine.responses.create(model=MODEL, input="keep me")
                flood = [
                    await theirs.responses.create(model=MODEL, input="x" * 40_000)
                    for _ in range(40)
                ]
                assert await store.evict() > 0
                assert (await mine.responses.retrieve(kept.id)).id == kept.id
                assert (await theirs.responses.retrieve(flood[-1].id)).id == flood[-1].id
                with pytest.raises(openai.NotFoundError):
                    await theirs.responses.retrieve(flood[0].id)
        finally:
            await store.close()

    run(body)


def test_delete_then_it_is_gone(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        created = (await h.client.post(RESPONSES, json={"model": MODEL, "input": "hi"})).json()
        deleted = await h.client.delete(f"{RESPONSES}/{created['id']}")
        assert deleted.json() == {"id": created["id"], "object": "response", "deleted": True}
        for method in ("GET", "DELETE"):
            gone = await h.client.request(method, f"{RESPONSES}/{created['id']}")
            assert gone.status_code == 404
            assert gone.json()["error"]["code"] == "response_not_found"

    run_stored(tmp_path, test)


def test_input_items_pages_with_the_sdk(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        async with h.openai() as client:
            words = [f"word{index}" for index in range(5)]
            created = await client.responses.create(
                model=MODEL,
                input=[{"role": "user", "content": word} for word in words],  # type: ignore[misc]
            )
            page = await client.responses.input_items.list(created.id, limit=2, order="asc")
            assert page.has_more is True and len(page.data) == 2
            every = [
                item
                async for item in client.responses.input_items.list(
                    created.id, limit=2, order="asc"
                )
            ]
            assert [item.content[0].text for item in every] == words  # type: ignore[union-attr]
            newest = await client.responses.input_items.list(created.id)
            assert [item.content[0].text for item in newest.data] == words[::-1]  # type: ignore[union-attr]
        bad = await h.client.get(f"{RESPONSES}/{created.id}/input_items", params={"limit": 101})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"

    run_stored(tmp_path, test)


def test_a_stored_stream_is_readable_when_it_completes(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        async with h.openai() as client:
            stream = await client.responses.create(model=MODEL, input="stream me", stream=True)
            kinds = []
            async for event in stream:
                kinds.append(event.type)
                if event.type == "response.completed":
                    assert event.response.store is True
                    found = await client.responses.retrieve(event.response.id)
                    assert found.output_text == event.response.output_text == "Streamed"
            assert kinds[0] == "response.created" and kinds[-1] == "response.completed"

    run_stored(tmp_path, test, script=Script("Streamed"))


def test_get_include_seals_reasoning(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        created = (await h.client.post(RESPONSES, json={"model": MODEL, "input": "hi"})).json()
        plain = (await h.client.get(f"{RESPONSES}/{created['id']}")).json()
        assert plain["output"][0]["encrypted_content"] is None
        sealed = await h.client.get(
            f"{RESPONSES}/{created['id']}", params={"include": "reasoning.encrypted_content"}
        )
        blob = sealed.json()["output"][0]["encrypted_content"]
        # The blob replays into a stateless request exactly as one made at creation would.
        replay = await h.client.post(
            RESPONSES,
            json={
                "model": MODEL,
                "store": False,
                "input": [
                    {"role": "user", "content": "hi"},
                    {**plain["output"][0], "encrypted_content": blob},
                ],
            },
        )
        assert replay.status_code == 200, replay.text

    run_stored(tmp_path, test, script=Script("Deep thought.</think>Hi"))


def test_an_include_is_honoured_or_refused(tmp_path: Path) -> None:
    """`include` on a stored response and its input items: what the store holds as it is (images
    with their URLs) or seals (reasoning) is honoured; anything else is a 400 naming it."""

    async def test(h: Harness) -> None:
        created = (await h.client.post(RESPONSES, json={"model": MODEL, "input": "hi"})).json()
        response = f"{RESPONSES}/{created['id']}"
        image = {"include": "message.input_image.image_url"}
        for path in (response, f"{response}/input_items"):
            assert (await h.client.get(path, params=image)).status_code == 200
            refused = await h.client.get(path, params={"include": "file_search_call.results"})
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["param"] == "include" and "file_search_call.results" in error["message"]
        items = await h.client.get(
            f"{response}/input_items", params={"include": "reasoning.encrypted_content"}
        )
        assert items.status_code == 400  # input items carry no reasoning to seal

    run_stored(tmp_path, test, script=Script("Deep thought.</think>Hi"))


def test_a_store_outage_fails_only_what_needs_the_store(tmp_path: Path) -> None:
    async def body() -> None:
        broken = tmp_path / "a-directory"
        broken.mkdir()
        store: ResponseStore = open_store(f"sqlite://{broken}", ttl=3600, max_bytes=2**30)
        async with serve(store=store) as h:
            answered = await h.client.post(RESPONSES, json={"model": MODEL, "input": "hi"})
            assert answered.status_code == 503, answered.text  # asked to store: not a 200
            await h.state.wait_background(5)
            assert _store_writes(h) == {"stored": 0.0, "failed": 1.0}
            needs = [
                h.client.post(
                    RESPONSES,
                    json={"model": MODEL, "input": "hi", "previous_response_id": "resp_1"},
                ),
                h.client.get(f"{RESPONSES}/resp_1"),
                h.client.delete(f"{RESPONSES}/resp_1"),
                h.client.get(f"{RESPONSES}/resp_1/input_items"),
            ]
            for pending in needs:
                response = await pending
                assert response.status_code == 503, response.text
                assert response.json()["error"]["code"] == "response_store_unavailable"
            assert failures(h.metrics) == {"503": 5.0}
            stateless = await h.client.post(
                RESPONSES, json={"model": MODEL, "input": "hi", "store": False}
            )
            assert stateless.status_code == 200

    run(body)


def test_a_held_lock_is_told_to_the_client_and_on_health(tmp_path: Path) -> None:
    """An outside lock on the file: the stored POST is a 503 (JSON) or ends with an `error`
    event in place of `response.completed` (stream), counted, and /health says degraded; the
    stateless path is untouched, and all is well once the lock is gone."""
    path = tmp_path / "responses.sqlite3"

    async def body() -> None:
        store = ResponseStore(SqliteDatabase(path, busy_timeout_ms=200), ttl=3600, max_bytes=2**30)
        await store.open()
        outside = sqlite3.connect(path, isolation_level=None)
        try:
            async with serve(store=store) as h:
                outside.execute("BEGIN IMMEDIATE")
                answered = await h.client.post(RESPONSES, json={"model": MODEL, "input": "hi"})
                assert answered.status_code == 503, answered.text
                assert answered.json()["error"]["code"] == "response_store_unavailable"
                assert "could not be stored" in answered.json()["error"]["message"]
                async with h.openai() as client:
                    stream = await client.responses.create(model=MODEL, input="hi", stream=True)
                    kinds = [event.type async for event in stream]
                assert kinds[-1] == "error" and "response.completed" not in kinds
                health = await h.client.get("/health")
                assert health.status_code == 200
                assert health.json() == {
                    "status": "degraded",
                    "reason": "the Responses store fails: cannot store a response "
                    "(OperationalError)",
                }
                await h.state.wait_background(5)
                assert _store_writes(h) == {"stored": 0.0, "failed": 2.0}
                stateless = await h.client.post(
                    RESPONSES, json={"model": MODEL, "input": "hi", "store": False}
                )
                assert stateless.status_code == 200
                outside.execute("ROLLBACK")
                again = await h.client.post(RESPONSES, json={"model": MODEL, "input": "hi"})
                assert again.status_code == 200, again.text
                assert (await h.client.get("/health")).json() == {"status": "ok"}
        finally:
            outside.close()
            await store.close()

    run(body)


def test_an_input_past_the_cap_of_one_response_is_a_400_before_generation(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        store = open_store(
            f"sqlite://{tmp_path / 'responses.sqlite3'}",
            ttl=3600,
            max_bytes=2**30,
            response_max_bytes=10_000,
        )
        await store.open()
        try:
            async with serve(store=store) as h:
                big = {"model": MODEL, "input": "x" * 20_000}
                refused = await h.client.post(RESPONSES, json=big)
                assert refused.status_code == 400, refused.text
                assert refused.json()["error"]["param"] == "store"
                assert h.coordinator.admitted == 0
                unstored = await h.client.post(RESPONSES, json={**big, "store": False})
                assert unstored.status_code == 200
            # An answer that takes the response past the cap: told after generation, a 400.
            async with serve(store=store, script=Script("word " * 3000)) as h:
                told = await h.client.post(RESPONSES, json={"model": MODEL, "input": "hi"})
                assert told.status_code == 400, told.text
                assert "generated but not stored" in told.json()["error"]["message"]
                await h.state.wait_background(5)
                assert _store_writes(h) == {"stored": 0.0, "failed": 1.0}
                assert (await h.client.get("/health")).json() == {"status": "ok"}
        finally:
            await store.close()

    run(body)


def _store_writes(h: Harness) -> dict[str, float]:
    found = {}
    for family in h.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == "deepinfer:response_store_writes_total":
                found[sample.labels["result"]] = sample.value
    return found


_TIMES = re.compile(rb'"(?:created_at|completed_at)":\d+')


@pytest.mark.parametrize("stream", [False, True])
def test_store_false_is_byte_for_byte_the_stateless_path(tmp_path: Path, stream: bool) -> None:
    """The same request (same X-Request-Id) with `store: false` on a server with a store and on
    one without: the same bytes (asked again if a second boundary fell between the two)."""
    body = {"model": MODEL, "input": "Same bytes", "store": False, "stream": stream}
    headers = {"X-Request-Id": "same-id"}

    async def test() -> None:
        async with (
            serve(script=Script("Identical")) as plain,
            stored(tmp_path, script=Script("Identical")) as h,
        ):
            for _ in range(3):
                without = (await plain.client.post(RESPONSES, json=body, headers=headers)).content
                with_store = (await h.client.post(RESPONSES, json=body, headers=headers)).content
                if _TIMES.findall(without) == _TIMES.findall(with_store):
                    break
            assert with_store == without
            assert b'"store":false' in with_store

    run(test)
