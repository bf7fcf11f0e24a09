"""Leases: rows a process holds for a while (a background response's run, a batch's line),
renewed while it works on them and taken over by any process once they end (their holder
died), declared once per table (`Lease`) with the durations every holder uses.

A lease is a holder column (the process) and a time column: either when the lease ends
(`ends=True`: a batch line's `lease_until`) or when its holder last renewed it (a run's
`heartbeat_at`, which ends `LEASE` later). Either way a lease has ended when its time column is
below the `cutoff` of now, and a claim that re-checks that in its `UPDATE ... WHERE` never lets
two processes hold one row at once (PostgreSQL's UPDATE re-reads a row another transaction
changed; SQLite has one writer).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Seconds a lease lasts without a renewal. Longer than the store's own bounds on a write
#: (SQLite's busy timeout, PostgreSQL's statement timeout), so that a slow renewal is not taken
#: for a dead process.
LEASE = 10.0
#: Seconds between two renewals of the leases a process holds.
HEARTBEAT_INTERVAL = 1.0

#: A fragment of SQL and its parameters.
Clause = tuple[str, tuple[object, ...]]


@dataclass(frozen=True)
class Lease:
    """How `table` holds rows under lease: `holder` (the process), and `time`, the lease's end
    (`ends`) or its last renewal."""

    table: str
    holder: str
    time: str
    ends: bool

    def stamp(self, now: float, seconds: float = LEASE) -> float:
        """What `time` holds for a lease taken or renewed `now` for `seconds`."""
        return now + seconds if self.ends else now

    def cutoff(self, now: float, seconds: float = LEASE) -> float:
        """The `time` below which a lease of `seconds` has ended, `now`."""
        return now if self.ends else now - seconds

    def take(self, owner: str, stamp: float) -> Clause:
        """The assignments that give the rows to `owner` (a `SET` list)."""
        return f"{self.holder} = ?, {self.time} = ?", (owner, stamp)

    def renew(self, stamp: float) -> Clause:
        """The assignment that renews the rows' lease."""
        return f"{self.time} = ?", (stamp,)

    def release(self) -> str:
        """The assignments that give the rows back: nobody holds them."""
        return f"{self.holder} = NULL, {self.time} = NULL"

    def free(self, cutoff: float) -> Clause:
        """The condition of rows nobody holds, or whose lease ended before `cutoff`."""
        return f"({self.holder} IS NULL OR {self.time} < ?)", (cutoff,)

    def takeable(self, owner: str, cutoff: float) -> Clause:
        """The condition of rows `owner` holds already, or whose lease ended."""
        return f"({self.holder} = ? OR {self.time} < ?)", (owner, cutoff)

    def ended(self, cutoff: float) -> Clause:
        """The condition of held rows whose lease ended before `cutoff`."""
        return f"{self.time} < ?", (cutoff,)

    def live(self, cutoff: float) -> Clause:
        """The condition of rows some process holds under a lease not ended at `cutoff`."""
        return f"{self.holder} IS NOT NULL AND {self.time} >= ?", (cutoff,)
