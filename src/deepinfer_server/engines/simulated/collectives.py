"""LockstepGroup: the DP collectives the simulated engine blocks on (shared memory).

Created in the API process by the simulated backend before the ranks are spawned, and handed
to each. They stand in for DeepInfer's gloo/NCCL DP group, with one rendezvous per engine
iteration: `work_check` is `has_unfinished_requests()`'s all-reduce MAX and carries the
scheduler's prefill votes when the step is at an attempt point (each rank writes its values
into shared memory, passes one barrier, then reads every rank's); `prefill_vote` is a vote
taken on its own, for a step that had no work check before it; `enter_step` counts a step,
whose agreement the next rendezvous checks; `close_barrier` is `close()`'s world barrier.

Each rendezvous records which operation every rank entered and how many steps it has taken,
so ranks that call different collectives fail with a `LockstepViolation` instead of silently
pairing up; a peer that never arrives makes the call time out with the same error, as a hung
GPU node would, and `abort()` (a peer died) breaks every wait at once.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from multiprocessing.context import SpawnContext
from typing import Any, NamedTuple

from deepinfer_server.errors import LockstepViolation

OP_WORK_CHECK = 1
OP_WORK_CHECK_VOTE = 2
OP_PREFILL_VOTE = 3
_OP_NAMES = {
    OP_WORK_CHECK: "has_unfinished_requests",
    OP_WORK_CHECK_VOTE: "has_unfinished_requests with a prefill vote",
    OP_PREFILL_VOTE: "a prefill vote",
}
#: Each rank's slots in a round: operation, steps taken, work, wants a prefill, can schedule.
_FIELDS = 5


class Ballot(NamedTuple):
    """One rank's prefill votes at an attempt point (DeepInfer's two scheduler all-reduces)."""

    #: KV usage at or below the watermark and a prompt ready at the head of the queue.
    want: bool
    #: It wants, and the head of its queue would be scheduled (or end ignored) this step.
    schedulable: bool


class Tally(NamedTuple):
    """The group's prefill votes: how many ranks cast each."""

    wants: int
    schedulable: int


class WorkCheck(NamedTuple):
    """What a work check agreed: whether any rank has work, and the votes if any were cast."""

    unfinished: bool
    tally: Tally | None


class Rendezvous:
    """A reusable, breakable barrier for processes, waiting on POSIX semaphores (futexes).

    Each rank has an inbox semaphore per round parity. Entering a round, a rank posts once to
    every peer's inbox, then takes one post from each peer out of its own: the last rank to
    arrive wakes every waiting peer directly (one wake-up on the critical path), and no lock or
    condition variable is involved (`multiprocessing.Barrier` takes a shared lock and
    acknowledges every wake-up, several context switches per rank and round). The inboxes
    alternate by round parity, so a rank already in the next round cannot feed a peer still
    leaving this one. A rank killed at any moment holds nothing: `abort()` marks the barrier
    broken and posts enough to wake every waiter. Waiting ranks sleep rather than spin or
    yield: the ranks often outnumber the cores, and yielding measured no faster.
    """

    def __init__(self, context: SpawnContext, parties: int) -> None:
        self.parties = parties
        self._inboxes: list[tuple[Any, Any]] = [
            (context.Semaphore(0), context.Semaphore(0)) for _ in range(parties)
        ]
        self._broken: Any = context.RawValue("b", 0)

    def wait(self, rank: int, parity: int, timeout: float) -> None:
        """Return once all `parties` ranks entered round `parity` (0 or 1, alternating); raise
        `threading.BrokenBarrierError` after `timeout` seconds, or once the barrier is broken."""
        if self._broken.value:
            raise threading.BrokenBarrierError
        for peer, inbox in enumerate(self._inboxes):
            if peer != rank:
                inbox[parity].release()
        mine = self._inboxes[rank][parity]
        deadline = None
        for _ in range(self.parties - 1):
            if mine.acquire(False):  # the last rank to arrive finds every post there
                continue
            if deadline is None:
                deadline = time.monotonic() + timeout
            if not mine.acquire(True, max(0.0, deadline - time.monotonic())):
                self.abort()  # as threading.Barrier: a timeout breaks the barrier for everyone
                raise threading.BrokenBarrierError
        if self._broken.value:
            raise threading.BrokenBarrierError

    def abort(self) -> None:
        """Break the barrier for good: every rank waiting now or later raises."""
        self._broken.value = 1
        for inbox in self._inboxes:
            for semaphore in inbox:
                for _ in range(self.parties):
                    semaphore.release()


class LockstepGroup:
    """The collectives shared by all ranks of one server."""

    def __init__(self, context: SpawnContext, world_size: int, timeout: float) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self._rendezvous = Rendezvous(context, world_size)
        self._close = Rendezvous(context, world_size)
        # Two sets of slots, used alternately: one rendezvous per round suffices, because a
        # rank can only reuse a set after every peer has passed the next rendezvous (and so
        # finished reading it).
        self._slots: Any = context.RawArray("q", 2 * world_size * _FIELDS)
        self._mismatch_seen: Any = context.RawValue("b", 0)
        # Per process (copies share the rest); equal on every rank while they are in lockstep.
        self._round = 0
        self._steps = 0
        self._closes = 0

    def work_check(self, rank: int, work: bool, ballot: Ballot | None) -> WorkCheck:
        """`has_unfinished_requests()`: whether any rank has work (an all-reduce MAX), and the
        prefill votes of the coming step when it is at an attempt point, where every rank
        passes its ballot (the attempt points are the same on every rank)."""
        if self.world_size == 1:
            return WorkCheck(work, None if ballot is None else Tally(*ballot))
        op = OP_WORK_CHECK if ballot is None else OP_WORK_CHECK_VOTE
        rows = self._exchange(rank, op, int(work), ballot)
        tally = None if ballot is None else _tally([Ballot(bool(r[3]), bool(r[4])) for r in rows])
        return WorkCheck(any(r[2] for r in rows), tally)

    def prefill_vote(self, rank: int, ballot: Ballot) -> Tally:
        """The prefill votes of a step that no work check carried (same rules)."""
        if self.world_size == 1:
            return Tally(*ballot)
        rows = self._exchange(rank, OP_PREFILL_VOTE, 0, ballot)
        return _tally([Ballot(bool(r[3]), bool(r[4])) for r in rows])

    def enter_step(self, rank: int) -> None:
        """A step begins. Every rank must take the same steps between two rendezvous; the next
        one checks that, so a step needs no rendezvous of its own."""
        self._steps += 1

    def close_barrier(self, rank: int, timeout: float) -> None:
        """The world barrier of `close()`: every rank must close together."""
        if self.world_size == 1:
            return
        parity = self._closes % 2
        self._closes += 1
        try:
            self._close.wait(rank, parity, timeout)
        except threading.BrokenBarrierError:
            raise LockstepViolation(
                f"DP rank {rank} waited {timeout:g}s in close(): not every rank closed"
            ) from None

    def abort(self) -> None:
        """Break every collective at once (a peer died): waiting ranks raise LockstepViolation."""
        self._rendezvous.abort()
        self._close.abort()

    def _exchange(self, rank: int, op: int, work: int, ballot: Ballot | None) -> list[list[int]]:
        """One rendezvous: write this rank's slots, wait for every rank, read all of them."""
        parity = self._round % 2
        self._round += 1
        base = parity * self.world_size * _FIELDS
        mine = base + rank * _FIELDS
        want, schedulable = ballot if ballot is not None else (False, False)
        self._slots[mine : mine + _FIELDS] = [op, self._steps, work, int(want), int(schedulable)]
        try:
            self._rendezvous.wait(rank, parity, self.timeout)
        except threading.BrokenBarrierError:
            raise self._violation(rank, op, base) from None
        rows = self._rows(base)
        if _mismatch(rows) is not None:
            self._mismatch_seen.value = 1
            self._rendezvous.abort()
            raise self._violation(rank, op, base)
        return rows

    def _rows(self, base: int) -> list[list[int]]:
        flat = self._slots[base : base + self.world_size * _FIELDS]
        return [flat[r * _FIELDS : (r + 1) * _FIELDS] for r in range(self.world_size)]

    def _violation(self, rank: int, op: int, base: int) -> LockstepViolation:
        # Slots of ranks that never arrived hold stale operations: trust the table only when
        # a rank that passed the rendezvous saw the mismatch.
        mismatch = _mismatch(self._rows(base)) if self._mismatch_seen.value else None
        if mismatch is not None:
            return LockstepViolation(f"DP ranks entered different collectives ({mismatch})")
        return LockstepViolation(
            f"DP rank {rank} waited in {_OP_NAMES[op]}() but the other ranks did not join "
            f"within {self.timeout:g}s, or a peer failed: the DP ranks are out of lockstep"
        )


def _tally(ballots: list[Ballot]) -> Tally:
    return Tally(sum(b.want for b in ballots), sum(b.schedulable for b in ballots))


def _mismatch(rows: list[list[int]]) -> str | None:
    """None when every rank entered the same operation after the same number of steps."""
    if len({(row[0], row[1]) for row in rows}) == 1:
        return None
    return ", ".join(
        f"rank {r}: {_OP_NAMES.get(row[0], str(row[0]))} after {row[1]} step()s"
        for r, row in enumerate(rows)
    )


def new_lockstep_group(world_size: int, timeout: float) -> LockstepGroup:
    """A group for `world_size` spawned rank processes."""
    return LockstepGroup(multiprocessing.get_context("spawn"), world_size, timeout)
