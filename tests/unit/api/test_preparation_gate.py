"""PreparationGate: its workers taken in turn between keys, a spare kept for keys with nothing
being prepared, each key's backlog bounded, and a preparation that leaves before its turn giving
its place up (no timings: one worker, held)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from deepinfer_server.api.preparation_gate import PreparationGate
from deepinfer_server.errors import OverloadedError
from tests.http.harness import run


class Held:
    """Preparations that record their order and wait, on their worker, until released."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.started = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._release = threading.Event()

    def work(self, name: str) -> Callable[[], str]:
        def prepare() -> str:
            self.order.append(name)
            self._loop.call_soon_threadsafe(self.started.set)
            self._release.wait(10)
            return name

        return prepare

    def release(self) -> None:
        self._release.set()


async def queued(gate: PreparationGate, held: Held, key: str, name: str) -> asyncio.Task[str]:
    """The preparation started, and in its key's line (or running) when this returns."""
    before = gate.pending
    task = asyncio.ensure_future(gate.run(0, 100, held.work(name), key=key))
    await asyncio.sleep(0)  # one step of the task: it runs up to its turn, not a timed wait
    assert gate.pending == before + 1
    return task


def test_a_key_waits_behind_the_running_preparation_only_not_another_keys_backlog() -> None:
    async def body() -> None:
        gate, held = PreparationGate(workers=1, spare=0), Held()
        tasks = [await queued(gate, held, "bulk", "bulk0")]
        await held.started.wait()  # bulk0 holds the one worker
        tasks += [await queued(gate, held, "bulk", f"bulk{i}") for i in range(1, 4)]
        tasks += [await queued(gate, held, "chat", "chat0")]
        assert gate.pending == 5
        held.release()
        assert await asyncio.gather(*tasks) == ["bulk0", "bulk1", "bulk2", "bulk3", "chat0"]
        assert held.order == ["bulk0", "chat0", "bulk1", "bulk2", "bulk3"]
        assert gate.pending == 0

    run(body)


def test_a_key_past_its_bound_is_refused_and_another_key_is_not() -> None:
    async def body() -> None:
        gate, held = PreparationGate(workers=1, per_key=2, spare=0), Held()
        tasks = [await queued(gate, held, "bulk", f"bulk{i}") for i in range(2)]
        with pytest.raises(OverloadedError, match="this API key already has 2"):
            await gate.run(0, 100, held.work("bulk2"), key="bulk")
        tasks.append(await queued(gate, held, "chat", "chat0"))
        held.release()
        assert await asyncio.gather(*tasks) == ["bulk0", "bulk1", "chat0"]
        assert held.order == ["bulk0", "chat0", "bulk1"]

    run(body)


def test_without_a_bound_per_key_only_admission_bounds_a_key() -> None:
    async def body() -> None:
        gate, held = PreparationGate(workers=1, spare=0), Held()
        tasks = [await queued(gate, held, "", f"p{i}") for i in range(20)]
        with pytest.raises(OverloadedError, match="at capacity"):
            await gate.run(80, 100, held.work("over"), key="")  # 80 in flight + 20 pending
        held.release()
        assert len(await asyncio.gather(*tasks)) == 20

    run(body)


def test_a_preparation_cancelled_in_its_line_gives_its_place_up() -> None:
    async def body() -> None:
        gate, held = PreparationGate(workers=1, spare=0), Held()
        running = await queued(gate, held, "a", "a0")
        await held.started.wait()
        gone = await queued(gate, held, "b", "b0")
        after = await queued(gate, held, "c", "c0")
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert gate.pending == 2
        held.release()
        assert await asyncio.gather(running, after) == ["a0", "c0"]
        assert held.order == ["a0", "c0"] and gate.pending == 0

    run(body)


def test_a_preparation_cancelled_while_it_runs_keeps_its_worker_until_done() -> None:
    async def body() -> None:
        gate, held = PreparationGate(workers=1, spare=0), Held()
        running = await queued(gate, held, "a", "a0")
        await held.started.wait()
        waiting = await queued(gate, held, "b", "b0")
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert gate.pending == 2  # a0 still holds the worker: b0 has not started
        assert held.order == ["a0"]
        held.release()
        assert await waiting == "b0"
        assert held.order == ["a0", "b0"] and gate.pending == 0

    run(body)


def test_a_key_with_nothing_running_takes_the_spare_worker_and_a_busy_key_does_not() -> None:
    async def body() -> None:
        gate, held = PreparationGate(workers=1, spare=1), Held()
        tasks = [await queued(gate, held, "bulk", "bulk0")]
        await held.started.wait()  # bulk0 holds the one worker
        held.started.clear()
        tasks.append(await queued(gate, held, "bulk", "bulk1"))  # bulk is running: no spare
        tasks.append(await queued(gate, held, "chat", "chat0"))
        await held.started.wait()  # chat0 started on the spare while bulk0 still runs
        assert held.order == ["bulk0", "chat0"]
        tasks.append(await queued(gate, held, "other", "other0"))  # the spare is taken
        held.release()
        assert await asyncio.gather(*tasks) == ["bulk0", "bulk1", "chat0", "other0"]
        assert held.order[:2] == ["bulk0", "chat0"]
        assert sorted(held.order[2:]) == ["bulk1", "other0"]
        assert gate.pending == 0

    run(body)
