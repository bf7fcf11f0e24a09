"""Spawn targets for test_lockstep.py (importable top-level functions)."""

from __future__ import annotations

from multiprocessing.queues import Queue
from typing import Any

from deepinfer_server.engines.simulated.collectives import Ballot, LockstepGroup
from deepinfer_server.errors import LockstepViolation
from deepinfer_server.ipc.stop_agreement import StopAgreement


def work_check(
    group: LockstepGroup, rank: int, work: bool, ballot: Ballot | None, results: Queue[Any]
) -> None:
    results.put((rank, group.work_check(rank, work, ballot)))


def call_op(group: LockstepGroup, rank: int, op: str, results: Queue[Any]) -> None:
    """One rank's iteration: `op` is "step" (a step, then the next work check), "vote" (a
    prefill vote of its own), "work check with a vote" or "work check"."""
    try:
        if op == "step":
            group.enter_step(rank)
            group.work_check(rank, True, None)
        elif op == "vote":
            group.prefill_vote(rank, Ballot(True, True))
        elif op == "work check with a vote":
            group.work_check(rank, True, Ballot(True, True))
        else:
            group.work_check(rank, True, None)
        results.put((rank, "ok"))
    except LockstepViolation as exc:
        results.put((rank, str(exc)))


def rounds(group: LockstepGroup, rank: int, count: int, results: Queue[Any]) -> None:
    """`count` work checks whose prefill votes differ round by round (in round r, ranks 0 to
    r mod world_size want a prefill): each round must count its own ballots, never those of a
    peer already in the next round."""
    seen = []
    for round_ in range(count):
        ballot = Ballot(rank <= round_ % group.world_size, False)
        tally = group.work_check(rank, False, ballot).tally
        assert tally is not None
        seen.append(tally.wants)
        group.enter_step(rank)
    results.put((rank, seen))


def loop_until_stopped(
    group: LockstepGroup, rank: int, stop: StopAgreement, results: Queue[Any]
) -> None:
    iteration = 0
    while not stop.should_stop(iteration):
        group.work_check(rank, False, None)
        if iteration == 3 and rank == 0:
            stop.request_stop()
        iteration += 1
    results.put((rank, iteration))


def wait_for_abort(group: LockstepGroup, rank: int, results: Queue[Any]) -> None:
    try:
        group.work_check(rank, True, None)
        results.put((rank, "ok"))
    except LockstepViolation as exc:
        results.put((rank, str(exc)))
