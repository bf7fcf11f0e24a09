"""LockstepGroup: collectives across real spawned processes fail loudly when ranks diverge."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

import pytest

from deepinfer_server.engines.simulated.collectives import (
    Ballot,
    LockstepGroup,
    Tally,
    WorkCheck,
    new_lockstep_group,
)
from deepinfer_server.ipc.stop_agreement import StopAgreement
from tests import lockstep_workers

CONTEXT = multiprocessing.get_context("spawn")
#: The ranks are real spawned processes: not the fast lane.
pytestmark = pytest.mark.e2e


def _run(
    group: LockstepGroup,
    target: Callable[..., None],
    per_rank: list[tuple[Any, ...]],
    then: Callable[[], None] | None = None,
) -> dict[int, Any]:
    results = CONTEXT.Queue()
    processes = [
        CONTEXT.Process(target=target, args=(group, rank, *extra, results))
        for rank, extra in enumerate(per_rank)
    ]
    for process in processes:
        process.start()
    if then is not None:
        then()
    collected = dict(results.get(timeout=60) for _ in processes)
    for process in processes:
        process.join(30)
    return collected


def test_the_work_check_is_an_all_reduce_max_across_processes() -> None:
    group = new_lockstep_group(3, timeout=30)
    results = _run(group, lockstep_workers.work_check, [(False, None), (True, None), (False, None)])
    assert results == dict.fromkeys(range(3), WorkCheck(True, None))


def test_the_work_check_carries_every_ranks_prefill_votes() -> None:
    group = new_lockstep_group(3, timeout=30)
    ballots = [Ballot(True, False), Ballot(True, True), Ballot(False, False)]
    results = _run(group, lockstep_workers.work_check, [(False, b) for b in ballots])
    assert results == dict.fromkeys(range(3), WorkCheck(False, Tally(wants=2, schedulable=1)))


def test_each_round_reads_its_own_values() -> None:
    group = new_lockstep_group(3, timeout=30)
    results = _run(group, lockstep_workers.rounds, [(60,)] * 3)
    expected = [round_ % 3 + 1 for round_ in range(60)]
    assert results == dict.fromkeys(range(3), expected)


def test_a_prefill_vote_against_a_work_check_is_a_violation() -> None:
    group = new_lockstep_group(2, timeout=30)
    results = _run(group, lockstep_workers.call_op, [("vote",), ("work check",)])
    assert all("different collectives" in message for message in results.values()), results


def test_a_vote_at_an_attempt_point_only_one_rank_sees_is_a_violation() -> None:
    group = new_lockstep_group(2, timeout=30)
    results = _run(group, lockstep_workers.call_op, [("work check with a vote",), ("work check",)])
    assert all("different collectives" in message for message in results.values()), results


def test_a_step_only_one_rank_takes_is_a_violation_at_the_next_rendezvous() -> None:
    group = new_lockstep_group(2, timeout=30)
    results = _run(group, lockstep_workers.call_op, [("step",), ("work check",)])
    assert all("different collectives" in message for message in results.values()), results
    assert "rank 0: has_unfinished_requests after 1 step()s" in results[0], results


def test_a_rank_that_never_joins_is_a_violation() -> None:
    group = new_lockstep_group(2, timeout=0.5)
    results = _run(group, lockstep_workers.call_op, [("work check",)])
    assert "out of lockstep" in results[0]


def test_a_rank_whose_gatherer_never_joins_is_a_violation() -> None:
    group = new_lockstep_group(2, timeout=0.5)
    results = CONTEXT.Queue()
    process = CONTEXT.Process(
        target=lockstep_workers.call_op, args=(group, 1, "work check", results)
    )
    process.start()
    rank, message = results.get(timeout=60)
    process.join(30)
    assert rank == 1 and "out of lockstep" in message


def test_abort_breaks_the_waits_at_once() -> None:
    # Rank 2 never comes and the timeout is longer than the results are awaited: only the
    # abort (as the server's on a dead rank) can end the others' waits in time.
    group = new_lockstep_group(3, timeout=300)
    results = _run(group, lockstep_workers.wait_for_abort, [(), ()], then=group.abort)
    assert all("out of lockstep" in message for message in results.values()), results


def test_every_rank_stops_at_the_same_iteration() -> None:
    group = new_lockstep_group(2, timeout=30)
    stop = StopAgreement()
    results = _run(group, lockstep_workers.loop_until_stopped, [(stop,), (stop,)])
    # Rank 0 asks to stop during iteration 3; the first rank to see it at the top of
    # iteration 4 proposes iteration 5, and both stop there.
    assert results[0] == results[1] == 5


def test_single_rank_group_needs_no_peers() -> None:
    group = new_lockstep_group(1, timeout=0.1)
    assert group.work_check(0, True, Ballot(True, False)) == WorkCheck(True, Tally(1, 0))
    group.enter_step(0)
    group.close_barrier(0, 0.1)
