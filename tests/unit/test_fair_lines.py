"""FairLines: one line per key, the next entry from the key whose turn came longest ago."""

from __future__ import annotations

from deepinfer_server.fair_lines import FairLines


def drain(lines: FairLines[str]) -> list[str]:
    order = []
    while (taken := lines.pop()) is not None:
        order.append(taken[1])
    return order


def test_keys_take_turns_whatever_their_backlog() -> None:
    lines: FairLines[str] = FairLines()
    for index in range(4):
        lines.push("a", f"a{index}")
    lines.push("b", "b0")
    lines.push("c", "c0")
    lines.push("c", "c1")
    assert len(lines) == 7
    assert drain(lines) == ["a0", "b0", "c0", "a1", "c1", "a2", "a3"]
    assert len(lines) == 0 and lines.pop() is None


def test_a_key_new_to_the_lines_goes_before_keys_that_had_turns() -> None:
    lines: FairLines[str] = FairLines()
    for index in range(3):
        lines.push("a", f"a{index}")
    assert lines.pop() == ("a", "a0")
    lines.push("b", "b0")  # arrives while a's backlog waits
    assert drain(lines) == ["b0", "a1", "a2"]


def test_a_key_that_held_nothing_comes_back_as_new() -> None:
    lines: FairLines[str] = FairLines()
    lines.push("a", "a0")
    lines.push("b", "b0")
    assert drain(lines) == ["a0", "b0"]
    lines.forget("b")  # b's preparation ended; a's still runs
    lines.push("a", "a1")
    lines.push("b", "b1")
    assert drain(lines) == ["b1", "a1"]


def test_forget_keeps_the_turn_of_a_key_still_waiting() -> None:
    lines: FairLines[str] = FairLines()
    lines.push("a", "a0")
    lines.push("a", "a1")
    assert lines.pop() == ("a", "a0")
    lines.forget("a")  # a1 still waits: its turn is kept
    lines.push("b", "b0")
    assert drain(lines) == ["b0", "a1"]


def test_an_entry_removed_before_its_turn_is_never_served() -> None:
    lines: FairLines[str] = FairLines()
    lines.push("a", "a0")
    lines.push("a", "a1")
    lines.push("b", "b0")
    assert lines.remove("a", "a0")
    assert not lines.remove("a", "a0")
    assert lines.remove("b", "b0")
    assert not lines.remove("c", "c0")
    assert drain(lines) == ["a1"]


def test_only_eligible_keys_are_served_when_asked() -> None:
    lines: FairLines[str] = FairLines()
    lines.push("a", "a0")
    lines.push("b", "b0")
    assert lines.pop(lambda key: key != "a") == ("b", "b0")
    assert lines.pop(lambda key: key != "a") is None
    assert lines.pop() == ("a", "a0")
