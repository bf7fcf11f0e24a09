"""Stored JSON is decoded on the event loop when there is little of it, on a worker thread when
there is much (a whole conversation, a batch's results)."""

from __future__ import annotations

import asyncio
import threading

import orjson

from deepinfer_server.store.decoding import ON_LOOP_BYTES, decode_all, off_loop_if_large


def test_little_is_decoded_on_the_loop_much_on_a_thread() -> None:
    async def where(size: int) -> str:
        return await off_loop_if_large(size, lambda: threading.current_thread().name)

    async def both() -> tuple[str, str]:
        return await where(ON_LOOP_BYTES), await where(ON_LOOP_BYTES + 1)

    loop_thread = threading.current_thread().name
    on_loop, off_loop = asyncio.run(both())
    assert on_loop == loop_thread
    assert off_loop != loop_thread


def test_decode_all_keeps_the_order_either_way() -> None:
    small = [orjson.dumps({"n": n}) for n in range(3)]
    large = [orjson.dumps({"n": n, "pad": "x" * 1024}) for n in range(ON_LOOP_BYTES // 1024)]
    assert asyncio.run(decode_all(small)) == [{"n": n} for n in range(3)]
    assert [item["n"] for item in asyncio.run(decode_all(large))] == list(range(len(large)))
