"""Admission and rank choice: the least-loaded rank, lowest number on ties; 429 when full."""

from __future__ import annotations

import pytest

from deepinfer_server.coordinator.admission import Admission, choose_rank
from deepinfer_server.errors import OverloadedError


def test_least_loaded_rank_wins() -> None:
    assert choose_rank([3, 1, 2]) == 1
    assert choose_rank([0, 0]) == 0
    assert choose_rank([2, 2, 1, 1]) == 2
    assert choose_rank([5]) == 0


def test_admission_fills_the_least_loaded_rank_and_refuses_beyond_capacity() -> None:
    admission = Admission(data_parallel_size=2, capacity=3)
    assert [admission.admit() for _ in range(3)] == [0, 1, 0]
    with pytest.raises(OverloadedError):
        admission.admit()
    admission.release(0)
    assert admission.admit() == 0
