"""Admission: how many requests may be in flight, and on which rank each one runs."""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer_server.errors import OverloadedError


def choose_rank(in_flight: Sequence[int]) -> int:
    """The least-loaded rank; ties go to the lowest rank number."""
    return min(range(len(in_flight)), key=in_flight.__getitem__)


class Admission:
    """Capacity `dp * max_num_seqs + max_queued_requests`; 429 beyond it."""

    def __init__(self, data_parallel_size: int, capacity: int) -> None:
        self.capacity = capacity
        self.in_flight = [0] * data_parallel_size

    @property
    def total(self) -> int:
        return sum(self.in_flight)

    def admit(self) -> int:
        """Take a slot on the least-loaded rank and return that rank (429 when full)."""
        if self.total >= self.capacity:
            raise OverloadedError(
                f"the server is at capacity ({self.capacity} requests in flight); retry later"
            )
        rank = choose_rank(self.in_flight)
        self.in_flight[rank] += 1
        return rank

    def release(self, rank: int) -> None:
        self.in_flight[rank] -= 1
