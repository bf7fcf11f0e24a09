"""Admission: how many requests may be in flight, and on which rank each one runs.

A request goes to the least-loaded rank, or, with a `PrefixHint`, to the rank that holds its
prompt's longest cached prefix unless that one is much more loaded (`prefix_routing.py`); the
choice reads the counts under the same lock that takes the slot.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator, Sequence
from typing import Any

from deepinfer_server.coordinator.prefix_routing import PrefixHint
from deepinfer_server.errors import OverloadedError, ServiceFailedError


def choose_rank(in_flight: Sequence[int], hint: PrefixHint | None = None) -> int:
    """The least-loaded rank (ties go to the lowest rank number), or the hint's choice."""
    least = min(range(len(in_flight)), key=in_flight.__getitem__)
    return least if hint is None else hint.choose(in_flight, least)


class Admission:
    """Capacity `dp * max_num_seqs + max_queued_requests`; 429 beyond it."""

    def __init__(self, data_parallel_size: int, capacity: int) -> None:
        self.capacity = capacity
        self.in_flight = [0] * data_parallel_size

    @property
    def total(self) -> int:
        return sum(self.in_flight)

    def admit(self, hint: PrefixHint | None = None) -> int:
        """Take a slot on the chosen rank and return that rank (429 when full)."""
        if self.total >= self.capacity:
            raise OverloadedError(
                f"the server is at capacity ({self.capacity} requests in flight); retry later"
            )
        rank = choose_rank(self.in_flight, hint)
        self.in_flight[rank] += 1
        return rank

    def release(self, rank: int) -> None:
        self.in_flight[rank] -= 1


#: Seconds to wait for the shared counts' lock; only an API process killed while holding it
#: (for microseconds) makes anyone wait that long.
_LOCK_TIMEOUT = 1.0


def shared_slots(data_parallel_size: int) -> Any:
    """Per-rank in-flight counts in shared memory with their lock, for `SharedAdmission`
    (create them before spawning the API server processes and hand them to each)."""
    return multiprocessing.get_context("spawn").Array("q", data_parallel_size)


class SharedAdmission:
    """`Admission` across every API server process (`--api-server-count`): the per-rank counts
    live in shared memory, so capacity and the rank choice see every process's requests."""

    def __init__(self, capacity: int, slots: Any) -> None:
        self.capacity = capacity
        self._slots = slots

    @property
    def in_flight(self) -> list[int]:
        with self._locked():
            return list(self._slots.get_obj())

    @property
    def total(self) -> int:
        return sum(self.in_flight)

    def admit(self, hint: PrefixHint | None = None) -> int:
        """Take a slot on the chosen rank and return that rank (429 when full)."""
        with self._locked():
            counts = self._slots.get_obj()
            if sum(counts) >= self.capacity:
                raise OverloadedError(
                    f"the server is at capacity ({self.capacity} requests in flight); retry later"
                )
            rank = choose_rank(counts, hint)
            counts[rank] += 1
            return rank

    def release(self, rank: int) -> None:
        with self._locked():
            self._slots.get_obj()[rank] -= 1

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        lock = self._slots.get_lock()
        if not lock.acquire(timeout=_LOCK_TIMEOUT):
            raise ServiceFailedError("the admission counts are held by a dead API server process")
        try:
            yield
        finally:
            lock.release()
