"""The coordinator with DP 2 and requests that name their session: a session's turns go to
the rank of its last one, even with prompts that share no prefix; another API key's session of
the same name is another session; a session whose rank is much more loaded goes by load and
moves there; a stored response is continued on its rank; each placement is counted by why.

A real Coordinator over real RankChannels whose ranks have not connected (every message waits
in memory), as in `test_coordinator_prefix.py`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from deepinfer_server.coordinator.coordinator import Coordinator
from deepinfer_server.coordinator.handle import RequestHandle
from deepinfer_server.coordinator.session_routing import SessionNames
from deepinfer_server.ipc.messages import AbortReason, SamplingOptions
from tests.metrics_scrape import parse_metrics, value
from tests.unit.coordinator.unconnected import unconnected_coordinator

#: Two API keys, whose sessions of one name are two sessions.
KEYS = ("--api-key", "k1", "--api-key", "k2")


def _session(name: str) -> SessionNames:
    return SessionNames(name, (name,))


def _submit(
    coordinator: Coordinator, request_id: str, session: SessionNames | None, tenant: int = 0
) -> RequestHandle:
    # A short prompt of its own: no prefix to route by, only the session.
    prompt = [hash(request_id) % 1000, 1, 2]
    return coordinator.submit(
        request_id, prompt, SamplingOptions(8), None, tenant=tenant, session=session
    )


def _routed(coordinator: Coordinator, reason: str, rank: int) -> float:
    samples = parse_metrics(coordinator._metrics.exposition().decode())
    return value(
        samples, "deepinfer:dp_routing_total", model_name="m", reason=reason, dp_rank=str(rank)
    )


def test_a_sessions_turns_follow_its_rank_and_other_keys_sessions_do_not(tmp_path: Path) -> None:
    async def body() -> None:
        async with unconnected_coordinator(tmp_path, *KEYS) as coordinator:
            first = _submit(coordinator, "s-1", _session("chat"))
            assert first.rank == 0  # new: the least-loaded rank
            busy = _submit(coordinator, "busy", None)
            assert busy.rank == 1
            first.close(AbortReason.STOP)
            filler = _submit(coordinator, "filler", None)
            assert filler.rank == 0  # one request each now
            # The session's next turns go to its rank, though it becomes the busier one.
            second = _submit(coordinator, "s-2", _session("chat"))
            third = _submit(coordinator, "s-3", _session("chat"))
            assert (second.rank, third.rank) == (0, 0)  # rank 0 runs 3, rank 1 one
            # The other API key's "chat" is a session of its own, placed by load.
            other = _submit(coordinator, "k2-1", _session("chat"), tenant=1)
            assert other.rank == 1
            assert _routed(coordinator, "session", 0) == 2
            assert _routed(coordinator, "load", 0) == 2
            assert _routed(coordinator, "load", 1) == 2
            for handle in (busy, filler, second, third, other):
                handle.close(AbortReason.STOP)

    asyncio.run(body())


def test_a_session_whose_rank_is_much_more_loaded_moves(tmp_path: Path) -> None:
    async def body() -> None:
        async with unconnected_coordinator(tmp_path, *KEYS) as coordinator:
            # Concurrent turns of one session (an agent's subagents) pile onto its rank until
            # it runs more than 4 more than the other (the threshold for --max-num-seqs 16).
            piled = [_submit(coordinator, f"s-{n}", _session("agent")) for n in range(5)]
            assert {handle.rank for handle in piled} == {0}
            assert _routed(coordinator, "session", 0) == 4
            moved = _submit(coordinator, "s-5", _session("agent"))
            assert moved.rank == 1  # 5 more and more than 1.5 times as many: by load
            assert _routed(coordinator, "load", 1) == 1
            for handle in piled:
                handle.close(AbortReason.STOP)
            # Rank 0 is idle now, rank 1 runs one: the session lives on rank 1 now.
            again = _submit(coordinator, "s-6", _session("agent"))
            assert again.rank == 1
            assert _routed(coordinator, "session", 1) == 1
            moved.close(AbortReason.STOP)
            again.close(AbortReason.STOP)

    asyncio.run(body())


def test_a_stored_response_is_continued_on_its_rank(tmp_path: Path) -> None:
    async def body() -> None:
        async with unconnected_coordinator(tmp_path, *KEYS) as coordinator:
            busy = _submit(coordinator, "busy", None)
            first = _submit(coordinator, "t-1", SessionNames(None, ("resp_1",)))
            assert (busy.rank, first.rank) == (0, 1)
            busy.close(AbortReason.STOP)
            first.close(AbortReason.STOP)
            filler = _submit(coordinator, "filler", None)
            assert filler.rank == 0
            second = _submit(coordinator, "t-2", SessionNames("resp_1", ("resp_2",)))
            assert second.rank == 1  # a tie would go to rank 0: the response it continues
            filler.close(AbortReason.STOP)
            second.close(AbortReason.STOP)
            third = _submit(coordinator, "t-3", SessionNames("resp_2", ("resp_3",)))
            assert third.rank == 1
            third.close(AbortReason.STOP)

    asyncio.run(body())


def test_without_prefix_caching_sessions_go_by_load(tmp_path: Path) -> None:
    async def body() -> None:
        async with unconnected_coordinator(
            tmp_path, *KEYS, "--no-enable-prefix-caching"
        ) as coordinator:
            first = _submit(coordinator, "s-1", _session("chat"))
            second = _submit(coordinator, "s-2", _session("chat"))
            assert (first.rank, second.rank) == (0, 1)
            assert _routed(coordinator, "load", 1) == 1
            first.close(AbortReason.STOP)
            second.close(AbortReason.STOP)

    asyncio.run(body())
