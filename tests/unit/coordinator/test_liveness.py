"""LivenessWatch times each rank's loop: a rank that stops coming back is hung whether or not
requests are in flight (issue 24: clients that gave up kept resetting the old clock)."""

from __future__ import annotations

import asyncio

import pytest

from deepinfer_server.coordinator.liveness import LivenessWatch, heartbeat_interval


def test_an_idle_rank_whose_loop_stops_is_hung() -> None:
    async def body() -> list[str]:
        hangs: list[str] = []
        watch = LivenessWatch(2, 0.2, hangs.append)
        loop = asyncio.get_running_loop()
        watch.reported(0, loop.time())  # both ranks ready, nothing ever in flight
        watch.reported(1, loop.time())
        task = asyncio.ensure_future(watch.run())
        while not task.done():  # rank 1 keeps coming back, rank 0 went silent
            watch.reported(1, loop.time())
            await asyncio.sleep(0.02)  # the workload: a rank's loop every 20 ms
        return hangs

    hangs = asyncio.run(asyncio.wait_for(body(), 10))
    assert len(hangs) == 1
    assert hangs[0].startswith("DP rank 0 completed no engine step or loop iteration for 0.2s")


def test_ranks_silent_together_are_all_named() -> None:
    """In lockstep a hung rank's peers block in its next collective: every rank goes silent,
    and the hung one may well have reported last. None is singled out."""

    async def body() -> list[str]:
        hangs: list[str] = []
        watch = LivenessWatch(3, 0.2, hangs.append)
        loop = asyncio.get_running_loop()
        for rank in (0, 2, 1):  # the hung rank (1) reported last
            watch.reported(rank, loop.time())
        await asyncio.wait_for(watch.run(), 10)
        return hangs

    hangs = asyncio.run(body())
    assert hangs == [
        "DP ranks 0, 1 and 2 completed no engine step or loop iteration for 0.2s "
        "(--step-timeout); the engine is hung (in lockstep one hung rank holds up the others)"
    ]


def test_ranks_that_keep_reporting_and_ranks_not_started_are_not_hung() -> None:
    async def body() -> list[str]:
        hangs: list[str] = []
        watch = LivenessWatch(2, 0.2, hangs.append)  # rank 1 never reports: still starting
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(watch.run())
        for _ in range(40):  # 0.8 s: four timeouts
            watch.reported(0, loop.time())
            await asyncio.sleep(0.02)  # the workload: a rank's loop every 20 ms
        task.cancel()
        return hangs

    assert asyncio.run(body()) == []


def test_a_ready_rank_waiting_for_a_slower_peer_to_start_is_not_hung() -> None:
    """DP ranks load their weights at their own pace: one that is ready blocks in its first
    collective until the last one is, silent for longer than --step-timeout. The clocks start
    when the last rank reports; a rank that stops after that is still found."""

    async def body() -> list[str]:
        hangs: list[str] = []
        watch = LivenessWatch(2, 0.2, hangs.append)
        loop = asyncio.get_running_loop()
        watch.reported(1, loop.time())  # rank 1 ready, then waiting in a collective
        task = asyncio.ensure_future(watch.run())
        await asyncio.sleep(0.8)  # the workload: rank 0 loads for four timeouts
        assert hangs == []
        watch.reported(0, loop.time())  # rank 0 ready: both loops run
        for _ in range(20):
            watch.reported(0, loop.time())
            watch.reported(1, loop.time())
            await asyncio.sleep(0.02)  # the workload: a loop every 20 ms
        assert hangs == []
        while not task.done():  # now rank 1 stops coming back
            watch.reported(0, loop.time())
            await asyncio.sleep(0.02)
        return hangs

    hangs = asyncio.run(asyncio.wait_for(body(), 10))
    assert len(hangs) == 1 and hangs[0].startswith("DP rank 1 completed no engine step")


def test_nothing_is_hung_while_the_watch_is_told_not_to_watch() -> None:
    async def body() -> list[str]:
        hangs: list[str] = []
        watching = [False]
        watch = LivenessWatch(1, 0.2, hangs.append, watching=lambda: watching[0])
        watch.reported(0, asyncio.get_running_loop().time())
        task = asyncio.ensure_future(watch.run())
        await asyncio.sleep(0.6)  # the workload: silent for three timeouts while stopping
        assert hangs == []
        watching[0] = True
        await asyncio.wait_for(task, 5)
        return hangs

    assert len(asyncio.run(body())) == 1


def test_heartbeats_come_at_least_four_times_per_timeout() -> None:
    assert heartbeat_interval(300) == 1.0
    assert heartbeat_interval(0.4) == 0.1
    assert heartbeat_interval(0) == 1.0


@pytest.mark.e2e
def test_a_hung_step_fails_the_service_after_its_client_gave_up() -> None:
    """The issue's shape: the only request times out (its client gives up), so nothing is in
    flight, yet the rank is stuck in step(): /health must turn 503 all the same."""
    import httpx

    from tests.server import LiveServer

    args = (
        "--sim-fault", "step-hang", "--sim-fault-after-steps", "2",
        "--step-timeout", "1", "--request-timeout", "1",
    )  # fmt: skip
    with LiveServer(*args) as server:
        body = {
            "model": "deepseek-flash",
            "messages": [{"role": "user", "content": "x " * 50}],
            "max_tokens": 40,
            "ignore_eos": True,
        }
        response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 408  # the request timed out: nothing is in flight
        health = server.wait_for_health("failed", timeout=10)
        assert "completed no engine step or loop iteration" in health["reason"]
