"""The store quota on SQLite and PostgreSQL: a key's files and batches' data (requests, recorded
results, the marks of lines' writes) count against one per-key and one server-wide byte cap; a
new batch or upload past either is refused with nothing written, even when several race; what a
batch's work records is always stored; a key keeps at most its count of files; a version 5
store gains the batches' bytes, its batches counting nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from deepinfer_server.store import ResponseStore
from deepinfer_server.store.batch_effects import LineEffects, LineIdentity
from deepinfer_server.store.batches import BatchStore, NewLine
from deepinfer_server.store.database import Step
from deepinfer_server.store.schema import SCHEMA_VERSION
from tests.unit.store.test_response_store import run_with_store

#: The caps of these tests: a key may keep 10,000 bytes, every key 15,000.
KEY_CAP, STORE_CAP = 10_000, 15_000
#: A request body of about 1,000 bytes stored.
BODY = {"input": "x" * 985}


def _lines(count: int) -> list[NewLine]:
    return [NewLine(f"c{n}", BODY) for n in range(count)]


async def _add(store: BatchStore, scope: str, batch_id: str, lines: list[NewLine]) -> bool:
    return await store.add_batch(
        scope, "anthropic", "/v1/messages", None, None, 3600.0, lines, batch_id
    )


def _run(url: str, body: Callable[[ResponseStore], object], **limits: int) -> None:
    run_with_store(
        url,
        body,  # type: ignore[arg-type]
        max_bytes=STORE_CAP,
        scope_max_bytes=KEY_CAP,
        **limits,
    )


def test_a_batch_counts_with_the_keys_files_and_one_past_the_cap_writes_nothing(
    store_url_of: Callable[[], str],
) -> None:
    async def body(responses: ResponseStore) -> None:
        store = BatchStore(responses)
        assert await store.upload_file("k1", "batch", "a.jsonl", "a" * 4_000) is not None
        assert await _add(store, "k1", "batch_1", _lines(4))
        used = KEY_CAP - await store.upload_room("k1")
        assert 4_000 + 4 * 1_000 < used < 4_000 + 4 * 1_100  # the batch's requests count
        assert not await _add(store, "k1", "batch_2", _lines(3))  # past the key's cap
        assert await store.batch("k1", "batch_2") is None
        assert await store.results("batch_2") == []
        assert await store.upload_room("k1") == KEY_CAP - used  # nothing of it counted
        assert await store.upload_file("k1", "batch", "b.jsonl", "b" * 2_000) is None
        # Another key is under its own cap, and then under the store's.
        assert await _add(store, "k2", "batch_3", _lines(5))
        assert not await _add(store, "k2", "batch_4", _lines(3))
        assert await store.batch("k2", "batch_4") is None
        assert await store.upload_room("k3") < 2_000
        # Deleting an ended batch frees its room at once.
        assert await store.move("batch_1", "cancelled", sources=("validating",))
        assert await store.delete_batch("k1", "batch_1")
        assert await _add(store, "k1", "batch_2", _lines(3))
        assert len(await store.results("batch_2")) == 3

    _run(store_url_of(), body)


def test_results_and_marks_are_always_stored_and_then_refuse_what_comes_next(
    store_url_of: Callable[[], str],
) -> None:
    async def body(responses: ResponseStore) -> None:
        store = BatchStore(responses)
        assert await _add(store, "k1", "batch_1", _lines(2))
        before = await store.upload_room("k1")
        first, second = await store.claim("batch_1", "p1", 2, lease=60)
        await LineEffects(responses).commit(LineIdentity("batch_1", first.line), BODY, [])
        assert before - 1_100 < await store.upload_room("k1") < before - 900  # the mark
        big = {"output": "y" * 9_000}  # past what the key has left: stored all the same
        assert await store.record(first, "succeeded", big)
        assert not await store.record(first, "succeeded", big)  # the claim holds it no more
        assert await store.upload_room("k1") == 0
        assert (await store.results("batch_1"))[first.line].result == big
        assert not await _add(store, "k1", "batch_2", _lines(1))
        assert await store.upload_file("k1", "batch", "a.jsonl", "a") is None
        assert await store.record(second, "succeeded", {"output": "z"})  # still its work

    _run(store_url_of(), body)


def test_racing_creates_and_uploads_never_pass_a_cap_together(
    store_url_of: Callable[[], str],
) -> None:
    async def body(responses: ResponseStore) -> None:
        stores = [BatchStore(responses) for _ in range(6)]
        # Each fits alone (6,000 bytes of 10,000); any two together do not.
        added = await asyncio.gather(
            *(_add(store, "k1", f"batch_{n}", _lines(6)) for n, store in enumerate(stores))
        )
        assert sorted(added) == [False] * 5 + [True]
        uploaded = await asyncio.gather(
            *(store.upload_file("k2", "batch", "a.jsonl", "a" * 6_000) for store in stores)
        )
        assert sum(row is not None for row in uploaded) == 1

    _run(store_url_of(), body)


def test_a_key_keeps_at_most_its_count_of_files(store_url_of: Callable[[], str]) -> None:
    async def body(responses: ResponseStore) -> None:
        store = BatchStore(responses)
        kept = [await store.upload_file("k1", "batch", f"{n}.jsonl", "{}") for n in range(2)]
        assert all(row is not None for row in kept)
        assert await store.upload_room("k1") == 0
        assert await store.upload_file("k1", "batch", "2.jsonl", "{}") is None
        assert len(await store.files("k1", None, None, 10)) == 2
        assert await store.upload_file("k2", "batch", "0.jsonl", "{}") is not None
        assert kept[0] is not None and await store.delete_file("k1", kept[0].id)
        assert await store.upload_file("k1", "batch", "2.jsonl", "{}") is not None

    _run(store_url_of(), body, scope_max_files=2)


def test_a_version_5_store_is_brought_to_version_6_and_its_batches_count_nothing(
    store_url_of: Callable[[], str],
) -> None:
    url = store_url_of()

    async def downgrade(responses: ResponseStore) -> None:
        assert await _add(BatchStore(responses), "k1", "batch_1", _lines(2))
        await responses.database.write(
            [
                Step("DROP TABLE batch_bytes"),
                Step("UPDATE store_meta SET value = '5' WHERE name = 'schema_version'"),
            ]
        )

    async def reopen(responses: ResponseStore) -> None:
        store = BatchStore(responses)
        version = await responses.database.fetch(
            "SELECT value FROM store_meta WHERE name = 'schema_version'"
        )
        assert version == [(SCHEMA_VERSION,)] and SCHEMA_VERSION == "6"
        assert await store.upload_room("k1") == KEY_CAP  # stored before: counted nowhere
        (line,) = await store.claim("batch_1", "p1", 1, lease=60)
        assert await store.record(line, "succeeded", {"output": "y"})  # still recorded
        assert await store.move("batch_1", "cancelled", sources=("validating",))
        assert await store.delete_batch("k1", "batch_1")

    _run(url, downgrade)
    _run(url, reopen)
