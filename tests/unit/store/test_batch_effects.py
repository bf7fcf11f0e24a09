"""A batch line's writes (a stored response, a conversation turn) on both backends: written
with the mark of the line's answer in one transaction, so a second answer of the line writes
nothing and the first answer's body is what the runner records; the marks go with their batch."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from deepinfer_server.errors import StoreUnavailableError
from deepinfer_server.services.batch_line import answering, line_answered
from deepinfer_server.store import ResponseStore
from deepinfer_server.store.batch_effects import LineAnswered, LineEffects, LineIdentity
from deepinfer_server.store.batches import BatchStore, NewLine
from deepinfer_server.store.conversations import ConversationStore
from deepinfer_server.store.database import Step
from deepinfer_server.store.records import NewResponse
from tests.unit.store.test_response_store import message, run_with_store

LINE = LineIdentity("batch_1", 3)


async def _turn(store: ResponseStore, conversation: str, response_id: str) -> list[Step]:
    """The writes of one answer of the line: its response stored, its turn appended."""
    turn = [message(f"in_{response_id}", "question"), message(f"out_{response_id}", "answer")]
    response = NewResponse(
        response_id, "k", time.time(), {"id": response_id, "output": []}, turn, None
    )
    steps = await store.insert_steps(response)
    return steps + ConversationStore(store).append_steps("k", conversation, turn, generated=True)


def test_a_line_answered_twice_writes_once_and_keeps_its_first_body(
    store_url_of: Callable[[], str],
) -> None:
    async def body(store: ResponseStore) -> None:
        conversations, effects, batches = (
            ConversationStore(store),
            LineEffects(store),
            BatchStore(store),
        )
        created = await conversations.create("k", {}, [])
        assert await batches.effect(LINE.batch_id, LINE.line) is None
        changed = await effects.commit(LINE, {"id": "resp_1"}, await _turn(store, created.id, "r1"))
        assert changed[-2:] == [1, 2]  # the conversation's row and its two items
        with pytest.raises(LineAnswered):
            await effects.commit(LINE, {"id": "resp_2"}, await _turn(store, created.id, "r2"))
        page = await conversations.items("k", created.id, limit=None, order="asc")
        assert page is not None and [item["id"] for item in page.items] == ["in_r1", "out_r1"]
        assert await store.response("k", "r1") is not None
        assert await store.response("k", "r2") is None  # the second answer stored nothing
        assert await batches.effect(LINE.batch_id, LINE.line) == {"id": "resp_1"}
        assert await batches.effect(LINE.batch_id, LINE.line + 1) is None

    run_with_store(store_url_of(), body)


def test_concurrent_answers_of_one_line_write_once(store_url_of: Callable[[], str]) -> None:
    async def body(store: ResponseStore) -> None:
        conversations, effects = ConversationStore(store), LineEffects(store)
        created = await conversations.create("k", {}, [])
        answers = [
            effects.commit(LINE, {"n": n}, await _turn(store, created.id, f"r{n}"))
            for n in range(4)
        ]
        outcomes = await asyncio.gather(*answers, return_exceptions=True)
        failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        assert len(failures) == 3 and all(isinstance(f, LineAnswered) for f in failures)
        page = await conversations.items("k", created.id, limit=None, order="asc")
        assert page is not None and len(page.items) == 2

    run_with_store(store_url_of(), body)


def test_a_failed_write_is_no_answer_and_marks_nothing(store_url_of: Callable[[], str]) -> None:
    async def body(store: ResponseStore) -> None:
        conversations, effects = ConversationStore(store), LineEffects(store)
        created = await conversations.create("k", {}, [])
        broken = [
            *await _turn(store, created.id, "r1"),
            Step("INSERT INTO no_such_table VALUES (1)"),
        ]
        with pytest.raises(StoreUnavailableError) as failed:
            await effects.commit(LINE, {"id": "resp_1"}, broken)
        assert not isinstance(failed.value, LineAnswered)
        assert await BatchStore(store).effect(LINE.batch_id, LINE.line) is None
        page = await conversations.items("k", created.id, limit=None, order="asc")
        assert page is not None and page.items == []  # rolled back with the mark
        await effects.commit(LINE, {"id": "resp_1"}, await _turn(store, created.id, "r1"))
        assert await BatchStore(store).effect(LINE.batch_id, LINE.line) == {"id": "resp_1"}

    run_with_store(store_url_of(), body)


def test_a_batch_deleted_takes_its_marks(store_url_of: Callable[[], str]) -> None:
    async def body(store: ResponseStore) -> None:
        batches = BatchStore(store)
        lines = [NewLine(f"c{n}", {"n": n}) for n in range(4)]
        await batches.add_batch(
            "k", "openai", "/v1/responses", None, None, 3600.0, lines, LINE.batch_id
        )
        await LineEffects(store).commit(LINE, {"id": "resp_1"}, [])
        assert await batches.move(LINE.batch_id, "cancelled", sources=("validating",))
        assert await batches.delete_batch("k", LINE.batch_id)
        assert await batches.effect(LINE.batch_id, LINE.line) is None

    run_with_store(store_url_of(), body)


def test_only_the_runners_task_and_what_it_starts_answer_a_line() -> None:
    async def main() -> None:
        seen: list[LineIdentity | None] = []

        async def request() -> None:
            seen.append(line_answered())

        outside = asyncio.ensure_future(request())  # a client's request: started elsewhere
        with answering(LINE):
            await asyncio.ensure_future(request())  # a task the in-process request starts
            await outside
        seen.append(line_answered())
        assert seen == [None, LINE, None]

    asyncio.run(main())
