"""The Responses store's queries, through one suite for both backends: SQLite (always) and
PostgreSQL (marker `postgres`: a throwaway cluster from Debian's binaries)."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from deepinfer_server.config.response_store import parse_duration, store_url
from deepinfer_server.errors import ConfigError, StoreUnavailableError
from deepinfer_server.store import BrokenHistory, ResponseStore, ResponseTooLarge
from deepinfer_server.store.conversations import ConversationStore
from deepinfer_server.store.database import Step
from deepinfer_server.store.fairness import fair_level
from deepinfer_server.store.location import check_store, open_store
from deepinfer_server.store.records import NewResponse
from deepinfer_server.store.schema import SCHEMA_VERSION
from tests.postgres import PostgresServer

MIB = 1024 * 1024


Body = Callable[[ResponseStore], Coroutine[Any, Any, None]]


def run_with_store(
    url: str, body: Body, *, ttl: float = 3600, max_bytes: int = 64 * MIB, **limits: int
) -> None:
    async def main() -> None:
        store = open_store(url, ttl=ttl, max_bytes=max_bytes, **limits)
        await store.open()
        try:
            await asyncio.wait_for(body(store), 30)
        finally:
            await store.close()

    asyncio.run(main())


def message(item_id: str, text: str, role: str = "user") -> dict[str, Any]:
    kind = "input_text" if role != "assistant" else "output_text"
    return {
        "type": "message",
        "id": item_id,
        "role": role,
        "content": [{"type": kind, "text": text}],
    }


def response(
    response_id: str,
    inputs: list[dict[str, Any]],
    outputs: list[dict[str, Any]],
    *,
    scope: str = "none",
    previous: str | None = None,
    created_at: float | None = None,
) -> NewResponse:
    body = {"id": response_id, "object": "response", "output": outputs}
    return NewResponse(
        response_id,
        scope,
        time.time() if created_at is None else created_at,
        body,
        inputs,
        previous,
    )


def test_a_response_is_read_back_in_its_scope_only(store_url_of: Callable[[], str]) -> None:
    async def body(store: ResponseStore) -> None:
        await store.save(
            response("resp_1", [message("msg_in", "hi")], [message("msg_out", "yo", "assistant")])
        )
        found = await store.response("none", "resp_1")
        assert found is not None
        assert found.body["output"][0]["id"] == "msg_out"
        assert found.previous_response_id is None
        assert await store.response("other-scope", "resp_1") is None
        assert await store.response("none", "resp_2") is None

    run_with_store(store_url_of(), body)


def test_history_walks_the_previous_response_chain(store_url_of: Callable[[], str]) -> None:
    async def body(store: ResponseStore) -> None:
        await store.save(
            response("resp_1", [message("u1", "one")], [message("a1", "A", "assistant")])
        )
        await store.save(
            response(
                "resp_2",
                [message("u2", "two")],
                [message("a2", "B", "assistant")],
                previous="resp_1",
            )
        )
        await store.save(
            response(
                "resp_3",
                [message("u3", "three")],
                [message("a3", "C", "assistant")],
                previous="resp_2",
            )
        )
        history = await store.history("none", "resp_3")
        assert [item["id"] for item in history or []] == ["u1", "a1", "u2", "a2", "u3", "a3"]
        assert await store.history("someone-else", "resp_3") is None
        assert await store.history("none", "resp_9") is None

    run_with_store(store_url_of(), body)


def test_a_chain_whose_start_was_deleted_is_broken(store_url_of: Callable[[], str]) -> None:
    async def body(store: ResponseStore) -> None:
        await store.save(response("resp_1", [message("u1", "one")], []))
        await store.save(response("resp_2", [message("u2", "two")], [], previous="resp_1"))
        assert await store.delete("none", "resp_1")
        with pytest.raises(BrokenHistory) as broken:
            await store.history("none", "resp_2")
        assert broken.value.missing == "resp_1"

    run_with_store(store_url_of(), body)


def test_items_are_found_by_id_in_their_scope(store_url_of: Callable[[], str]) -> None:
    async def body(store: ResponseStore) -> None:
        reasoning = {
            "type": "reasoning",
            "id": "rs_1",
            "content": [{"type": "reasoning_text", "text": "t"}],
        }
        await store.save(response("resp_1", [message("u1", "one")], [reasoning], scope="key-a"))
        found = await store.items("key-a", ["rs_1", "u1", "missing"])
        assert found == {"rs_1": reasoning, "u1": message("u1", "one")}
        assert await store.items("key-b", ["rs_1"]) == {}

    run_with_store(store_url_of(), body)


def test_input_items_pages_in_both_orders(store_url_of: Callable[[], str]) -> None:
    inputs = [message(f"u{index}", str(index)) for index in range(5)]

    async def body(store: ResponseStore) -> None:
        await store.save(response("resp_1", inputs, [message("a", "out", "assistant")]))
        page = await store.input_items("none", "resp_1", limit=2, order="asc")
        assert page is not None
        assert [item["id"] for item in page.items] == ["u0", "u1"] and page.has_more
        page = await store.input_items("none", "resp_1", after="u1", limit=10, order="asc")
        assert page is not None
        assert [item["id"] for item in page.items] == ["u2", "u3", "u4"] and not page.has_more
        page = await store.input_items("none", "resp_1", limit=3)  # desc by default
        assert page is not None
        assert [item["id"] for item in page.items] == ["u4", "u3", "u2"] and page.has_more
        page = await store.input_items("none", "resp_1", after="u2", limit=3)
        assert page is not None
        assert [item["id"] for item in page.items] == ["u1", "u0"] and not page.has_more
        assert await store.input_items("other", "resp_1") is None

    run_with_store(store_url_of(), body)


def test_delete_is_scoped(store_url_of: Callable[[], str]) -> None:
    async def body(store: ResponseStore) -> None:
        await store.save(response("resp_1", [message("u1", "one")], [], scope="key-a"))
        assert not await store.delete("key-b", "resp_1")
        assert await store.response("key-a", "resp_1") is not None
        assert await store.delete("key-a", "resp_1")
        assert await store.response("key-a", "resp_1") is None
        assert await store.items("key-a", ["u1"]) == {}
        assert not await store.delete("key-a", "resp_1")

    run_with_store(store_url_of(), body)


def test_expired_responses_are_never_read_and_evicted(store_url_of: Callable[[], str]) -> None:
    async def body(store: ResponseStore) -> None:
        old = time.time() - 7200
        await store.save(response("resp_old", [message("u_old", "x")], [], created_at=old))
        await store.save(response("resp_new", [message("u_new", "y")], []))
        assert await store.response("none", "resp_old") is None
        assert await store.items("none", ["u_old"]) == {}
        assert await store.evict() == 1
        assert await store.response("none", "resp_new") is not None

    run_with_store(store_url_of(), body, ttl=3600)


def test_the_size_cap_evicts_the_oldest(store_url_of: Callable[[], str]) -> None:
    text = "x" * 300_000  # each response holds about 0.3 MiB

    async def body(store: ResponseStore) -> None:
        start = time.time()
        for index in range(5):
            item = message(f"u{index}", text)
            await store.save(response(f"resp_{index}", [item], [], created_at=start + index))
        assert await store.evict() == 2
        kept = [await store.response("none", f"resp_{index}") for index in range(5)]
        assert [found is not None for found in kept] == [False, False, True, True, True]

    run_with_store(store_url_of(), body, max_bytes=MIB)


def test_one_scope_past_its_cap_evicts_only_its_own(store_url_of: Callable[[], str]) -> None:
    """Key 2 storing far past its cap never touches key 1's response."""
    text = "x" * 40_000

    async def body(store: ResponseStore) -> None:
        start = time.time()
        await store.save(response("resp_k1", [message("u", "hello")], [], scope="k1"))
        for index in range(40):
            item = message(f"u{index}", text)
            created = start + index
            await store.save(response(f"resp_{index}", [item], [], scope="k2", created_at=created))
        assert await store.evict() > 0
        assert await store.response("k1", "resp_k1") is not None
        assert await store.response("k2", "resp_39") is not None
        assert await store.response("k2", "resp_0") is None

    run_with_store(store_url_of(), body, max_bytes=MIB, scope_max_bytes=MIB // 2)


def test_the_store_cap_evicts_from_the_scope_holding_the_most(
    store_url_of: Callable[[], str],
) -> None:
    """Past the whole store's cap (each scope within its own), the largest scope gives way."""
    text = "x" * 100_000

    async def body(store: ResponseStore) -> None:
        start = time.time()
        for index in range(3):  # key 1 stores first: the oldest responses are its own
            item = message(f"a{index}", text)
            created = start + index
            await store.save(response(f"resp_a{index}", [item], [], scope="k1", created_at=created))
        for index in range(8):
            item = message(f"b{index}", text)
            created = start + 10 + index
            await store.save(response(f"resp_b{index}", [item], [], scope="k2", created_at=created))
        assert await store.evict() > 0
        assert all([await store.response("k1", f"resp_a{index}") for index in range(3)])
        assert await store.response("k2", "resp_b0") is None
        assert await store.response("k2", "resp_b7") is not None

    run_with_store(store_url_of(), body, max_bytes=MIB)


def test_fair_level_cuts_the_largest_scopes_to_one_level() -> None:
    assert fair_level({"a": 100, "b": 200}, 1000) == 200  # everything fits
    assert fair_level({"a": 100, "b": 900, "c": 900}, 1000) == 450
    assert fair_level({"a": 600, "b": 600}, 1000) == 500
    assert fair_level({}, 1000) == 0


def test_a_response_past_the_cap_of_one_is_refused_unwritten(
    store_url_of: Callable[[], str],
) -> None:
    async def body(store: ResponseStore) -> None:
        with pytest.raises(ResponseTooLarge):
            await store.save(response("resp_big", [message("u", "x" * 20_000)], []))
        assert await store.response("none", "resp_big") is None
        await store.save(response("resp_small", [message("u", "x" * 5_000)], []))

    run_with_store(store_url_of(), body, response_max_bytes=10_000)


def image_message(item_id: str, url: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "role": "user",
        "content": [
            {"type": "input_text", "text": "what is it?"},
            {"type": "input_image", "image_url": url},
        ],
    }


def test_an_inline_image_is_kept_once_per_scope(store_url_of: Callable[[], str]) -> None:
    """Three turns resending one 300 KB image store it once (and count it once); every read
    gives the data URL back; another key's copy is its own; the last delete frees it."""
    url = "data:image/png;base64," + "A" * 300_000

    async def body(store: ResponseStore) -> None:
        for turn in range(3):
            inputs = [image_message(f"u{turn}", url)]
            await store.save(response(f"resp_{turn}", inputs, [], scope="k1"))
        await store.save(response("resp_other", [image_message("o", url)], [], scope="k2"))
        db = store._db
        assert await db.fetch(
            "SELECT scope, COUNT(*) FROM blobs GROUP BY scope ORDER BY scope"
        ) == [
            ("k1", 1),
            ("k2", 1),
        ]
        (total,) = (await db.fetch("SELECT SUM(bytes) FROM responses WHERE scope = 'k1'"))[0]
        assert 300_000 < int(total) < 310_000
        page = await store.input_items("k1", "resp_2")
        assert page is not None and page.items == [image_message("u2", url)]
        assert await store.history("k1", "resp_1") == [image_message("u1", url)]
        assert await store.items("k1", ["u0"]) == {"u0": image_message("u0", url)}
        assert await store.items("k2", ["u0"]) == {}
        for turn in range(3):
            assert await store.delete("k1", f"resp_{turn}")
        assert await db.fetch("SELECT scope FROM blobs") == [("k2",)]

    run_with_store(store_url_of(), body)


@pytest.mark.parametrize("old_version", ["1", "2", "3"])
def test_an_older_store_is_brought_to_version_4(
    store_url_of: Callable[[], str], old_version: str
) -> None:
    """Version 2 added the blobs, 3 the background runs and events, 4 the conversations and the
    batch jobs: an
    older store lacks their tables, which the opening creates."""
    url = store_url_of()

    async def downgrade(store: ResponseStore) -> None:
        await store.save(response("resp_old", [message("u", "hi")], []))
        dropped = ["conversation_items", "conversations", "files", "batches", "batch_lines"]
        if old_version in ("1", "2"):
            dropped += ["response_events", "background_runs"]
        if old_version == "1":
            dropped += ["blobs", "response_blobs"]
        await store._db.write(
            [
                *(Step(f"DROP TABLE {table}") for table in dropped),
                Step(
                    f"UPDATE store_meta SET value = '{old_version}' WHERE name = 'schema_version'"
                ),
            ]
        )

    async def reopen(store: ResponseStore) -> None:
        assert await store.response("none", "resp_old") is not None
        version = await store._db.fetch(
            "SELECT value FROM store_meta WHERE name = 'schema_version'"
        )
        assert version == [(SCHEMA_VERSION,)]
        assert await store.events_after("resp_old", -1) == []
        assert await ConversationStore(store).get("none", "conv_none") is None
        assert await store._db.fetch("SELECT COUNT(*) FROM batch_lines") == [(0,)]
        assert await store.delete("none", "resp_old")

    run_with_store(url, downgrade)
    run_with_store(url, reopen)


def test_the_scope_salt_is_made_once_per_store(store_url_of: Callable[[], str]) -> None:
    url = store_url_of()
    salts: list[bytes] = []

    async def body(store: ResponseStore) -> None:
        salts.append(await store.scope_salt())

    run_with_store(url, body)
    run_with_store(url, body)
    assert len(salts[0]) == 32 and salts[0] == salts[1]


def test_two_connections_share_one_store(store_url_of: Callable[[], str]) -> None:
    """What two API server processes do: each its own connection, writes seen by the other."""
    url = store_url_of()

    async def main() -> None:
        first = open_store(url, ttl=3600, max_bytes=64 * MIB)
        second = open_store(url, ttl=3600, max_bytes=64 * MIB)
        await first.open()
        await second.open()
        try:
            await asyncio.gather(
                *[
                    first.save(response(f"resp_a{i}", [message(f"a{i}", "x")], []))
                    for i in range(20)
                ],
                *[
                    second.save(response(f"resp_b{i}", [message(f"b{i}", "y")], []))
                    for i in range(20)
                ],
            )
            assert await second.response("none", "resp_a19") is not None
            assert await first.response("none", "resp_b19") is not None
        finally:
            await first.close()
            await second.close()

    asyncio.run(main())


def test_sqlite_runs_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "state" / "responses.sqlite3"

    async def body(store: ResponseStore) -> None:
        await store.save(response("resp_1", [], []))

    run_with_store(f"sqlite://{path}", body)
    with sqlite3.connect(path) as connection:
        assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_an_unreachable_store_is_a_503_error(tmp_path: Path) -> None:
    directory = tmp_path / "a-directory"
    directory.mkdir()
    store = open_store(f"sqlite://{directory}", ttl=3600, max_bytes=MIB)  # a directory, no file

    async def main() -> None:
        with pytest.raises(StoreUnavailableError) as failed:
            await store.open()
        assert failed.value.status_code == 503
        with pytest.raises(StoreUnavailableError):
            await store.response("none", "resp_1")

    asyncio.run(main())


@pytest.mark.postgres
@pytest.mark.e2e
def test_a_postgres_outage_fails_calls_until_it_is_back(postgres_server: PostgresServer) -> None:
    url = postgres_server.new_database()

    async def main() -> None:
        store = open_store(url, ttl=3600, max_bytes=MIB)
        await store.open()
        try:
            await store.save(response("resp_1", [message("u1", "one")], []))
            await asyncio.to_thread(postgres_server.stop)
            try:
                with pytest.raises(StoreUnavailableError):
                    await store.response("none", "resp_1")
            finally:
                await asyncio.to_thread(postgres_server.start)
            assert await store.response("none", "resp_1") is not None
        finally:
            await store.close()

    asyncio.run(main())


def test_store_urls_and_durations(tmp_path: Path) -> None:
    assert store_url("sqlite", tmp_path) == f"sqlite://{tmp_path / 'responses.sqlite3'}"
    assert store_url("none", tmp_path) is None
    assert store_url("sqlite:///srv/r.db", tmp_path) == "sqlite:///srv/r.db"
    assert store_url("postgresql://u:p@h/db", tmp_path) == "postgresql://u:p@h/db"
    with pytest.raises(ConfigError):
        store_url("redis://h", tmp_path)
    assert parse_duration("--ttl", "30d") == 30 * 86400
    assert parse_duration("--ttl", "90") == 90
    for bad in ("0", "-1h", "soon"):
        with pytest.raises(ConfigError):
            parse_duration("--ttl", bad)


def test_an_unwritable_sqlite_store_stops_the_start_with_a_clear_error(tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    with pytest.raises(ConfigError) as refused:
        check_store(f"sqlite://{blocked / 'responses.sqlite3'}")
    assert "--state-dir" in str(refused.value) and "--response-store none" in str(refused.value)
    check_store(f"sqlite://{tmp_path / 'state' / 'responses.sqlite3'}")  # creates it
    assert (tmp_path / "state" / "responses.sqlite3").exists()


def test_a_background_run_from_start_to_end(store_url_of: Callable[[], str]) -> None:
    """Stored queued with its inputs, its events appended (a retried write adds nothing),
    finished with its output items; its run row goes with the end."""

    async def body(store: ResponseStore) -> None:
        queued = response("resp_bg", [message("u", "hi")], [], scope="k")
        queued.body["status"] = "queued"
        await store.start_background(queued, "owner-1")
        found = await store.response("k", "resp_bg")
        assert found is not None and found.heartbeat_at is not None
        assert await store.response("other", "resp_bg") is None
        events = [(0, "e0"), (1, "e1")]
        await store.record_progress("resp_bg", {**queued.body, "status": "in_progress"}, events)
        await store.record_progress("resp_bg", None, [(1, "e1"), (2, "e2")])
        assert await store.events_after("resp_bg", 0) == [(1, "e1"), (2, "e2")]
        assert await store.last_event("resp_bg") == 2
        status = await store.response("k", "resp_bg")
        assert status is not None and status.body["status"] == "in_progress"
        assert await store.claim_run("resp_bg", "owner-1", stale_before=0.0)
        assert not await store.claim_run("resp_bg", "owner-2", stale_before=0.0)
        answer = message("o", "hello", "assistant")
        final = {**queued.body, "status": "completed", "output": [answer]}
        await store.finish_background("resp_bg", "k", final, [(3, "e3")])
        done = await store.response("k", "resp_bg")
        assert done is not None and done.heartbeat_at is None
        assert done.body["status"] == "completed"
        assert await store.history("k", "resp_bg") == [message("u", "hi"), answer]
        assert [number for number, _ in await store.events_after("resp_bg", -1)] == [0, 1, 2, 3]
        assert not await store.claim_run("resp_bg", "owner-1", stale_before=time.time())
        assert await store.delete("k", "resp_bg")
        assert await store.events_after("resp_bg", -1) == []
        # A run whose response was deleted while it ran stores no more events.
        await store.record_progress("resp_bg", None, [(4, "e4")])
        assert await store.events_after("resp_bg", -1) == []

    run_with_store(store_url_of(), body)


def test_stale_runs_are_claimed_once_and_cancels_reach_their_owner(
    store_url_of: Callable[[], str],
) -> None:
    async def body(store: ResponseStore) -> None:
        for name in ("resp_live", "resp_dead"):
            await store.start_background(response(name, [], [], scope="k"), "owner-1")
        await store._db.write(
            [Step("UPDATE background_runs SET heartbeat_at = 0 WHERE response_id = 'resp_dead'")]
        )
        cutoff = time.time() - 5
        assert await store.stale_runs(cutoff) == [("resp_dead", "k")]
        assert not await store.claim_run("resp_live", "sweeper", stale_before=cutoff)
        assert await store.claim_run("resp_dead", "sweeper", stale_before=cutoff)
        assert await store.stale_runs(cutoff) == []  # claimed: renewed by its new owner
        assert await store.runs_of("owner-1") == {"resp_live": False}
        assert await store.request_cancel("resp_live")
        assert await store.runs_of("owner-1") == {"resp_live": True}
        await store.heartbeat("owner-1")
        assert not await store.request_cancel("resp_gone")

    run_with_store(store_url_of(), body)
