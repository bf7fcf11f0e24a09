"""The running slots a batch line may take: its engine requests (prompts times `n`) against
the slots idle now, its process's lines not yet admitted counted once."""

from __future__ import annotations

from typing import Any

import pytest

from deepinfer_server.services.batch_slots import IdleSlots, engine_requests


@pytest.mark.parametrize(
    ("body", "count"),
    [
        ({"messages": []}, 1),
        ({"messages": [], "n": 66}, 66),
        ({"prompt": "one", "n": 3}, 3),
        ({"prompt": ["one", "two", "three"], "n": 2}, 6),
        ({"prompt": [[1, 2], [3]], "n": 4}, 8),
        ({"prompt": [1, 2, 3], "n": 2}, 2),  # one prompt of token IDs
        ({"prompt": ["one", 2]}, 1),  # malformed: the endpoint refuses it
        ({"n": True}, 1),
        ({"n": "3"}, 1),
        ({"n": 0}, 1),
    ],
)
def test_a_line_makes_one_engine_request_per_prompt_and_choice(
    body: dict[str, Any], count: int
) -> None:
    assert engine_requests(body) == count


def _slots(idle: int, admitted: int, most: int = 15) -> IdleSlots:
    return IdleSlots(most, lambda: idle, lambda: admitted)


def test_lines_not_yet_admitted_are_counted_once() -> None:
    # Lines making 8 engine requests, 5 admitted: 3 more will take slots that look idle.
    assert _slots(idle=7, admitted=5).budget(8) == 4
    assert _slots(idle=4, admitted=8).budget(8) == 4  # every one admitted: nothing to add
    # More lowest-priority requests than its lines make (background responses): no credit.
    assert _slots(idle=4, admitted=20).budget(8) == 4


def test_a_line_fits_within_the_budget_or_alone_on_an_idle_server() -> None:
    assert _slots(idle=10, admitted=0).fits(10, 0)
    assert not _slots(idle=10, admitted=0).fits(11, 0)
    assert not _slots(idle=-2, admitted=0).fits(1, 0)  # requests wait in the queue
    assert _slots(idle=15, admitted=0).fits(66, 0)  # wider than any budget, server idle
    assert not _slots(idle=14, admitted=0).fits(66, 0)  # something else runs
    assert not _slots(idle=15, admitted=0).fits(66, 1)  # a line of its own runs
    assert not _slots(idle=15, admitted=0).fits(12, 4)
