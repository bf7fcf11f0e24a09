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
    SharedState,
    Ticket,
    choose_rank,
    shared_state,
)
from deepinfer_server.coordinator.prefix_routing import PrefixHint, PrefixRouting
from deepinfer_server.errors import OverloadedError


def test_least_loaded_rank_wins() -> None:
    assert choose_rank([3, 1, 2]) == 1
    assert choose_rank([0, 0]) == 0
    assert choose_rank([2, 2, 1, 1]) == 2
    assert choose_rank([5]) == 0


def _start(admission: Admission, hint: PrefixHint | None = None) -> Ticket:
    """Admit a request and start what may start (with no running limit: it)."""
    ticket = admission.admit(hint=hint)
    admission.ready()
    return ticket


def _rank(admission: Admission, hint: PrefixHint | None = None) -> int | None:
    return _start(admission, hint).rank


def test_admission_fills_the_least_loaded_rank_and_refuses_beyond_capacity() -> None:
    admission = Admission(data_parallel_size=2, capacity=3)
    tickets = [_start(admission) for _ in range(3)]
    assert [ticket.rank for ticket in tickets] == [0, 1, 0]
    with pytest.raises(OverloadedError):
        admission.admit()
    admission.release(tickets[0])
    assert _rank(admission) == 0


def _shared(state: SharedState, process: int, capacity: int = 3) -> SharedAdmission:
    return SharedAdmission(2, capacity, state, process)


def _admit_twice(state: SharedState, ranks: Any) -> None:
    """In another process: take two slots and report their ranks."""
    admission = _shared(state, 1)
    ranks.put([_rank(admission), _rank(admission)])


@pytest.mark.e2e  # a spawned process
def test_shared_admission_is_one_capacity_and_one_choice_across_processes() -> None:
    context = multiprocessing.get_context("spawn")
    state = shared_state(2, 1, processes=2)
    here = _shared(state, 0)
    first = _start(here)
    assert first.rank == 0
    ranks = context.Queue()
    other = context.Process(target=_admit_twice, args=(state, ranks))
    other.start()
    assert ranks.get(timeout=30) == [1, 0]  # least loaded, counting this process's request
    other.join(30)
    assert here.in_flight == [2, 1]
    with pytest.raises(OverloadedError):
        here.admit()
    here.release(first)
    assert _rank(here) == 0


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
    assert [_rank(admission, hint) for _ in range(3)] == [1, 1, 1]
    with pytest.raises(OverloadedError):
        admission.admit(hint=hint)
    shared = _shared(shared_state(2, 1, processes=1), 0)
    assert [_rank(shared, hint), _rank(shared)] == [1, 0]


def test_a_full_hinted_rank_loses_the_request_to_a_rank_with_a_free_slot() -> None:
    admission = Admission(data_parallel_size=2, capacity=8, max_num_seqs=2)
    hint = _hint([0, 13_952])
    assert [_rank(admission, hint) for _ in range(3)] == [1, 1, 0]
