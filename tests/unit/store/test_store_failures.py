"""How the SQLite store fails, through the real SQLite: a damaged file refused at start, a held
lock and a full disk reported (and remembered as the store's `failure`), deletes that still work
on a full disk."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from deepinfer_server.errors import ConfigError, StoreUnavailableError
from deepinfer_server.store import ResponseStore
from deepinfer_server.store.location import check_store
from deepinfer_server.store.sqlite import SqliteDatabase
from tests.unit.store.test_response_store import message, response

MIB = 1024 * 1024


def sqlite_store(path: Path, **options: int) -> ResponseStore:
    return ResponseStore(SqliteDatabase(path, **options), ttl=3600, max_bytes=64 * MIB)


def test_a_damaged_page_is_refused_at_start(tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite3"
    url = f"sqlite://{path}"
    check_store(url)  # a new store passes
    with sqlite3.connect(path) as connection:
        connection.execute("PRAGMA journal_mode = DELETE")  # every page in the file itself
        connection.executemany(
            "INSERT INTO store_meta (name, value) VALUES (?, ?)",
            [(f"filler{index}", "x" * 500) for index in range(200)],
        )
    connection.close()
    check_store(url)
    page_size = 4096
    with path.open("r+b") as file:  # the first page intact, the second overwritten
        file.seek(page_size)
        file.write(os.urandom(page_size))
    with pytest.raises(ConfigError, match="is damaged"):
        check_store(url)


def test_a_held_lock_fails_the_write_and_degrades_the_store(tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite3"
    store = sqlite_store(path, busy_timeout_ms=200)

    async def main() -> None:
        await store.open()
        try:
            outside = sqlite3.connect(path, isolation_level=None)
            outside.execute("BEGIN IMMEDIATE")
            with pytest.raises(StoreUnavailableError):
                await store.save(response("resp_1", [message("u1", "hi")], []))
            assert store.failure == "cannot store a response (OperationalError)"
            assert await store.response("none", "resp_1") is None  # reads still work
            assert store.failure is not None
            outside.execute("ROLLBACK")
            outside.close()
            await store.save(response("resp_1", [message("u1", "hi")], []))
            assert store.failure is None
        finally:
            await store.close()

    asyncio.run(main())


@contextlib.contextmanager
def small_disk(directory: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` at `directory` (root only; the test skips otherwise)."""
    directory.mkdir()
    if os.geteuid() != 0:
        pytest.skip("a full disk needs a tmpfs mount, which needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.decode().strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def test_deletes_work_on_a_full_disk(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", "2m") as disk:
        store = sqlite_store(disk / "responses.sqlite3", reserve_bytes=512 * 1024)

        async def main() -> None:
            await store.open()
            try:
                saved = 0
                with pytest.raises(StoreUnavailableError):
                    for saved in range(1000):
                        item = message(f"u{saved}", "x" * 20_000)
                        await store.save(response(f"resp_{saved}", [item], []))
                assert saved > 5
                assert store.failure == "cannot store a response (OperationalError)"
                for index in range(3):
                    assert await store.delete("none", f"resp_{index}")
                assert await store.response("none", "resp_0") is None
                assert await store.response("none", f"resp_{saved - 1}") is not None
                assert store.failure is None
            finally:
                await store.close()

        asyncio.run(main())
