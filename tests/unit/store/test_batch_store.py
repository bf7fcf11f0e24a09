"""BatchStore on SQLite and PostgreSQL: lines claimed by several processes at once never
overlap, a line is written only by the claim that holds it, a lease that ended frees its lines,
a batch ends once, and files and batches are scoped."""

from __future__ import annotations

import asyncio
import time

import pytest

from deepinfer_server.store import ResponseStore
from deepinfer_server.store.batches import PENDING, BatchStore, FileRow, NewLine
from tests.unit.store.test_response_store import run_with_store

WINDOW = 3600.0


async def _batch(store: BatchStore, lines: int, scope: str = "k1") -> str:
    await store.add_batch(
        scope,
        "openai",
        "/v1/chat/completions",
        None,
        None,
        WINDOW,
        [NewLine(f"c{n}", {"n": n}) for n in range(lines)],
        "batch_1",
    )
    return "batch_1"


def test_concurrent_claims_never_share_a_line_and_only_the_holder_records(
    store_url_of: object,
) -> None:
    async def body(responses: ResponseStore) -> None:
        one, two = BatchStore(responses), BatchStore(responses)
        batch_id = await _batch(one, 10)
        first, second = await asyncio.gather(
            one.claim(batch_id, "p1", 6, lease=60), two.claim(batch_id, "p2", 6, lease=60)
        )
        lines = [line.line for line in first + second]
        assert len(lines) == len(set(lines))  # no line held twice
        assert await one.held(batch_id) == len(lines)
        rest = await two.claim(batch_id, "p2", 10, lease=60)
        assert sorted(lines + [line.line for line in rest]) == list(range(10))
        assert await one.claim(batch_id, "p3", 10, lease=60) == []  # every line is held
        # On PostgreSQL the second UPDATE waits for the first and then finds its rows taken:
        # one claim may get nothing this round (it claims again at the next).
        held = (first + second)[0]
        assert await one.record(held, "succeeded", {"response": {"status_code": 200}})
        assert not await two.record(held, "errored", {})  # answered once only
        results = {r.line: r for r in await one.results(batch_id)}
        assert results[held.line].status == "succeeded"

    run_with_store(store_url_of(), body)  # type: ignore[operator]


def test_a_lease_that_ended_frees_its_lines_for_another_process(store_url_of: object) -> None:
    async def body(responses: ResponseStore) -> None:
        store = BatchStore(responses)
        batch_id = await _batch(store, 2)
        dead = await store.claim(batch_id, "dead", 2, lease=-1.0)  # its process died
        assert await store.held(batch_id) == 0
        taken = await store.claim(batch_id, "alive", 2, lease=60)
        assert [line.line for line in taken] == [0, 1]
        assert not await store.record(dead[0], "succeeded", {})  # its claim is gone
        await store.renew(dead, lease=60)  # a claim that is gone renews nothing
        assert await store.claim(batch_id, "other", 2, lease=60) == []
        stale = await store.claim(batch_id, "late", 1, lease=-1.0)
        assert stale == []  # every line is held
        await store.release(taken[0])
        mine = await store.claim(batch_id, "slow", 1, lease=-1.0)  # its lease already ended...
        await store.renew(mine, lease=60)  # ...and renewed by its process
        assert await store.claim(batch_id, "other", 2, lease=60) == []
        await store.release(taken[1])
        assert [line.line for line in await store.claim(batch_id, "other", 2, lease=60)] == [1]
        row = await store.batch(None, batch_id)
        assert row is not None and row.counts == {PENDING: 2}

    run_with_store(store_url_of(), body)  # type: ignore[operator]


def test_a_batch_ends_once_with_its_files_and_is_scoped(store_url_of: object) -> None:
    async def body(responses: ResponseStore) -> None:
        store = BatchStore(responses)
        batch_id = await _batch(store, 1)
        assert await store.active_count("k1") == 1 and await store.active_count("k2") == 0
        assert await store.batch("k2", batch_id) is None
        assert await store.move(batch_id, "in_progress", sources=("validating",))
        assert await store.move(batch_id, "finalizing", sources=("in_progress",))
        assert not await store.move(batch_id, "finalizing", sources=("in_progress",))
        row = await store.batch("k1", batch_id)
        assert row is not None and set(row.times) == {"in_progress", "finalizing"}
        output = FileRow("file-out", 0.0, "batch_output", "out.jsonl", 3)
        assert await store.finish(row, "completed", [(output, "{}\n")], "file-out", None)
        assert not await store.finish(row, "completed", [(output, "{}\n")], "file-out", None)
        assert await store.file_content("k1", "file-out") == "{}\n"
        assert await store.file_content("k2", "file-out") is None
        assert [f.id for f in await store.files("k1", "batch_output", None, 10)] == ["file-out"]
        ended = await store.batch("k1", batch_id)
        assert ended is not None and ended.status == "completed"
        assert ended.output_file_id == "file-out" and await store.active_count("k1") == 0
        assert not await store.delete_batch("k2", batch_id)
        assert await store.delete_batch("k1", batch_id)
        assert await store.results(batch_id) == []

    run_with_store(store_url_of(), body)  # type: ignore[operator]


@pytest.mark.parametrize("lines", [3])
def test_listing_pages_newest_first(store_url_of: object, lines: int) -> None:
    async def body(responses: ResponseStore) -> None:
        store = BatchStore(responses)
        ids = [(await store.add_file("k1", "batch", f"{n}.jsonl", "{}\n")).id for n in range(lines)]
        listed = [f.id for f in await store.files("k1", None, None, 10)]
        assert sorted(listed) == sorted(ids)
        first = await store.files("k1", None, None, 1)
        after = await store.files("k1", None, first[0].id, 10)
        assert [f.id for f in first + after] == listed

    run_with_store(store_url_of(), body)  # type: ignore[operator]


def test_files_and_ended_batches_are_evicted_after_the_time_to_live(store_url_of: object) -> None:
    async def body(responses: ResponseStore) -> None:
        store = BatchStore(responses)
        batch_id = await _batch(store, 2)
        await store.add_file("k1", "batch", "in.jsonl", "{}\n", "file-in")
        later = time.time() + 1
        assert await store.evict(later) == 1  # the file; the batch is still at work
        assert await store.batch("k1", batch_id) is not None
        await store.move(batch_id, "cancelling", sources=("validating",))
        row = await store.batch("k1", batch_id)
        assert row is not None and await store.finish(row, "cancelled", [], None, None)
        assert await store.evict(row.created_at) == 0  # not older than the time to live
        assert await store.evict(later) == 1
        assert await store.batch("k1", batch_id) is None
        assert await store.results(batch_id) == []

    run_with_store(store_url_of(), body)  # type: ignore[operator]


def test_uploads_past_a_cap_are_refused_and_nothing_is_evicted(store_url_of: object) -> None:
    async def body(responses: ResponseStore) -> None:
        store = BatchStore(responses)
        first = await store.upload_file("k1", "batch", "a.jsonl", "a" * 300)
        assert first is not None
        assert await store.upload_file("k1", "batch", "b.jsonl", "b" * 200) is None
        assert await store.upload_room("k1") == 100
        # A batch's output file counts, and is stored whatever the caps.
        await store.add_file("k1", "batch_output", "out.jsonl", "o" * 150, "file-out")
        assert await store.upload_room("k1") == 0
        assert await store.upload_file("k2", "batch", "c.jsonl", "c" * 400) is not None
        # The whole store's cap (1000) leaves another key 150 of its 400.
        assert await store.upload_room("k3") == 150
        assert await store.upload_file("k3", "batch", "d.jsonl", "d" * 151) is None
        assert await store.upload_file("k3", "batch", "d.jsonl", "d" * 150) is not None
        assert await store.evict(time.time() - 60) == 0  # full, yet nothing goes
        assert await store.file_content("k1", first.id) == "a" * 300
        assert await store.delete_file("k1", first.id)
        assert await store.upload_room("k1") == 250

    run_with_store(
        store_url_of(),  # type: ignore[operator]
        body,
        max_bytes=1000,
        scope_max_bytes=400,
    )
