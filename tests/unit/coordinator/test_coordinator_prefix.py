"""The coordinator with --enable-prefix-caching and DP 2: a conversation's next turn goes to
the rank that holds its prefix, a new one to the least-loaded rank; a rank's first delta gives
the handle its cached tokens; the ranks' counters become the prefix-cache metrics.

A real Coordinator over real RankChannels whose ranks have not connected (every message waits
in memory); the ranks' step reports are handed to it as its reader task would.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from deepinfer_server.coordinator.coordinator import Coordinator
from deepinfer_server.ipc.messages import (
    AbortReason,
    GeneratedTokens,
    PrefixCacheStats,
    RequestDelta,
    SamplingOptions,
    StepOutputs,
)
from tests.metrics_scrape import parse_metrics, value
from tests.unit.coordinator.unconnected import unconnected_coordinator


def _prompt(length: int, seed: int) -> list[int]:
    generator = random.Random(seed)
    return [generator.randrange(129_280) for _ in range(length)]


def _report(
    coordinator: Coordinator, rank: int, stats: PrefixCacheStats | None, *deltas: RequestDelta
) -> None:
    coordinator._on_messages([StepOutputs(rank, list(deltas), 0.01, 0.1, stats)])


def test_a_next_turn_goes_to_the_rank_holding_its_prefix(tmp_path: Path) -> None:
    async def body() -> None:
        async with unconnected_coordinator(tmp_path, "--enable-prefix-caching") as coordinator:
            for rank in (0, 1):
                _report(coordinator, rank, PrefixCacheStats(0, 0, 0))
            busy = coordinator.submit("busy", [1, 2, 3], SamplingOptions(8), None)
            assert busy.rank == 0
            turn_1 = _prompt(2000, seed=1)
            first = coordinator.submit("turn-1", turn_1, SamplingOptions(8), None)
            assert first.rank == 1  # the least-loaded rank
            first.close(AbortReason.STOP)
            turn_2 = [*turn_1, *_prompt(300, seed=2)]
            others = [
                coordinator.submit(f"o{n}", _prompt(2000, seed=10 + n), SamplingOptions(8), None)
                for n in range(3)
            ]
            # New conversations: the least-loaded rank each time.
            assert [handle.rank for handle in others] == [1, 0, 1]
            busy.close(AbortReason.STOP)  # now rank 0 runs 1 request, rank 1 runs 2
            second = coordinator.submit("turn-2", turn_2, SamplingOptions(8), None)
            assert second.rank == 1  # it holds turn 1's prompt
            for handle in (*others, second):
                handle.close(AbortReason.STOP)

    asyncio.run(body())


def test_a_next_turn_under_another_cache_salt_goes_by_load(tmp_path: Path) -> None:
    # Prefix-aware routing respects the cache's partition: what tenant A's turn left on a
    # rank draws only tenant A's next turn there.
    async def body() -> None:
        async with unconnected_coordinator(tmp_path, "--enable-prefix-caching") as coordinator:
            for rank in (0, 1):
                _report(coordinator, rank, PrefixCacheStats(0, 0, 0))
            busy = coordinator.submit("busy", [1, 2, 3], SamplingOptions(8), None)
            turn_1 = _prompt(2000, seed=1)
            first = coordinator.submit("a-1", turn_1, SamplingOptions(8), None, cache_salt=b"a")
            assert (busy.rank, first.rank) == (0, 1)
            first.close(AbortReason.STOP)
            turn_2 = [*turn_1, *_prompt(300, seed=2)]
            filler = coordinator.submit("filler", _prompt(2000, seed=3), SamplingOptions(8), None)
            assert filler.rank == 1  # now both ranks run one request
            other = coordinator.submit("b-2", turn_2, SamplingOptions(8), None, cache_salt=b"b")
            assert other.rank == 0  # a tie, to the lowest rank: B holds nothing on rank 1
            filler_2 = coordinator.submit("f2", _prompt(2000, seed=4), SamplingOptions(8), None)
            assert filler_2.rank == 1  # two each
            same = coordinator.submit("a-2", turn_2, SamplingOptions(8), None, cache_salt=b"a")
            assert same.rank == 1  # A's prefix is there
            same.close(AbortReason.STOP)  # two each again
            unsalted = coordinator.submit("none-2", turn_2, SamplingOptions(8), None)
            assert unsalted.rank == 0  # no salt is a partition of its own
            for handle in (busy, filler, other, filler_2, unsalted):
                handle.close(AbortReason.STOP)

    asyncio.run(body())


def test_without_prefix_caching_every_request_goes_to_the_least_loaded_rank(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        async with unconnected_coordinator(tmp_path, "--no-enable-prefix-caching") as coordinator:
            turn_1 = _prompt(2000, seed=1)
            first = coordinator.submit("turn-1", turn_1, SamplingOptions(8), None)
            second = coordinator.submit("turn-2", [*turn_1, 7], SamplingOptions(8), None)
            assert (first.rank, second.rank) == (0, 1)
            first.close(AbortReason.STOP)
            second.close(AbortReason.STOP)

    asyncio.run(body())


def test_the_first_delta_gives_the_handle_its_cached_tokens_and_counters_become_metrics(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        async with unconnected_coordinator(tmp_path, "--enable-prefix-caching") as coordinator:
            handle = coordinator.submit("r", _prompt(1000, seed=4), SamplingOptions(8), None)
            assert handle.cached_tokens is None
            stats = PrefixCacheStats(queries=3000, hits=2560, sequences=2)
            _report(
                coordinator, handle.rank, stats, RequestDelta("r", GeneratedTokens(), None, 896)
            )
            assert handle.cached_tokens == 896
            _report(coordinator, 1 - handle.rank, PrefixCacheStats(1000, 0, 1))
            handle.close(AbortReason.STOP)
            samples = parse_metrics(coordinator._metrics.exposition().decode())
            assert value(samples, "deepinfer:prefix_cache_queries_total", model_name="m") == 4000
            assert value(samples, "deepinfer:prefix_cache_hits_total", model_name="m") == 2560
            for rank, sequences in ((handle.rank, 2), (1 - handle.rank, 1)):
                gauge = value(
                    samples, "deepinfer:prefix_cache_sequences", model_name="m", dp_rank=str(rank)
                )
                assert gauge == sequences

    asyncio.run(body())
