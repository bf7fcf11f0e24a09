"""The store root on SQLite and PostgreSQL: its eviction reaches every scoped table (responses,
conversations, files, ended batches) past the time to live, and keeps what is younger or still
at work."""

from __future__ import annotations

import time
from collections.abc import Callable

from deepinfer_server.store import ResponseStore
from deepinfer_server.store.batches import BatchStore, NewLine
from deepinfer_server.store.conversations import ConversationStore
from deepinfer_server.store.database import Step
from deepinfer_server.store.schema import SCOPED_TABLES
from tests.unit.store.test_response_store import message, response, run_with_store


async def _rows(store: BatchStore, suffix: str) -> None:
    """A file, an ended batch and one still at work, all of scope `k`."""
    await store.add_file("k", "batch", "in.jsonl", "{}\n", f"file-{suffix}")
    for state in ("ended", "working"):
        lines = [NewLine("c0", {"n": 0})]
        endpoint = "/v1/chat/completions"
        await store.add_batch(
            "k", "openai", endpoint, None, None, 60, lines, f"batch-{state}-{suffix}"
        )
    ended = f"batch-ended-{suffix}"
    await store.move(ended, "cancelling", sources=("validating",))
    row = await store.batch("k", ended)
    assert row is not None and await store.finish(row, "cancelled", [], None, None)


def test_the_root_evicts_every_scoped_table_past_the_time_to_live(
    store_url_of: Callable[[], str],
) -> None:
    async def body(store: ResponseStore) -> None:
        old = time.time() - 7200
        batches, conversations = BatchStore(store), ConversationStore(store)
        await store.save(response("resp_old", [message("m1", "old")], [], created_at=old))
        await store.save(response("resp_new", [message("m2", "new")], []))
        stale = await conversations.create("k", {}, [message("m3", "old")])
        await _rows(batches, "old")
        async with store.connection("age the rows", write=True) as db:
            await db.write(
                [
                    Step("UPDATE conversations SET updated_at = ?", (old,)),
                    Step("UPDATE files SET created_at = ?", (old,)),
                    Step("UPDATE batches SET created_at = ?", (old,)),
                ]
            )
        fresh = await conversations.create("k", {}, [message("m4", "new")])
        await _rows(batches, "new")

        deleted = {table.name: await store.evict_table(table) for table in SCOPED_TABLES}

        assert deleted == {"responses": 1, "conversations": 1, "batches": 1, "files": 1}
        assert await store.response("none", "resp_old") is None
        assert await store.response("none", "resp_new") is not None
        assert await conversations.get("k", stale.id) is None
        assert await conversations.get("k", fresh.id) is not None
        assert await batches.file("k", "file-old") is None
        assert await batches.file("k", "file-new") is not None
        assert await batches.batch("k", "batch-ended-old") is None
        assert await batches.results("batch-ended-old") == []
        for kept in ("batch-working-old", "batch-ended-new", "batch-working-new"):
            assert await batches.batch("k", kept) is not None

    run_with_store(store_url_of(), body, ttl=3600)
