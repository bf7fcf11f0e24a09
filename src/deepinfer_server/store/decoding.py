"""Stored JSON decoded off the event loop when there is much of it at once.

A query returns its rows on the event loop; decoding them there costs little for a page, but a
whole conversation of 30,000 items held the loop for 160 ms, and a batch's 50,000 results of
1 KB for 0.4 s. Past `ON_LOOP_BYTES` the decoding runs on a worker thread, where the
interpreter still switches to the loop between rows.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import orjson

#: Bytes of stored JSON decoded on the event loop at most; more goes to a worker thread.
ON_LOOP_BYTES = 256 * 1024

T = TypeVar("T")


async def off_loop_if_large(size: int, work: Callable[[], T]) -> T:
    """`work()`: on the event loop for `size` bytes up to `ON_LOOP_BYTES`, else on a thread."""
    if size <= ON_LOOP_BYTES:
        return work()
    return await asyncio.to_thread(work)


async def decode_all(bodies: Sequence[str | bytes]) -> list[Any]:
    """Each of `bodies` decoded from JSON, off the loop when they are large together."""
    return await off_loop_if_large(
        sum(len(body) for body in bodies), lambda: [orjson.loads(body) for body in bodies]
    )
