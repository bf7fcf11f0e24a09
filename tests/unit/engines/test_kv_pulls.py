"""A decode rank's KV pulls, peer by peer: a fake transfer agent whose reads from one peer block
until the test lets them go, so a hung prefill peer is reproduced without a transfer library."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import cast

import msgspec
import pytest

from deepinfer_server.disaggregation.handoff.params import KVTransferParams
from deepinfer_server.disaggregation.transfer import lanes, pulls
from deepinfer_server.disaggregation.transfer.agent import TransferAgent
from deepinfer_server.disaggregation.transfer.pulls import PullResult, Pulls
from tests.server import refusing_port

HUNG = "10.0.0.1:15000"
WELL = "10.0.0.2:15000"
PIECES = [(1 << 20, 1 << 21, 4096)]


class FakeAgent:
    """Reads return at once, except those from `hung`, which wait for `go` (then succeed)."""

    def __init__(self, hung: str) -> None:
        self.hung = hung
        self.go = threading.Event()
        self.lock = threading.Lock()
        #: Reads from the hung peer under way now.
        self.stuck = 0
        self.all_stuck = threading.Event()
        self.threads = lanes.PULL_THREADS_PER_PEER

    def read(self, session: str, pieces: Sequence[tuple[int, int, int]]) -> int:
        if session == self.hung:
            with self.lock:
                self.stuck += 1
                if self.stuck == self.threads:
                    self.all_stuck.set()
            assert self.go.wait(30), "the test never let the hung peer's reads go"
        return sum(length for _, _, length in pieces)


def handoff(peer: str, transfer_id: str) -> KVTransferParams:
    host, port = peer.split(":")
    return KVTransferParams(
        remote_host=host,
        remote_port=int(port),
        remote_bootstrap_port=8998,
        remote_dp_rank=0,
        remote_engine_id="0123abcd",
        transfer_id=transfer_id,
        remote_block_ids=[4],
        remote_kv_address=1 << 21,
        remote_state_address=1 << 22,
        remote_state_slot=2,
        first_token_id=42,
        prompt_length=100,
    )


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def released(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The transfer IDs whose release notice was sent (no prefill side listens here)."""
    sent: list[str] = []
    lock = threading.Lock()

    def record(params: KVTransferParams) -> None:
        with lock:
            sent.append(params.transfer_id)

    monkeypatch.setattr(pulls, "release", record)
    return sent


@pytest.fixture
def agent() -> Iterator[FakeAgent]:
    fake = FakeAgent(HUNG)
    yield fake
    fake.go.set()  # no thread stays stuck past the test


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def kv_pulls(agent: FakeAgent, clock: Clock, monkeypatch: pytest.MonkeyPatch) -> Iterator[Pulls]:
    monkeypatch.setattr(pulls, "_first_contact", lambda params: None)  # no bootstrap port here
    made = Pulls(cast(TransferAgent, agent), clock=clock)
    yield made
    made.close()


def submit(kv_pulls: Pulls, peer: str, request_id: str) -> None:
    kv_pulls.submit(request_id, handoff(peer, f"t-{request_id}"), PIECES, lambda: None)


def wait_for(kv_pulls: Pulls, request_ids: set[str], seconds: float = 10.0) -> list[PullResult]:
    """Take finished pulls until those of `request_ids` are among them (bounded in time)."""
    taken: list[PullResult] = []
    deadline = time.monotonic() + seconds
    while not request_ids <= {result.request_id for result in taken}:
        assert time.monotonic() < deadline, f"pulls never finished: {request_ids}"
        taken.extend(kv_pulls.take_done())
    return taken


def wait_released(released: list[str], transfer_ids: set[str], seconds: float = 10.0) -> None:
    """Releases go out on the peer's own thread: wait (bounded) until `transfer_ids` went."""
    deadline = time.monotonic() + seconds
    while not transfer_ids <= set(released):
        assert time.monotonic() < deadline, f"releases never sent: {transfer_ids}"


def stall(kv_pulls: Pulls, agent: FakeAgent, count: int) -> list[str]:
    """`count` pulls from the hung peer; returns their request IDs once every thread of the
    peer is stuck in a read."""
    ids = [f"h{index}" for index in range(count)]
    for request_id in ids:
        submit(kv_pulls, HUNG, request_id)
    assert agent.all_stuck.wait(10)
    return ids


def test_a_hung_peer_holds_only_its_own_threads(
    kv_pulls: Pulls, agent: FakeAgent, released: list[str]
) -> None:
    stall(kv_pulls, agent, lanes.PULL_THREADS_PER_PEER + 2)
    well = {f"w{index}" for index in range(lanes.PULL_THREADS_PER_PEER * 2)}
    for request_id in sorted(well):
        submit(kv_pulls, WELL, request_id)
    results = wait_for(kv_pulls, well)
    assert {r.request_id for r in results} == well
    assert all(r.failure is None and r.nbytes == 4096 for r in results)
    assert kv_pulls.take_done() == []  # the hung peer's pulls are all still waiting


def test_a_queued_pull_is_cancelled_at_once_and_a_started_one_is_quarantined(
    kv_pulls: Pulls, agent: FakeAgent, released: list[str]
) -> None:
    ids = stall(kv_pulls, agent, lanes.PULL_THREADS_PER_PEER + 1)
    running, queued = ids[0], ids[-1]
    assert kv_pulls.abandon(queued) is True  # never started: its blocks are free now
    assert kv_pulls.abandon(running) is False  # its read may still write: keep its blocks
    assert kv_pulls.healthy(handoff(HUNG, "x"))  # an abort says nothing of the peer
    agent.go.set()
    results = wait_for(kv_pulls, {running})
    assert queued not in {r.request_id for r in results}  # a cancelled pull reports nothing
    assert "t-" + queued not in released  # the caller sends its release


def test_a_timed_out_pull_makes_its_peer_sick_and_fails_what_queued_behind_it(
    kv_pulls: Pulls, agent: FakeAgent, clock: Clock, released: list[str]
) -> None:
    ids = stall(kv_pulls, agent, lanes.PULL_THREADS_PER_PEER + 2)
    queued = set(ids[lanes.PULL_THREADS_PER_PEER :])
    assert kv_pulls.abandon(ids[0], timed_out=True) is False
    failed = kv_pulls.take_done()
    assert {r.request_id for r in failed} == queued
    assert {r.failure.reason for r in failed if r.failure} == {"peer_unhealthy"}
    wait_released(released, {f"t-{request_id}" for request_id in queued})

    assert not kv_pulls.healthy(handoff(HUNG, "x"))
    assert kv_pulls.healthy(handoff(WELL, "x"))
    submit(kv_pulls, HUNG, "late")  # a new pull from the sick peer fails without queueing
    (late,) = kv_pulls.take_done()
    assert (late.request_id, late.failure and late.failure.reason) == ("late", "peer_unhealthy")

    clock.now += lanes.SICK_SECONDS
    assert kv_pulls.healthy(handoff(HUNG, "x"))  # sick for a while, not for ever


def test_a_stuck_read_that_returns_releases_and_makes_its_peer_well_again(
    kv_pulls: Pulls, agent: FakeAgent, released: list[str]
) -> None:
    ids = stall(kv_pulls, agent, lanes.PULL_THREADS_PER_PEER)
    kv_pulls.abandon(ids[0], timed_out=True)
    assert not kv_pulls.healthy(handoff(HUNG, "x"))
    agent.go.set()
    results = wait_for(kv_pulls, set(ids))
    assert all(r.failure is None for r in results)
    wait_released(released, {f"t-{request_id}" for request_id in ids})
    assert kv_pulls.healthy(handoff(HUNG, "x"))


def test_abandoning_a_pull_whose_result_is_queued_keeps_it_for_the_taker(
    kv_pulls: Pulls, released: list[str]
) -> None:
    submit(kv_pulls, WELL, "w")
    wait_released(released, {"t-w"})  # a pull's release follows its result onto the queue
    assert kv_pulls.abandon("w", timed_out=True) is False
    assert [r.request_id for r in kv_pulls.take_done()] == ["w"]
    assert kv_pulls.healthy(handoff(WELL, "x"))


def test_a_peer_that_does_not_answer_a_ping_is_never_read_from(
    agent: FakeAgent, released: list[str]
) -> None:
    # The library opens a new peer under its one lock: a stalled one would hold every read up.
    with refusing_port() as port:
        params = msgspec.structs.replace(
            handoff(HUNG, "t"), remote_host="127.0.0.1", remote_bootstrap_port=port
        )
        kv_pulls = Pulls(cast(TransferAgent, agent))
        try:
            kv_pulls.submit("r", params, PIECES, lambda: None)
            (result,) = wait_for(kv_pulls, {"r"})
        finally:
            kv_pulls.close()
    assert result.failure is not None and result.failure.reason == "transfer_error"
    assert "did not answer" in str(result.failure)
    assert agent.stuck == 0  # its read never started


def test_a_peers_threads_are_let_go_once_it_has_been_idle_a_while(
    kv_pulls: Pulls, agent: FakeAgent, clock: Clock, released: list[str]
) -> None:
    submit(kv_pulls, WELL, "w")
    agent.threads = 1
    ids = stall(kv_pulls, agent, 1)  # the hung peer keeps a pull in flight
    wait_for(kv_pulls, {"w"})
    assert kv_pulls.peers() == {WELL, HUNG}
    clock.now += lanes.IDLE_SECONDS - 1
    kv_pulls.take_done()
    assert kv_pulls.peers() == {WELL, HUNG}  # not idle long enough yet
    clock.now += 1
    kv_pulls.take_done()
    assert kv_pulls.peers() == {HUNG}  # a lane with a read in flight is never closed
    agent.go.set()
    wait_for(kv_pulls, set(ids))
    clock.now += lanes.IDLE_SECONDS
    kv_pulls.take_done()
    assert kv_pulls.peers() == set()
    submit(kv_pulls, WELL, "again")  # a peer that comes back gets a lane again
    assert [r.request_id for r in wait_for(kv_pulls, {"again"})] == ["again"]
    wait_released(released, {"t-w", "t-again"})
