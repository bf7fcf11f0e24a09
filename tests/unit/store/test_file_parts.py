"""FileStore.file_part on SQLite and PostgreSQL: a file's content read a part at a time, by
characters (not bytes), fewer at its end, none past it, and None for another scope's file or
one deleted."""

from __future__ import annotations

from deepinfer_server.store import ResponseStore
from deepinfer_server.store.batches import BatchStore
from tests.unit.store.test_response_store import run_with_store

#: Characters of one, two, three and four UTF-8 bytes, and line breaks of several kinds.
CONTENT = '{"é": "世界"}\r\n🙂 line\u2028x\n' * 5


def test_a_file_is_read_in_parts_of_characters(store_url_of: object) -> None:
    async def body(responses: ResponseStore) -> None:
        store = BatchStore(responses)
        row = await store.upload_file("k1", "batch", "in.jsonl", CONTENT)
        assert row is not None
        for size in (1, 3, 7, len(CONTENT), len(CONTENT) + 5):
            parts = []
            start = 0
            while part := await store.file_part("k1", row.id, start, size):
                assert len(part) <= size
                parts.append(part)
                start += len(part)
            assert "".join(parts) == CONTENT
            assert all(len(part) == size for part in parts[:-1])
        assert await store.file_part("k1", row.id, len(CONTENT), 4) == ""
        assert await store.file_part("k2", row.id, 0, 4) is None
        assert await store.delete_file("k1", row.id)
        assert await store.file_part("k1", row.id, 0, 4) is None

    run_with_store(store_url_of(), body)  # type: ignore[operator]
