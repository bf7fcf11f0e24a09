"""The start-up check of an SQLite Responses store: how long `check_store` (SQLite's
`quick_check`) takes on a store of a given size, beside a full `integrity_check`.

Fills a store in a temporary directory with responses of about 40 KB each (one user message,
one answer) through `ResponseStore.save`, then times each check once, file in the page cache.
A benchmark, not a test: nothing asserts.

    python bench/store_check.py --mib 256
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import tempfile
import time
from pathlib import Path

from deepinfer_server.store.location import check_store, open_store
from deepinfer_server.store.records import NewResponse

TEXT = "lorem ipsum dolor sit amet " * 750  # about 20 KB


async def fill(path: Path, mib: int) -> int:
    store = open_store(f"sqlite://{path}", ttl=86400, max_bytes=mib * 2**21)
    await store.open()
    count = 0
    try:
        while path.stat().st_size < mib * 2**20:
            for _ in range(200):
                user = {"type": "message", "id": f"msg_{count}", "role": "user", "content": TEXT}
                answer = {"type": "message", "id": f"out_{count}", "content": TEXT}
                body = {"id": f"resp_{count}", "object": "response", "output": [answer]}
                await store.save(NewResponse(f"resp_{count}", "none", time.time(), body, [user]))
                count += 1
    finally:
        await store.close()
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="store size to fill (MiB)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "responses.sqlite3"
        count = asyncio.run(fill(path, args.mib))
        size = path.stat().st_size / 2**20
        started = time.perf_counter()
        check_store(f"sqlite://{path}")
        quick = time.perf_counter() - started
        with sqlite3.connect(path) as connection:
            started = time.perf_counter()
            connection.execute("PRAGMA integrity_check").fetchall()
            full = time.perf_counter() - started
        connection.close()
    print(f"store: {count} responses, {size:.0f} MiB")
    print(f"check_store (quick_check): {quick:.2f} s ({quick / size * 1000:.1f} ms/MiB)")
    print(f"integrity_check:           {full:.2f} s ({full / size * 1000:.1f} ms/MiB)")
    print(f"quick / integrity: {quick / full:.2f}")


if __name__ == "__main__":
    main()
