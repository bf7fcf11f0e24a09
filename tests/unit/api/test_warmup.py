"""GrammarWarmup: `/health` says `starting` from the warm-up's start until structured output is
warm (the API process's compile workers and every rank's grammar builder), and never again, or
until its bound passes."""

from __future__ import annotations

import asyncio

import pytest

from deepinfer_server.api import warmup
from deepinfer_server.api.warmup import WARMUP_HEALTH_WAIT, GrammarWarmup


class _Structured:
    """What the warm-up reads of StructuredOutputs."""

    def __init__(self) -> None:
        self.started = False
        self.preparing = True

    def start(self) -> None:
        self.started = True


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def _xgrammar(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(warmup, "xgrammar_installed", lambda: True)


def _warmup(ranks: list[bool], clock: _Clock | None = None) -> tuple[GrammarWarmup, _Structured]:
    structured = _Structured()
    gate = GrammarWarmup(structured, lambda: ranks[0], clock or _Clock())  # type: ignore[arg-type]
    return gate, structured


def test_not_warming_before_the_warmup_starts() -> None:
    gate, structured = _warmup([False])
    assert not gate.warming  # a server run with --no-grammar-warmup, or not listening yet
    gate.start()
    assert structured.started and gate.warming


def test_warming_until_the_workers_and_every_rank_are_warm_then_never_again() -> None:
    ranks = [False]
    gate, structured = _warmup(ranks)
    gate.start()
    structured.preparing = False
    assert gate.warming  # the ranks' grammar builders are still cold
    ranks[0] = True
    assert not gate.warming
    structured.preparing = True  # a compile worker restarted later: no start-up
    ranks[0] = False
    assert not gate.warming


def test_ranks_warm_first_still_waits_for_the_workers() -> None:
    gate, structured = _warmup([True])
    gate.start()
    assert gate.warming
    structured.preparing = False
    assert not gate.warming


def test_the_wait_is_bounded() -> None:
    clock = _Clock()
    gate, _ = _warmup([False], clock)
    gate.start()
    clock.now += WARMUP_HEALTH_WAIT
    assert gate.warming
    clock.now += 1
    assert not gate.warming
    clock.now -= 100  # over for good, whatever the clock says next
    assert not gate.warming


def test_nothing_to_warm_without_xgrammar(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(warmup, "xgrammar_installed", lambda: False)
    gate, structured = _warmup([False])
    gate.start()
    assert structured.started  # it refuses its structured requests with a clear 400
    assert not gate.warming


def test_over_returns_once_the_warmup_is_over_and_not_before() -> None:
    ranks = [False]
    gate, structured = _warmup(ranks)
    gate.start()

    async def watch() -> bool:
        waiting = asyncio.ensure_future(gate.over())
        await asyncio.sleep(0)
        still_warming = not waiting.done()
        structured.preparing = False
        ranks[0] = True
        await asyncio.wait_for(waiting, 5)
        return still_warming

    assert asyncio.run(watch())
