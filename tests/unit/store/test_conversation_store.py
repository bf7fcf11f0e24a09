"""The conversations' queries on both backends (SQLite always, PostgreSQL in its lane):
positions under concurrent appends, paging, item deletes, scopes, expiry and per-scope caps."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from deepinfer_server.store import ResponseStore
from deepinfer_server.store.conversations import ConversationStore
from deepinfer_server.store.database import Step
from tests.unit.store.test_response_store import MIB, message, run_with_store


def _texts(items: list[dict[str, Any]]) -> list[str]:
    return [item["content"][0]["text"] for item in items]


def test_concurrent_appends_take_distinct_positions(store_url_of: Callable[[], str]) -> None:
    async def body(store: ResponseStore) -> None:
        conversations = ConversationStore(store)
        created = await conversations.create("a", {"k": "v"}, [message("m0", "zero")])
        turns = [
            conversations.append(
                "a",
                created.id,
                [message(f"q{n}", f"q{n}"), message(f"a{n}", f"a{n}")],
                generated=True,
            )
            for n in range(8)
        ]
        assert all(await asyncio.gather(*turns))
        page = await conversations.items("a", created.id, limit=None, order="asc")
        assert page is not None and len(page.items) == 17
        texts = _texts(page.items)
        assert texts[0] == "zero"
        for n in range(8):  # each turn whole, its question right before its answer
            assert texts.index(f"a{n}") == texts.index(f"q{n}") + 1
        assert page.trusted == frozenset(range(1, 17))  # the client's first item is not

    run_with_store(store_url_of(), body)


def test_pages_deletes_and_scopes(store_url_of: Callable[[], str]) -> None:
    async def body(store: ResponseStore) -> None:
        conversations = ConversationStore(store)
        items = [message(f"m{n}", f"t{n}") for n in range(5)]
        created = await conversations.create("a", {}, items)
        page = await conversations.items("a", created.id, limit=2)
        assert page is not None and _texts(page.items) == ["t4", "t3"] and page.has_more
        page = await conversations.items("a", created.id, limit=2, after="m3")
        assert page is not None and _texts(page.items) == ["t2", "t1"] and page.has_more
        page = await conversations.items("a", created.id, limit=2, after="m1", order="asc")
        assert page is not None and _texts(page.items) == ["t2", "t3"] and page.has_more
        assert await conversations.delete_item("a", created.id, "m2") is True
        assert await conversations.delete_item("a", created.id, "m2") is False
        assert await conversations.item("a", created.id, "m2") is None
        assert await conversations.item("a", created.id, "m1") == items[1]
        # Another scope sees nothing, and changes nothing.
        assert await conversations.get("b", created.id) is None
        assert await conversations.items("b", created.id) is None
        assert await conversations.delete_item("b", created.id, "m1") is None
        assert not await conversations.append("b", created.id, items, generated=False)
        assert await conversations.update("b", created.id, {"x": "y"}) is None
        assert not await conversations.delete("b", created.id)
        updated = await conversations.update("a", created.id, {"x": "y"})
        assert updated is not None and updated.metadata == {"x": "y"}
        assert await conversations.delete("a", created.id)
        rows = await store._db.fetch("SELECT COUNT(*) FROM conversation_items")
        assert rows == [(0,)]

    run_with_store(store_url_of(), body)


def test_expired_and_over_cap_conversations_are_evicted(store_url_of: Callable[[], str]) -> None:
    async def body(store: ResponseStore) -> None:
        conversations = ConversationStore(store)
        old = await conversations.create("a", {}, [message("m", "old")])
        await store._db.write(
            [
                Step(
                    "UPDATE conversations SET updated_at = ? WHERE id = ?",
                    (time.time() - 7200, old.id),
                )
            ]
        )
        assert await conversations.get("a", old.id) is None  # expired: never read
        big = "x" * (MIB // 2)
        first = await conversations.create("a", {}, [message("m1", big)])
        second = await conversations.create("a", {}, [message("m2", big)])
        third = await conversations.create("a", {}, [message("m3", big)])
        other = await conversations.create("b", {}, [message("m4", big)])
        assert await conversations.append("a", first.id, [], generated=True)  # a no-op
        assert await conversations.evict() == 3  # the expired one, and the least recent of a
        assert await conversations.get("a", first.id) is None
        assert await conversations.get("a", second.id) is None
        assert await conversations.get("a", third.id) is not None
        assert await conversations.get("b", other.id) is not None

    run_with_store(store_url_of(), body, ttl=3600, scope_max_bytes=MIB)
