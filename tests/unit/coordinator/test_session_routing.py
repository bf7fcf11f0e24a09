"""Session-affine rank choice, as pure functions: the bounded session table, the load rule a
session's rank is held to (prefix routing's), the fallback to the prefix hint, why a rank was
chosen, and sessions partitioned by API key and cache partition."""

from __future__ import annotations

from deepinfer_server.coordinator.admission import choose_rank
from deepinfer_server.coordinator.prefix_routing import PrefixHint, PrefixRouting
from deepinfer_server.coordinator.session_routing import (
    RouteHint,
    RoutingReason,
    SessionTable,
    session_id,
)

POLICY = PrefixRouting.for_ranks_of(16)  # much more loaded: > 4 more and > 1.5 times as many


def test_the_table_remembers_where_each_session_was_placed_last() -> None:
    table = SessionTable()
    a, b = session_id(0, None, "a"), session_id(0, None, "b")
    assert table.rank_of(a) is None
    table.place([a], 1)
    table.place([b], 0)
    assert (table.rank_of(a), table.rank_of(b)) == (1, 0)
    table.place([a], 0)  # re-homed
    assert table.rank_of(a) == 0
    assert len(table) == 2


def test_the_table_forgets_the_least_recently_placed_session_beyond_its_bound() -> None:
    table = SessionTable(limit=2)
    a, b, c = (session_id(0, None, name) for name in "abc")
    table.place([a], 0)
    table.place([b], 1)
    table.place([a], 1)  # a is now the most recently placed
    table.place([c], 0)
    assert (table.rank_of(a), table.rank_of(b), table.rank_of(c)) == (1, None, 0)
    assert len(table) == 2


def test_a_session_is_its_api_key_and_cache_partition_as_well_as_its_name() -> None:
    names = {
        session_id(0, None, "s"),
        session_id(1, None, "s"),
        session_id(0, b"salt", "s"),
        session_id(0, None, "t"),
    }
    assert len(names) == 4
    assert session_id(1, b"salt", "s") == session_id(1, b"salt", "s")


def test_a_session_goes_to_its_rank_unless_that_one_is_much_more_loaded() -> None:
    hint = RouteHint(POLICY, session_rank=1)
    assert choose_rank([0, 4], hint) == 1  # 4 more, not past the absolute threshold
    assert choose_rank([2, 6], hint) == 1  # 4 more
    assert choose_rank([2, 7], hint) == 0  # 5 more and 3.5 times as many
    assert choose_rank([10, 15], hint) == 1  # 5 more but only 1.5 times as many
    assert choose_rank([3, 16], hint) == 0  # full while rank 0 has a free slot
    assert hint.reason(1) is RoutingReason.SESSION
    assert hint.reason(0) is RoutingReason.LOAD


def test_an_overloaded_or_unknown_session_falls_back_to_the_prefix_hint() -> None:
    prefix = PrefixHint([0, 0, 13_952], 14_000, POLICY)
    overloaded = RouteHint(POLICY, session_rank=1, prefix=prefix)
    assert choose_rank([0, 9, 1], overloaded) == 2  # by its prefix
    assert overloaded.reason(2) is RoutingReason.PREFIX
    unknown = RouteHint(POLICY, prefix=prefix)
    assert choose_rank([0, 0, 1], unknown) == 2
    assert choose_rank([0, 0, 9], unknown) == 0  # the prefix's rank is much more loaded too
    assert unknown.reason(0) is RoutingReason.LOAD


def test_the_session_wins_over_a_prefix_held_elsewhere() -> None:
    prefix = PrefixHint([13_952, 0], 14_000, POLICY)
    hint = RouteHint(POLICY, session_rank=1, prefix=prefix)
    assert choose_rank([0, 1], hint) == 1
    assert hint.reason(1) is RoutingReason.SESSION


def test_a_prefix_too_short_to_route_by_is_no_reason() -> None:
    prefix = PrefixHint([128, 0], 200, POLICY)  # below 256 tokens
    hint = RouteHint(POLICY, prefix=prefix)
    assert choose_rank([1, 0], hint) == 1
    assert hint.reason(0) is RoutingReason.LOAD
    assert not prefix.holds(0)
