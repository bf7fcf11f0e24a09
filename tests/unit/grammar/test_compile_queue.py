"""The fair compile queue: keys take the workers in turn, so one key's backlog never
holds up another key's compile; a key's backlog is bounded (429); a compile that finds no worker
in time is refused as the server's want of capacity (503), and a request that leaves frees its
place. Jobs here are plain functions held on events: no xgrammar, no worker processes."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from deepinfer_server.grammar.compile_queue import FairCompileQueue, QueueLimits
from deepinfer_server.grammar.errors import CompileRefused


class Jobs:
    """Jobs that each block their compile thread until released, recording the run order."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.started = asyncio.Queue[str]()
        self._gates: dict[str, threading.Event] = {}
        self._loop = asyncio.get_running_loop()

    def job(self, name: str) -> Callable[[], str]:
        gate = self._gates[name] = threading.Event()

        def run() -> str:
            self.order.append(name)
            self._loop.call_soon_threadsafe(self.started.put_nowait, name)
            assert gate.wait(10)
            return name

        return run

    def release(self, name: str) -> None:
        self._gates[name].set()


def _queue(
    slots: int = 1, per_key: int = 8, wait_s: float = 10.0, ready: int = 1
) -> FairCompileQueue:
    return FairCompileQueue(slots, lambda: ready, QueueLimits(per_key, wait_s), retry_after_s=3)


def test_a_key_with_one_compile_goes_next_whatever_another_key_has_queued() -> None:
    async def body() -> None:
        jobs = Jobs()
        queue = _queue(per_key=8)
        flood = [asyncio.ensure_future(queue.run("k1", jobs.job(f"k1-{i}"))) for i in range(6)]
        assert await jobs.started.get() == "k1-0"
        victim = asyncio.ensure_future(queue.run("k2", jobs.job("k2")))
        await asyncio.sleep(0)  # the victim is in its line
        assert queue.stats().waiting == 6
        jobs.release("k1-0")
        assert await jobs.started.get() == "k2"  # not k1-1: the turn passed to k2
        jobs.release("k2")
        assert await victim == "k2"
        for i in range(1, 6):
            assert await jobs.started.get() == f"k1-{i}"
            jobs.release(f"k1-{i}")
        assert [await f for f in flood] == [f"k1-{i}" for i in range(6)]
        assert queue.stats().running == 0 and queue.stats().waiting == 0
        queue.close()

    asyncio.run(asyncio.wait_for(body(), 30))


def test_a_key_past_its_bound_is_refused_at_once_and_other_keys_are_not() -> None:
    async def body() -> None:
        jobs = Jobs()
        queue = _queue(per_key=2)
        held = [asyncio.ensure_future(queue.run("k1", jobs.job(f"k1-{i}"))) for i in range(2)]
        await jobs.started.get()
        with pytest.raises(CompileRefused) as refused:
            await queue.run("k1", jobs.job("k1-2"))
        assert refused.value.per_key and refused.value.retry_after == 3
        other = asyncio.ensure_future(queue.run("k2", jobs.job("k2")))
        for name in ("k1-0", "k2", "k1-1"):
            jobs.release(name)
        assert await other == "k2"
        await asyncio.gather(*held)
        assert queue.stats().refused_per_key == 1
        # The key's compiles are done: it may queue again.
        again = asyncio.ensure_future(queue.run("k1", jobs.job("k1-3")))
        jobs.release("k1-3")
        assert await again == "k1-3"
        queue.close()

    asyncio.run(asyncio.wait_for(body(), 30))


def test_no_worker_in_time_is_a_capacity_refusal_not_the_grammars_fault() -> None:
    async def body() -> None:
        jobs = Jobs()
        queue = _queue(wait_s=0.05, ready=0)  # no worker ever becomes ready
        with pytest.raises(CompileRefused) as refused:
            await queue.run("k1", jobs.job("k1"))
        assert not refused.value.per_key and refused.value.retry_after == 3
        assert jobs.order == [] and queue.stats().refused_busy == 1
        assert queue.stats().waiting == 0
        queue.close()

    asyncio.run(asyncio.wait_for(body(), 30))


def test_a_compile_waits_for_a_worker_to_become_ready_then_runs() -> None:
    async def body() -> None:
        jobs = Jobs()
        ready = [0]
        queue = FairCompileQueue(1, lambda: ready[0], QueueLimits(8, 10.0), retry_after_s=1)
        waiting = asyncio.ensure_future(queue.run("k1", jobs.job("k1")))
        await asyncio.sleep(0)
        assert queue.stats().waiting == 1 and jobs.order == []
        ready[0] = 1
        await asyncio.to_thread(queue.worker_ready)  # as the pool calls it, from its thread
        jobs.release("k1")
        assert await waiting == "k1"
        queue.close()

    asyncio.run(asyncio.wait_for(body(), 30))


def test_a_request_that_leaves_while_waiting_frees_its_place() -> None:
    async def body() -> None:
        jobs = Jobs()
        queue = _queue(per_key=2)
        running = asyncio.ensure_future(queue.run("k1", jobs.job("k1-0")))
        await jobs.started.get()
        gone = asyncio.ensure_future(queue.run("k1", jobs.job("k1-1")))
        await asyncio.sleep(0)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert queue.stats().waiting == 0
        later = asyncio.ensure_future(queue.run("k1", jobs.job("k1-2")))  # within the bound
        jobs.release("k1-0")
        jobs.release("k1-2")
        assert await later == "k1-2" and await running == "k1-0"
        assert jobs.order == ["k1-0", "k1-2"]
        queue.close()

    asyncio.run(asyncio.wait_for(body(), 30))


def test_a_key_already_compiling_leaves_the_last_free_worker_to_another_key() -> None:
    async def body() -> None:
        jobs = Jobs()
        queue = _queue(slots=3, ready=3)
        flood = [asyncio.ensure_future(queue.run("k1", jobs.job(f"k1-{i}"))) for i in range(5)]
        assert {await jobs.started.get(), await jobs.started.get()} == {"k1-0", "k1-1"}
        await asyncio.sleep(0)
        # Alone, the flooding key runs on all the workers but one.
        assert queue.stats().running == 2 and queue.stats().waiting == 3
        victim = asyncio.ensure_future(queue.run("k2", jobs.job("k2")))
        assert await jobs.started.get() == "k2"  # at once: no compile of k1 had to end
        jobs.release("k2")
        assert await victim == "k2"
        await asyncio.sleep(0)
        assert queue.stats().running == 2  # the freed worker is kept free again
        for i in range(5):
            jobs.release(f"k1-{i}")
        assert [await f for f in flood] == [f"k1-{i}" for i in range(5)]
        assert queue.stats().running == 0 and queue.stats().waiting == 0
        queue.close()

    asyncio.run(asyncio.wait_for(body(), 30))
