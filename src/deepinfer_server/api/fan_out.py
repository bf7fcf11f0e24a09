"""Several engine requests behind one HTTP request (`n > 1`, several completion prompts).

Each choice is an ordinary engine request with its own handle, output and `TokenStream.batches()`;
this module runs them together. Admission takes one slot per choice; if a later one is refused
the earlier ones are released. When one choice fails, or the client leaves, the others are
cancelled, which aborts their engine requests (their `TokenStream.batches()` closes each handle).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from deepinfer_server.coordinator.handle import RequestHandle
from deepinfer_server.ipc.messages import AbortReason


def submit_all(submit: Callable[[int], RequestHandle], count: int) -> list[RequestHandle]:
    """Submit `count` engine requests; on a refusal, close the ones already admitted."""
    handles: list[RequestHandle] = []
    try:
        for index in range(count):
            handles.append(submit(index))
    except BaseException:
        for handle in handles:
            handle.close(AbortReason.ROLLBACK)
        raise
    return handles


_END = object()


async def merge_streams(
    streams: list[AsyncIterator[list[str]]],
) -> AsyncIterator[tuple[int, list[str]]]:
    """(stream index, payloads) as each stream produces them, until all have ended.

    The first exception of any stream is raised after the others are cancelled.
    """
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[list[str]]) -> None:
        try:
            async for payloads in stream:
                queue.put_nowait((index, payloads))
        except Exception as exc:
            queue.put_nowait((index, exc))
        else:
            queue.put_nowait((index, _END))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
