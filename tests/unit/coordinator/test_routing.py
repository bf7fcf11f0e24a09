"""Admission and rank choice: the least-loaded rank, lowest number on ties; 429 when full; one
capacity and one choice across API server processes."""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest

from deepinfer_server.coordinator.admission import (
    Admission,
    SharedAdmission,
    choose_rank,
    shared_slots,
)
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


def _admit_twice(slots: Any, capacity: int, ranks: Any) -> None:
    """In another process: take two slots and report their ranks."""
    admission = SharedAdmission(capacity, slots)
    ranks.put([admission.admit(), admission.admit()])


def test_shared_admission_is_one_capacity_and_one_choice_across_processes() -> None:
    context = multiprocessing.get_context("spawn")
    slots = shared_slots(2)
    here = SharedAdmission(capacity=3, slots=slots)
    assert here.admit() == 0
    ranks = context.Queue()
    other = context.Process(target=_admit_twice, args=(slots, 3, ranks))
    other.start()
    assert ranks.get(timeout=30) == [1, 0]  # least loaded, counting this process's request
    other.join(30)
    assert here.in_flight == [2, 1]
    with pytest.raises(OverloadedError):
        here.admit()
    here.release(1)
    assert here.admit() == 1
