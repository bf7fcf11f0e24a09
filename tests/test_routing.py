"""Rank choice: the least-loaded rank, lowest number on ties."""

from __future__ import annotations

from deepinfer_server.coordinator.routing import choose_rank


def test_least_loaded_rank_wins() -> None:
    assert choose_rank([3, 1, 2]) == 1
    assert choose_rank([0, 0]) == 0
    assert choose_rank([2, 2, 1, 1]) == 2
    assert choose_rank([5]) == 0
