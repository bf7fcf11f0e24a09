"""What storing a background response's stream costs, by the number of events per transaction.

A background stream's events are written to the Responses store before the stream shows them
(`services/background.py`), one transaction per write, each taking every event that came while the
last one ran: one event per transaction when the store keeps up, more when it does not. This
writes the same events (a 300-byte `response.output_text.delta` frame each, as a short token
makes) through `ResponseStore.record_progress` with 1, 4, 16 and 64 events per transaction, on
SQLite in a temporary directory (WAL, `synchronous=NORMAL`, as the server opens it), and prints
the µs per event and per transaction, and each ratio to one event per transaction. A benchmark,
not a test: nothing asserts.

    python bench/background_events.py --events 4000
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from deepinfer_server.store.location import open_store
from deepinfer_server.store.records import NewResponse

BATCHES = (1, 4, 16, 64)
FRAME = "event: response.output_text.delta\ndata: " + "x" * 260 + "\n\n"


async def _measure(directory: Path, events: int, batch: int) -> float:
    """Seconds to store `events` events of one response, `batch` per transaction."""
    store = open_store(f"sqlite://{directory / f'b{batch}.sqlite3'}", ttl=3600, max_bytes=2**34)
    await store.open()
    try:
        body = {"id": "resp_bench", "object": "response", "status": "queued", "output": []}
        await store.start_background(
            NewResponse("resp_bench", "none", time.time(), body, []), "bench"
        )
        started = time.perf_counter()
        for first in range(0, events, batch):
            rows = [(number, FRAME) for number in range(first, min(events, first + batch))]
            await store.record_progress("resp_bench", None, rows)
        return time.perf_counter() - started
    finally:
        await store.close()


async def main_async(events: int) -> None:
    with tempfile.TemporaryDirectory() as directory:
        seconds = {batch: await _measure(Path(directory), events, batch) for batch in BATCHES}
    single = seconds[1] / events
    print("| events per transaction | µs per event | µs per transaction | per event vs 1 |")
    print("|---:|---:|---:|---:|")
    for batch, total in seconds.items():
        per_event = total / events
        per_write = total / -(-events // batch)
        print(
            f"| {batch} | {per_event * 1e6:.1f} | {per_write * 1e6:.1f} "
            f"| {per_event / single:.3f} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=4000)
    args = parser.parse_args()
    asyncio.run(main_async(args.events))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
