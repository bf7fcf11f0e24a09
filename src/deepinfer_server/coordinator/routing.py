"""Rank choice for a new request, as a pure function."""

from __future__ import annotations

from collections.abc import Sequence


def choose_rank(in_flight: Sequence[int]) -> int:
    """The least-loaded rank; ties go to the lowest rank number."""
    return min(range(len(in_flight)), key=in_flight.__getitem__)
