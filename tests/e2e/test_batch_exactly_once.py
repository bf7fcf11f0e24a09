"""Exactly-once batch lines with real processes: a Responses batch whose lines append to one
conversation, its server killed (kill -9) twice, each kill aimed at a line whose turn is
appended and whose result is not recorded yet, and restarted on the same store: every
custom_id is in the output once and every line's turn is in the conversation once."""

from __future__ import annotations

from pathlib import Path

from tests.batch_kills import run_killed_batch

LINES = 40


def test_a_batch_killed_twice_appends_every_line_once_and_outputs_it_once(
    tmp_path: Path,
) -> None:
    outcome = run_killed_batch(tmp_path, LINES, kills=2)
    expected = {f"line-{n}": 1 for n in range(LINES)}
    assert dict(outcome.output_ids) == expected, outcome.report()
    assert outcome.succeeded == LINES, outcome.report()
    assert dict(outcome.turns) == {n: 1 for n in range(LINES)}, outcome.report()
    assert outcome.duplicated == 0
    assert outcome.marked == LINES  # every line's writes went through the mark
