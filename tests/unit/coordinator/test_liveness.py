"""LivenessWatch times each rank's loop: a rank that stops coming back is hung whether or not
requests are in flight (a clock reset by each request's arrival let clients that gave up and
retried hide a hung rank)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from deepinfer_server.coordinator.liveness import LivenessWatch, heartbeat_interval


class ManualClock:
    """Loop time moved by hand: each wait of the watch's task moves it on at once, calling
    `between(now)` at every `period` it passes (the ranks' loops), so `run` never sleeps."""

    def __init__(self, between: Callable[[float], None] = lambda now: None) -> None:
        self.now = 0.0
        self.between = between
        self.period = 0.02

    def time(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        end = self.now + seconds
        while self.now + self.period <= end:
            self.now += self.period
            self.between(self.now)
        self.now = end


def test_an_idle_rank_whose_loop_stops_is_hung() -> None:
    hangs: list[str] = []
    clock = ManualClock()
    watch = LivenessWatch(2, 0.2, hangs.append, clock=clock.time, sleep=clock.sleep)
    watch.reported(0, clock.now)  # both ranks ready, nothing ever in flight
    watch.reported(1, clock.now)
    clock.between = lambda now: watch.reported(1, now)  # rank 1 keeps coming back, 0 is silent
    asyncio.run(watch.run())
    assert len(hangs) == 1
    assert hangs[0].startswith("DP rank 0 completed no engine step or loop iteration for 0.2s")
    assert 0.2 < clock.now <= 0.2 + watch.interval + 1e-9


def test_ranks_silent_together_are_all_named() -> None:
    """In lockstep a hung rank's peers block in its next collective: every rank goes silent,
    and the hung one may well have reported last. None is singled out."""
    hangs: list[str] = []
    clock = ManualClock()
    watch = LivenessWatch(3, 0.2, hangs.append, clock=clock.time, sleep=clock.sleep)
    for rank in (0, 2, 1):  # the hung rank (1) reported last
        watch.reported(rank, clock.now)
    asyncio.run(watch.run())
    assert hangs == [
        "DP ranks 0, 1 and 2 completed no engine step or loop iteration for 0.2s "
        "(--step-timeout); the engine is hung (in lockstep one hung rank holds up the others)"
    ]


class LoopTime:
    """The watch's loop time, moved by the test instead of a real clock: `run` replays the
    ranks' reports (a loop every `period`) and the watch's checks (every interval, as its task
    makes them) in time order, at once."""

    def __init__(self, watch: LivenessWatch) -> None:
        self.watch = watch
        self.now = 0.0
        self.hung = False
        self._next_check = watch.interval
        watch.started(self.now)

    def run(self, seconds: float, *reporting: int, period: float = 0.02) -> None:
        """`seconds` of loop time in which the ranks `reporting` report every `period`; stops
        early at a hang."""
        end = self.now + seconds + 1e-9
        next_report = self.now + period
        while not self.hung and min(self._next_check, next_report) <= end:
            if self._next_check <= next_report:
                self.now = self._next_check
                self.hung = self.watch.check(self.now)
                self._next_check += self.watch.interval
            else:
                self.now = next_report
                for rank in reporting:
                    self.watch.reported(rank, self.now)
                next_report += period


def test_ranks_that_keep_reporting_and_ranks_not_started_are_not_hung() -> None:
    hangs: list[str] = []
    watch = LivenessWatch(2, 0.2, hangs.append)  # rank 1 never reports: still starting
    LoopTime(watch).run(0.8, 0)  # four timeouts; rank 0's loop every 20 ms
    assert hangs == []


def test_a_ready_rank_waiting_for_a_slower_peer_to_start_is_not_hung() -> None:
    """DP ranks load their weights at their own pace: one that is ready blocks in its first
    collective until the last one is, silent for longer than --step-timeout. The clocks start
    when the last rank reports; a rank that stops after that is still found."""
    hangs: list[str] = []
    watch = LivenessWatch(2, 0.2, hangs.append)
    time = LoopTime(watch)
    watch.reported(1, time.now)  # rank 1 ready, then waiting in a collective
    time.run(0.8)  # rank 0 loads for four timeouts
    assert hangs == []
    watch.reported(0, time.now)  # rank 0 ready: both loops run
    time.run(0.4, 0, 1)
    assert hangs == []
    time.run(10, 0)  # now rank 1 stops coming back
    assert len(hangs) == 1 and hangs[0].startswith("DP rank 1 completed no engine step")
    assert time.now <= 0.8 + 0.4 + 0.2 + 2 * watch.interval


def test_nothing_is_hung_while_the_watch_is_told_not_to_watch() -> None:
    hangs: list[str] = []
    watching = [False]
    watch = LivenessWatch(1, 0.2, hangs.append, watching=lambda: watching[0])
    time = LoopTime(watch)
    watch.reported(0, time.now)
    time.run(0.6)  # silent for three timeouts while stopping
    assert hangs == []
    watching[0] = True
    time.run(5)
    assert len(hangs) == 1


def test_a_check_after_this_process_stalled_restarts_the_clocks() -> None:
    """A check long overdue means this process's own loop was held up, with the ranks'
    reports still unread: no rank is blamed for that silence."""
    hangs: list[str] = []
    watch = LivenessWatch(1, 0.2, hangs.append)
    watch.started(0.0)
    watch.reported(0, 0.0)
    assert not watch.check(5.0)  # the loop was held up for 5 s
    assert not watch.check(5.0 + watch.interval)
    assert watch.check(5.3) and len(hangs) == 1


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
