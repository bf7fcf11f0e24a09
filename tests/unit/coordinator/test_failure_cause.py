"""The cause a service fails for when several rank failures arrive together."""

from __future__ import annotations

import asyncio

from deepinfer_server.coordinator.failure_cause import FailureCause


async def _settled(*events: tuple[str, int, str]) -> list[str]:
    causes: list[str] = []
    settled = asyncio.Event()

    def on_cause(reason: str) -> None:
        causes.append(reason)
        settled.set()

    failure = FailureCause(on_cause, grace=0.01)
    for kind, rank, reason in events:
        getattr(failure, kind)(rank, reason)
    await settled.wait()
    failure.report(3, "too late")  # after the cause is settled nothing changes
    await asyncio.sleep(0.02)  # not a wait: past the grace, a second cause would have come
    return causes


def test_a_rank_that_died_silently_outranks_its_peers_reports() -> None:
    causes = asyncio.run(
        _settled(("report", 0, "rank 0: lockstep broken"), ("exit", 1, "rank 1 was killed"))
    )
    assert causes == ["rank 1 was killed"]


def test_a_rank_that_said_why_before_exiting_is_named_by_its_report() -> None:
    causes = asyncio.run(_settled(("exit", 1, "rank 1 exit code 1"), ("report", 1, "rank 1: oom")))
    assert causes == ["rank 1: oom"]


def test_the_first_report_wins_among_reports() -> None:
    causes = asyncio.run(_settled(("report", 1, "first"), ("report", 0, "second")))
    assert causes == ["first"]
