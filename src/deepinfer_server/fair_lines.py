"""FairLines: what waits for a shared resource, in one line per key, taken in turn between keys.

One key's backlog must not hold up another key's work: each key waits in its own line, and the
next free slot goes to the key whose last turn came longest ago, a key new to the lines first
(round-robin between the keys that have something waiting). Within a key, first come, first
served. A key's turn is remembered while it holds anything (waiting or running) and forgotten
once it holds nothing, so a key that comes back later counts as new.

Pure bookkeeping, no waiting and no threads: the owner decides when a slot is free and pops the
next entry (`fair_turns.FairTurns`, which the preparation gate and the grammar compile queue
use). One event loop (or one thread) only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class FairLines(Generic[T]):
    """Entries waiting in one line per key; `pop()` takes them in turn between keys."""

    def __init__(self) -> None:
        self._lines: dict[str, deque[T]] = {}
        #: When each key holding something last had its turn (a count, not a time).
        self._turns: dict[str, int] = {}
        self._turn_count = 0

    def __len__(self) -> int:
        """How many entries wait, over every key."""
        return sum(len(line) for line in self._lines.values())

    def push(self, key: str, entry: T) -> None:
        """`entry` waits at the end of `key`'s line."""
        self._lines.setdefault(key, deque()).append(entry)

    def pop(self, eligible: Callable[[str], bool] | None = None) -> tuple[str, T] | None:
        """The next entry to serve and its key (the key whose turn came longest ago, a key new
        to the lines first; only among the keys `eligible` accepts, when given), or None when
        nothing (eligible) waits."""
        keys = [k for k in self._lines if eligible is None or eligible(k)]
        if not keys:
            return None
        key = min(keys, key=lambda k: self._turns.get(k, 0))
        line = self._lines[key]
        entry = line.popleft()
        if not line:
            del self._lines[key]
        self._turn_count += 1
        self._turns[key] = self._turn_count
        return key, entry

    def remove(self, key: str, entry: T) -> bool:
        """Take `entry` out of `key`'s line before its turn; False when it is not waiting."""
        line = self._lines.get(key)
        if line is None or entry not in line:
            return False
        line.remove(entry)
        if not line:
            del self._lines[key]
        return True

    def forget(self, key: str) -> None:
        """`key` holds nothing any more (none waiting, none running): its turn is forgotten."""
        if key not in self._lines:
            self._turns.pop(key, None)
