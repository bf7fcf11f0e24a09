"""Spawn targets for test_lockstep.py (importable top-level functions)."""

from __future__ import annotations

from multiprocessing.queues import Queue
from typing import Any

from deepinfer_server.engines.simulated.collectives import LockstepGroup
from deepinfer_server.errors import LockstepViolation
from deepinfer_server.ipc.stop_agreement import StopAgreement


def all_reduce(group: LockstepGroup, rank: int, value: int, results: Queue[Any]) -> None:
    results.put((rank, group.all_reduce_max(rank, value)))


def all_reduce_min(group: LockstepGroup, rank: int, value: int, results: Queue[Any]) -> None:
    results.put((rank, group.all_reduce_min(rank, value)))


def call_op(group: LockstepGroup, rank: int, op: str, results: Queue[Any]) -> None:
    try:
        if op == "step":
            group.barrier(rank)
        elif op == "vote":
            group.all_reduce_min(rank, 1)
        else:
            group.all_reduce_max(rank, 1)
        results.put((rank, "ok"))
    except LockstepViolation as exc:
        results.put((rank, str(exc)))


def loop_until_stopped(
    group: LockstepGroup, rank: int, stop: StopAgreement, results: Queue[Any]
) -> None:
    iteration = 0
    while not stop.should_stop(iteration):
        group.all_reduce_max(rank, 0)
        if iteration == 3 and rank == 0:
            stop.request_stop()
        iteration += 1
    results.put((rank, iteration))
