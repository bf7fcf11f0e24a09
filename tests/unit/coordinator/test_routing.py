"""Admission and rank choice: the least-loaded rank, lowest number on ties; 429 when full; one
capacity and one choice across API server processes; with a prefix hint, the rank holding the
prompt's longest cached prefix unless it is much more loaded."""

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
from deepinfer_server.coordinator.prefix_routing import PrefixHint, PrefixRouting
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


POLICY = PrefixRouting.for_ranks_of(16)  # balance_abs 4, rel 1.5, 16 running slots


def _hint(held: list[int], prompt_tokens: int = 14_000) -> PrefixHint:
    return PrefixHint(held, prompt_tokens, POLICY)


def test_a_request_goes_to_the_rank_holding_its_longest_prefix() -> None:
    assert choose_rank([0, 3, 0], _hint([0, 13_952, 128])) == 1
    # Equal prefixes: the less loaded of their holders.
    assert choose_rank([2, 5, 1], _hint([13_952, 13_952, 0])) == 0


def test_a_short_or_small_share_of_a_prompt_is_not_worth_routing_for() -> None:
    assert choose_rank([1, 0], _hint([128, 0], prompt_tokens=200)) == 1  # below 256 tokens
    assert choose_rank([1, 0], _hint([4_096, 0], prompt_tokens=14_000)) == 1  # 29% <= 30%
    assert choose_rank([1, 0], _hint([4_352, 0], prompt_tokens=14_000)) == 0  # 31%


def test_the_holder_loses_the_request_only_when_it_is_much_more_loaded() -> None:
    held = [13_952, 0]
    assert choose_rank([5, 1], _hint(held)) == 0  # 4 more: not past the absolute threshold
    assert choose_rank([6, 1], _hint(held)) == 1  # 5 more and 6 times as many
    assert choose_rank([15, 10], _hint(held)) == 0  # 5 more but exactly 1.5 times as many
    assert choose_rank([15, 9], _hint(held)) == 1  # 6 more and 1.67 times as many
    assert choose_rank([15, 11], _hint(held)) == 0  # 4 more and 1.36 times as many


def test_a_full_holder_loses_the_request_to_a_rank_with_a_free_slot() -> None:
    held = [13_952, 0]
    assert choose_rank([16, 15], _hint(held)) == 1  # it would wait for a slot there
    assert choose_rank([17, 16], _hint(held)) == 0  # both full: the prefix decides


def test_admission_takes_the_hinted_rank_and_still_refuses_beyond_capacity() -> None:
    admission = Admission(data_parallel_size=2, capacity=3)
    hint = _hint([0, 13_952])
    assert [admission.admit(hint) for _ in range(3)] == [1, 1, 1]
    with pytest.raises(OverloadedError):
        admission.admit(hint)
    shared = SharedAdmission(capacity=3, slots=shared_slots(2))
    assert [shared.admit(hint), shared.admit()] == [1, 0]
