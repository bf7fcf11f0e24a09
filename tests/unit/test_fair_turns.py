"""FairTurns: work waits for its turn in its key's line, counted held and running, and gives its
slot back however it leaves (no timings: the tests give the turns themselves)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from deepinfer_server.fair_turns import FairTurns
from tests.http.harness import run


class Owner:
    """An owner whose dispatch gives no turn itself: it records that it was called."""

    def __init__(self) -> None:
        self.called = asyncio.Event()
        self.turns = FairTurns(self.dispatch)

    def dispatch(self) -> None:
        self.called.set()

    async def waiting(self, key: str) -> asyncio.Task[bool]:
        """A task waiting in `key`'s line (its dispatch seen)."""
        self.called.clear()
        task = asyncio.ensure_future(self.turns.wait_turn(key))
        await self.called.wait()
        return task


def test_a_turn_given_runs_the_work_and_its_finish_frees_the_slot() -> None:
    async def scenario() -> None:
        owner = Owner()
        turns = owner.turns
        task = await owner.waiting("a")
        assert (turns.waiting, turns.held_by("a"), turns.running) == (1, 1, 0)
        assert turns.start_next()
        assert await task
        assert (turns.waiting, turns.running, turns.idle("a")) == (0, 1, False)
        owner.called.clear()
        with ThreadPoolExecutor(1) as threads:
            assert await turns.run("a", threads, lambda: "done") == "done"
        await owner.called.wait()
        assert (turns.held, turns.running, turns.idle("a")) == (0, 0, True)

    run(scenario)


def test_a_wait_past_its_timeout_leaves_the_line() -> None:
    async def scenario() -> None:
        turns = Owner().turns
        assert not await turns.wait_turn("a", timeout=0)
        assert (turns.held, turns.waiting, turns.running) == (0, 0, 0)
        assert not turns.start_next()

    run(scenario)


def test_a_cancelled_wait_leaves_the_line() -> None:
    async def scenario() -> None:
        owner = Owner()
        turns = owner.turns
        task = await owner.waiting("a")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (turns.held, turns.waiting) == (0, 0)
        assert not turns.start_next()

    run(scenario)


def test_a_turn_given_to_a_request_just_cancelled_is_given_back() -> None:
    async def scenario() -> None:
        owner = Owner()
        turns = owner.turns
        task = await owner.waiting("a")
        task.cancel()
        assert turns.start_next()  # before the cancelled request runs again
        owner.called.clear()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert owner.called.is_set()
        assert (turns.held, turns.waiting, turns.running) == (0, 0, 0)

    run(scenario)
