"""OpenAI's Conversations API in-process with the official openai client: conversations
created, read, updated and deleted; items added, listed a page at a time, read and deleted;
`conversation` on /v1/responses prepending the conversation and appending each turn (plain,
streamed and in the background); API-key scopes; what is refused."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import openai
import pytest

from deepinfer_server.store import ResponseStore
from deepinfer_server.store.conversations import ConversationStore
from deepinfer_server.store.sqlite import SqliteDatabase
from tests.http.agent_harness import last_prompt
from tests.http.harness import MODEL, Harness, Script, run, serve
from tests.http.test_stored_responses import KEY_A, KEY_B, run_stored
from tests.paths import PD_SECRET_ARGS


def _texts(items: list[Any]) -> list[str]:
    return [item.content[0].text for item in items]


def test_a_conversation_is_created_read_updated_and_deleted(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        async with h.openai() as client:
            created = await client.conversations.create(
                metadata={"topic": "demo"},
                items=[{"type": "message", "role": "user", "content": "Hello"}],
            )
            assert created.id.startswith("conv_") and created.object == "conversation"
            assert created.metadata == {"topic": "demo"}
            found = await client.conversations.retrieve(created.id)
            assert found.model_dump() == created.model_dump()
            updated = await client.conversations.update(created.id, metadata={"topic": "new"})
            assert updated.metadata == {"topic": "new"}
            items = [item async for item in client.conversations.items.list(created.id)]
            assert _texts(items) == ["Hello"]  # type: ignore[arg-type]
            deleted = await client.conversations.delete(created.id)
            assert deleted.deleted and deleted.object == "conversation.deleted"
            with pytest.raises(openai.NotFoundError, match="Conversation with id"):
                await client.conversations.retrieve(created.id)
            with pytest.raises(openai.NotFoundError):
                await client.conversations.items.list(created.id)

    run_stored(tmp_path, test)


def test_three_turns_through_responses_create_see_the_earlier_turns(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        async with h.openai() as client:
            conversation = await client.conversations.create()
            prompt_tokens = []
            for turn in ("one", "two", "three"):
                h.coordinator.script = Script(f"Answer {turn}")
                response = await client.responses.create(
                    model=MODEL, input=f"Question {turn}", conversation=conversation.id
                )
                assert response.conversation is not None
                assert response.conversation.id == conversation.id
                assert response.usage is not None
                prompt_tokens.append(response.usage.input_tokens)
            prompt = last_prompt(h.coordinator)
            said = ["Question one", "Answer one", "Question two", "Answer two", "Question three"]
            assert all(text in prompt for text in said), prompt
            assert [prompt.find(text) for text in said] == sorted(prompt.find(t) for t in said)
            assert prompt_tokens == sorted(set(prompt_tokens))  # each turn's prompt is longer
            items = [
                item async for item in client.conversations.items.list(conversation.id, order="asc")
            ]
            messages = [item for item in items if item.type == "message"]
            assert _texts(messages) == [  # type: ignore[arg-type]
                "Question one",
                "Answer one",
                "Question two",
                "Answer two",
                "Question three",
                "Answer three",
            ]

    run_stored(tmp_path, test)


def test_items_are_added_paged_read_and_deleted(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        async with h.openai() as client:
            conversation = await client.conversations.create()
            added = await client.conversations.items.create(
                conversation.id,
                items=[
                    {"type": "message", "role": "user", "content": f"Item {n}"} for n in range(5)
                ],
            )
            assert _texts(added.data) == [f"Item {n}" for n in range(5)]  # type: ignore[arg-type]
            first = await client.conversations.items.list(conversation.id, limit=2)
            assert _texts(first.data) == ["Item 4", "Item 3"]  # type: ignore[arg-type]
            assert first.has_more and first.last_id == first.data[-1].id
            rest = await client.conversations.items.list(
                conversation.id, limit=2, after=first.last_id
            )
            assert _texts(rest.data) == ["Item 2", "Item 1"]  # type: ignore[arg-type]
            every = [
                item async for item in client.conversations.items.list(conversation.id, limit=2)
            ]
            assert len(every) == 5  # the client follows `has_more` and `after`
            target = added.data[2]
            assert target.id is not None
            found = await client.conversations.items.retrieve(
                target.id, conversation_id=conversation.id
            )
            assert found.model_dump() == target.model_dump()
            after_delete = await client.conversations.items.delete(
                target.id, conversation_id=conversation.id
            )
            assert after_delete.id == conversation.id and after_delete.object == "conversation"
            with pytest.raises(openai.NotFoundError, match="Item with id"):
                await client.conversations.items.retrieve(
                    target.id, conversation_id=conversation.id
                )
            left = [item async for item in client.conversations.items.list(conversation.id)]
            assert len(left) == 4

    run_stored(tmp_path, test)


def test_another_keys_conversation_is_not_found(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        async with h.openai(KEY_A) as mine, h.openai(KEY_B) as theirs:
            conversation = await mine.conversations.create(
                items=[{"type": "message", "role": "user", "content": "Secret"}]
            )
            item_id = (await mine.conversations.items.list(conversation.id)).data[0].id
            assert item_id is not None
            attempts = [
                theirs.conversations.retrieve(conversation.id),
                theirs.conversations.update(conversation.id, metadata={}),
                theirs.conversations.items.list(conversation.id),
                theirs.conversations.items.retrieve(item_id, conversation_id=conversation.id),
                theirs.conversations.items.delete(item_id, conversation_id=conversation.id),
                theirs.conversations.delete(conversation.id),
                theirs.responses.create(model=MODEL, input="Hi", conversation=conversation.id),
            ]
            for attempt in attempts:
                with pytest.raises(openai.NotFoundError):
                    await attempt
            assert len((await mine.conversations.items.list(conversation.id)).data) == 1

    run_stored(tmp_path, test, "--api-key", KEY_A, "--api-key", KEY_B)


def test_a_streamed_turn_is_appended_before_its_last_event(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        async with h.openai() as client:
            conversation = await client.conversations.create()
            stream = await client.responses.create(
                model=MODEL,
                input="Stream it",
                conversation={"id": conversation.id},
                stream=True,
                store=False,
            )
            events = [event async for event in stream]
            assert events[-1].type == "response.completed"
            items = await client.conversations.items.list(conversation.id, order="asc")
            assert _texts([i for i in items.data if i.type == "message"]) == [  # type: ignore[arg-type]
                "Stream it",
                "Streamed back",
            ]

    run_stored(tmp_path, test, script=Script("Streamed back"))


def test_a_background_turn_is_appended_when_it_completes(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        async with h.openai() as client:
            conversation = await client.conversations.create()
            queued = await client.responses.create(
                model=MODEL,
                input="In the background",
                conversation=conversation.id,
                background=True,
            )
            assert queued.status == "queued"
            runs = h.state.background_runs
            assert runs is not None
            await runs.runs[queued.id].wait()
            done = await client.responses.retrieve(queued.id)
            assert done.status == "completed"
            assert done.conversation is not None and done.conversation.id == conversation.id
            items = await client.conversations.items.list(conversation.id, order="asc")
            assert _texts([i for i in items.data if i.type == "message"]) == [  # type: ignore[arg-type]
                "In the background",
                "Done later",
            ]

    run_stored(tmp_path, test, script=Script("Done later"))


def test_a_prefill_server_reads_the_conversation_and_leaves_the_turn_to_the_decode_side(
    tmp_path: Path,
) -> None:
    async def test(h: Harness) -> None:
        assert h.state.store is not None
        conversations = ConversationStore(h.state.store)
        earlier = {"type": "message", "role": "user", "content": "Earlier words"}
        conversation = await conversations.create("none", {}, [earlier])
        response = await h.client.post(
            "/v1/responses",
            json={"model": MODEL, "input": "Hi", "conversation": conversation.id, "stream": True},
        )
        assert response.status_code == 200, response.text
        assert "Earlier words" in last_prompt(h.coordinator)
        assert "event: response.completed" in response.text  # its end is not held back
        page = await conversations.items("none", conversation.id, limit=None)
        assert page is not None and len(page.items) == 1

    run_stored(
        tmp_path, test, *PD_SECRET_ARGS, "--disaggregation-mode", "prefill", script=Script("Hello")
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"conversation": "conv_x", "previous_response_id": "resp_x"}, "conversation"),
        ({"conversation": {"name": "x"}}, "conversation"),
        ({"conversation": 3}, "conversation"),
    ],
)
def test_a_bad_conversation_parameter_is_a_400(
    tmp_path: Path, body: dict[str, Any], param: str
) -> None:
    async def test(h: Harness) -> None:
        response = await h.client.post(
            "/v1/responses", json={"model": MODEL, "input": "Hi", **body}
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
        assert h.coordinator.submitted == []

    run_stored(tmp_path, test)


def test_an_unknown_conversation_is_a_404_before_generation(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        response = await h.client.post(
            "/v1/responses", json={"model": MODEL, "input": "Hi", "conversation": "conv_none"}
        )
        assert response.status_code == 404, response.text
        assert response.json()["error"]["message"] == "Conversation with id 'conv_none' not found."
        assert h.coordinator.submitted == []

    run_stored(tmp_path, test)


@pytest.mark.parametrize(
    ("method", "path", "body", "param"),
    [
        ("POST", "/v1/conversations", {"metadata": {str(n): "v" for n in range(17)}}, "metadata"),
        ("POST", "/v1/conversations", {"metadata": {"k": 1}}, "metadata.k"),
        ("POST", "/v1/conversations", {"items": [{"type": "message"}] * 21}, "items"),
        ("POST", "/v1/conversations", {"items": [{"type": "web_search_call"}]}, "items[0].type"),
        (
            "POST",
            "/v1/conversations",
            {"items": [{"type": "item_reference", "id": "msg_1"}]},
            "items[0].type",
        ),
        ("POST", "/v1/conversations/{id}/items", {}, "items"),
        ("POST", "/v1/conversations/{id}", {}, "metadata"),
        ("GET", "/v1/conversations/{id}/items?limit=101", None, "limit"),
        ("GET", "/v1/conversations/{id}/items?order=up", None, "order"),
        (
            "GET",
            "/v1/conversations/{id}/items?include=message.output_text.logprobs",
            None,
            "include",
        ),
    ],
)
def test_bad_conversation_requests_are_400s(
    tmp_path: Path, method: str, path: str, body: dict[str, Any] | None, param: str
) -> None:
    async def test(h: Harness) -> None:
        assert h.state.store is not None
        conversation = await ConversationStore(h.state.store).create("none", {}, [])
        response = await h.client.request(method, path.format(id=conversation.id), json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error"

    run_stored(tmp_path, test)


def test_without_a_store_conversations_are_refused() -> None:
    async def test(h: Harness) -> None:
        created = await h.client.post("/v1/conversations", json={})
        assert created.status_code == 400, created.text
        found = await h.client.get("/v1/conversations/conv_x")
        assert found.status_code == 404, found.text
        answered = await h.client.post(
            "/v1/responses", json={"model": MODEL, "input": "Hi", "conversation": "conv_x"}
        )
        assert answered.status_code == 400, answered.text
        assert answered.json()["error"]["param"] == "conversation"

    async def body() -> None:
        async with serve() as h:
            await test(h)

    run(body)


def test_a_turn_not_appended_is_told_to_the_client(tmp_path: Path) -> None:
    """A locked store at the end of a `store: false` turn: a 503 naming the conversation, and
    the conversation unchanged."""
    path = tmp_path / "responses.sqlite3"

    async def body() -> None:
        store = ResponseStore(SqliteDatabase(path, busy_timeout_ms=200), ttl=3600, max_bytes=2**30)
        await store.open()
        outside = sqlite3.connect(path, isolation_level=None)
        try:
            async with serve(store=store) as h:
                conversation = await ConversationStore(store).create("none", {}, [])
                outside.execute("BEGIN IMMEDIATE")
                answered = await h.client.post(
                    "/v1/responses",
                    json={
                        "model": MODEL,
                        "input": "hi",
                        "store": False,
                        "conversation": conversation.id,
                    },
                )
                outside.execute("ROLLBACK")
                assert answered.status_code == 503, answered.text
                error = answered.json()["error"]
                assert error["code"] == "response_store_unavailable"
                assert f"adding its turn to conversation {conversation.id!r}" in error["message"]
                assert "'store': false" not in error["message"]  # it was sent
                page = await ConversationStore(store).items("none", conversation.id)
                assert page is not None and page.items == []
        finally:
            outside.close()
            await store.close()

    run(body)


_CALL = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
_OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "42"}
_USER = {"type": "message", "role": "user", "content": "Hi", "id": "msg_1"}


@pytest.mark.parametrize(
    ("first", "added", "index", "field"),
    [
        ([], [_USER, _OUTPUT], 1, "call_id"),
        ([], [_USER, _OUTPUT, _CALL], 1, "call_id"),
        ([_USER, _CALL, _OUTPUT], [_OUTPUT], 0, "call_id"),
        ([_USER, _CALL], [_CALL], 0, "call_id"),
        ([_USER], [{**_CALL, "call_id": None}], 0, "call_id"),
        ([_USER], [_USER], 0, "id"),
        ([], [_USER, {**_USER, "content": "Again"}], 1, "id"),
    ],
)
def test_items_that_would_break_every_turn_are_refused_when_added(
    tmp_path: Path,
    first: list[dict[str, Any]],
    added: list[dict[str, Any]],
    index: int,
    field: str,
) -> None:
    async def test(h: Harness) -> None:
        created = await h.client.post("/v1/conversations", json={"items": first})
        assert created.status_code == 200, created.text
        conversation_id = created.json()["id"]
        for path, items, at in [
            ("/v1/conversations", first + added, len(first) + index),
            (f"/v1/conversations/{conversation_id}/items", added, index),
        ]:
            response = await h.client.post(path, json={"items": items})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == f"items[{at}].{field}"
            assert error["type"] == "invalid_request_error"
        listed = await h.client.get(f"/v1/conversations/{conversation_id}/items")
        assert len(listed.json()["data"]) == len(first)  # nothing was added

    run_stored(tmp_path, test)


def test_a_tool_output_answering_a_call_already_in_the_conversation_is_added(
    tmp_path: Path,
) -> None:
    async def test(h: Harness) -> None:
        created = await h.client.post("/v1/conversations", json={"items": [_USER, _CALL]})
        conversation_id = created.json()["id"]
        added = await h.client.post(
            f"/v1/conversations/{conversation_id}/items", json={"items": [_OUTPUT]}
        )
        assert added.status_code == 200, added.text
        async with h.openai() as client:
            turn = await client.responses.create(
                model=MODEL, input="And?", conversation=conversation_id
            )
        assert turn.status == "completed"

    run_stored(tmp_path, test)
