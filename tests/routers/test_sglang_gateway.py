"""Simulated replicas behind the SGLang Model Gateway (PyPI `sglang-router`, command `smg`).

smg 0.3.2 re-serialises chat requests into its own schema and drops fields it does not know,
`thinking` among them: requests through it run with the server's default thinking mode. It
polls the same GET /get_load as vLLM Router but reads SGLang's per-rank list (`num_tokens` is
the load), so the replicas of its power_of_two test run with `--get-load-format sglang`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.routers import scenarios
from tests.routers.fleet import REPLICA_ARGS, Router, router_binary, sglang_gateway
from tests.server import LiveServer

pytestmark = [pytest.mark.routers, pytest.mark.timeout(120)]

SGLANG_LOAD = ("--get-load-format", "sglang")


@pytest.fixture()
def make_router(tmp_path: Path) -> Iterator[scenarios.MakeRouter]:
    router_binary("smg", "sglang-router")  # skip before starting anything
    routers: list[Router] = []

    def make(replicas: list[LiveServer], policy: str) -> Router:
        router = sglang_gateway([r.base_url for r in replicas], policy, tmp_path / "smg.log")
        routers.append(router)
        # smg registers workers in the background after it starts listening.
        router.wait_healthy({r.base_url for r in replicas})
        return router

    yield make
    for router in routers:
        router.stop()


def test_burst_through_the_sglang_gateway(make_router: scenarios.MakeRouter) -> None:
    with LiveServer(*REPLICA_ARGS) as a, LiveServer(*REPLICA_ARGS) as b:
        scenarios.burst_is_spread(make_router([a, b], "round_robin"), (a, b), count=12)


def test_power_of_two_reads_the_sglang_load_shape(make_router: scenarios.MakeRouter) -> None:
    with (
        LiveServer(*REPLICA_ARGS, *SGLANG_LOAD) as busy,
        LiveServer(*REPLICA_ARGS, *SGLANG_LOAD) as idle,
    ):
        router = make_router([busy, idle], "power_of_two")
        # smg's load is the replica's tokens (prompt + generated), so well above 6.
        scenarios.power_of_two_prefers_the_idle_replica(
            router, busy, idle, lambda: scenarios.router_load_of(router, busy) > 100
        )


def test_replica_with_a_killed_rank_is_taken_out(make_router: scenarios.MakeRouter) -> None:
    with LiveServer(*REPLICA_ARGS) as broken, LiveServer(*REPLICA_ARGS) as healthy:
        router = make_router([broken, healthy], "round_robin")
        scenarios.killed_rank_is_taken_out(router, broken, healthy)


def test_sigterm_drains_without_a_failed_request(make_router: scenarios.MakeRouter) -> None:
    with (
        LiveServer(*REPLICA_ARGS, "--shutdown-timeout", "30") as draining,
        LiveServer(*REPLICA_ARGS) as other,
    ):
        router = make_router([draining, other], "round_robin")
        scenarios.sigterm_drains_without_a_failed_request(router, draining, other)
