"""LockstepGroup: collectives across real spawned processes fail loudly when ranks diverge."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

import pytest

from deepinfer_server.engines.simulated.collectives import LockstepGroup, new_lockstep_group
from deepinfer_server.ipc.stop_agreement import StopAgreement
from tests import lockstep_workers

CONTEXT = multiprocessing.get_context("spawn")
#: The ranks are real spawned processes: not the fast lane.
pytestmark = pytest.mark.e2e


def _run(
    group: LockstepGroup, target: Callable[..., None], per_rank: list[tuple[Any, ...]]
) -> dict[int, Any]:
    results = CONTEXT.Queue()
    processes = [
        CONTEXT.Process(target=target, args=(group, rank, *extra, results))
        for rank, extra in enumerate(per_rank)
    ]
    for process in processes:
        process.start()
    collected = dict(results.get(timeout=60) for _ in processes)
    for process in processes:
        process.join(30)
    return collected


def test_all_reduce_max_across_processes() -> None:
    group = new_lockstep_group(3, timeout=30)
    assert _run(group, lockstep_workers.all_reduce, [(0,), (5,), (2,)]) == {0: 5, 1: 5, 2: 5}


def test_all_reduce_min_across_processes() -> None:
    group = new_lockstep_group(3, timeout=30)
    assert _run(group, lockstep_workers.all_reduce_min, [(4,), (1,), (2,)]) == {0: 1, 1: 1, 2: 1}


def test_a_prefill_vote_against_another_collective_is_a_violation() -> None:
    group = new_lockstep_group(2, timeout=30)
    results = _run(group, lockstep_workers.call_op, [("vote",), ("all_reduce",)])
    assert all("different collectives" in message for message in results.values()), results


def test_different_collectives_in_one_round_are_a_violation() -> None:
    group = new_lockstep_group(2, timeout=30)
    results = _run(group, lockstep_workers.call_op, [("step",), ("all_reduce",)])
    assert all("different collectives" in message for message in results.values()), results


def test_a_rank_that_never_joins_is_a_violation() -> None:
    group = new_lockstep_group(2, timeout=0.5)
    results = _run(group, lockstep_workers.call_op, [("step",)])
    assert "out of lockstep" in results[0]


def test_every_rank_stops_at_the_same_iteration() -> None:
    group = new_lockstep_group(2, timeout=30)
    stop = StopAgreement()
    results = _run(group, lockstep_workers.loop_until_stopped, [(stop,), (stop,)])
    # Rank 0 asks to stop during iteration 3; the first rank to see it at the top of
    # iteration 4 proposes iteration 5, and both stop there.
    assert results[0] == results[1] == 5


def test_single_rank_group_needs_no_peers() -> None:
    group = new_lockstep_group(1, timeout=0.1)
    assert group.all_reduce_max(0, 7) == 7
    group.barrier(0)
    group.close_barrier(0, 0.1)
