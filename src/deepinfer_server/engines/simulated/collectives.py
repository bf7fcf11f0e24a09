"""LockstepGroup: the DP collectives the simulated engine blocks on (shared memory).

Created in the API process by the simulated backend before the ranks are spawned, and handed
to each. `all_reduce_max`, `all_reduce_min`, `barrier` and `close_barrier` stand in for
DeepInfer's gloo/NCCL DP group (`all_reduce_min` is the scheduler's prefill vote). Each call
records which operation the rank entered, so ranks that call different collectives in the
same round fail with a `LockstepViolation` instead of silently pairing up;
a peer that never arrives makes the call time out with the same error, as a hung GPU node would.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable
from multiprocessing.context import SpawnContext
from typing import Any

from deepinfer_server.errors import LockstepViolation

_OP_NAMES = {1: "has_unfinished_requests", 2: "step", 4: "a prefill vote"}
OP_ALL_REDUCE = 1
OP_STEP = 2
OP_ALL_REDUCE_MIN = 4


class LockstepGroup:
    """Barrier-based collectives shared by all ranks of one server."""

    def __init__(self, context: SpawnContext, world_size: int, timeout: float) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self._barrier: Any = context.Barrier(world_size)
        self._close_barrier: Any = context.Barrier(world_size)
        # Two sets of slots, used alternately: one rendezvous per collective suffices, because a
        # rank can only reuse a set after every peer has passed the next rendezvous (and so
        # finished reading it).
        self._values: Any = context.Array("q", 2 * world_size, lock=False)
        self._ops: Any = context.Array("q", 2 * world_size, lock=False)
        self._round = 0  # per process; equal on every rank while they are in lockstep
        self._mismatch_seen: Any = context.Value("b", 0, lock=False)

    def all_reduce_max(self, rank: int, value: int) -> int:
        """MAX of `value` over all ranks; every rank must call it in the same round."""
        return self._all_reduce(rank, value, OP_ALL_REDUCE, max)

    def all_reduce_min(self, rank: int, value: int) -> int:
        """MIN of `value` over all ranks (the prefill votes); same rules as `all_reduce_max`."""
        return self._all_reduce(rank, value, OP_ALL_REDUCE_MIN, min)

    def _all_reduce(
        self, rank: int, value: int, op: int, reduce: Callable[[list[int]], int]
    ) -> int:
        if self.world_size == 1:
            return value
        base = self._next_slots()
        self._values[base + rank] = value
        self._enter(rank, op, base)
        return int(reduce(list(self._values[base : base + self.world_size])))

    def barrier(self, rank: int) -> None:
        """The step collective: returns once every rank has entered its step."""
        if self.world_size == 1:
            return
        self._enter(rank, OP_STEP, self._next_slots())

    def close_barrier(self, rank: int, timeout: float) -> None:
        """The world barrier of `close()`: every rank must close together."""
        if self.world_size == 1:
            return
        try:
            self._close_barrier.wait(timeout)
        except threading.BrokenBarrierError:
            raise LockstepViolation(
                f"DP rank {rank} waited {timeout:g}s in close(): not every rank closed"
            ) from None

    def abort(self) -> None:
        """Break every collective at once (a peer died): waiting ranks raise LockstepViolation."""
        self._barrier.abort()
        self._close_barrier.abort()

    def _next_slots(self) -> int:
        base = (self._round % 2) * self.world_size
        self._round += 1
        return base

    def _enter(self, rank: int, op: int, base: int) -> None:
        self._ops[base + rank] = op
        try:
            self._barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            raise self._violation(rank, op, base) from None
        if self._mismatch(base) is not None:
            self._mismatch_seen.value = 1
            self._barrier.abort()
            raise self._violation(rank, op, base)

    def _mismatch(self, base: int) -> str | None:
        ops = list(self._ops[base : base + self.world_size])
        if len(set(ops)) == 1:
            return None
        return ", ".join(f"rank {r}: {_OP_NAMES.get(o, str(o))}" for r, o in enumerate(ops))

    def _violation(self, rank: int, op: int, base: int) -> LockstepViolation:
        # Slots of ranks that never arrived hold stale operations: trust the table only when
        # a rank that passed the rendezvous saw the mismatch.
        mismatch = self._mismatch(base) if self._mismatch_seen.value else None
        if mismatch is not None:
            return LockstepViolation(f"DP ranks entered different collectives ({mismatch})")
        return LockstepViolation(
            f"DP rank {rank} waited in {_OP_NAMES[op]}() but the other ranks did not join "
            f"within {self.timeout:g}s, or a peer failed: the DP ranks are out of lockstep"
        )


def new_lockstep_group(world_size: int, timeout: float) -> LockstepGroup:
    """A group for `world_size` spawned rank processes."""
    return LockstepGroup(multiprocessing.get_context("spawn"), world_size, timeout)
