"""Simulated replicas behind vLLM Router (PyPI `vllm-router`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.routers import scenarios
from tests.routers.fleet import REPLICA_ARGS, Router, router_binary, vllm_router
from tests.server import LiveServer

pytestmark = [pytest.mark.routers, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[LiveServer, LiveServer]]:
    """Two healthy replicas shared by the tests that do not break them."""
    router_binary("vllm-router", "vllm-router")  # skip before starting anything
    with LiveServer(*REPLICA_ARGS) as a, LiveServer(*REPLICA_ARGS) as b:
        yield a, b


@pytest.fixture()
def make_router(tmp_path: Path) -> Iterator[scenarios.MakeRouter]:
    routers: list[Router] = []

    def make(replicas: list[LiveServer], policy: str) -> Router:
        router = vllm_router([r.base_url for r in replicas], policy, tmp_path / "router.log")
        routers.append(router)
        router.wait_healthy({r.base_url for r in replicas})
        return router

    yield make
    for router in routers:
        router.stop()


def test_burst_is_spread_over_both_replicas(
    pair: tuple[LiveServer, LiveServer], make_router: scenarios.MakeRouter
) -> None:
    scenarios.burst_is_spread(make_router(list(pair), "round_robin"), pair)


def test_power_of_two_prefers_the_less_loaded_replica(
    pair: tuple[LiveServer, LiveServer], make_router: scenarios.MakeRouter
) -> None:
    busy, idle = pair
    router = make_router([busy, idle], "power_of_two")
    scenarios.power_of_two_prefers_the_idle_replica(
        router, busy, idle, lambda: scenarios.router_load_of(router, busy) >= 6
    )


def test_replica_with_a_killed_rank_is_taken_out(make_router: scenarios.MakeRouter) -> None:
    router_binary("vllm-router", "vllm-router")
    with LiveServer(*REPLICA_ARGS) as broken, LiveServer(*REPLICA_ARGS) as healthy:
        router = make_router([broken, healthy], "round_robin")
        scenarios.killed_rank_is_taken_out(router, broken, healthy)


def test_sigterm_drains_without_a_failed_request(make_router: scenarios.MakeRouter) -> None:
    router_binary("vllm-router", "vllm-router")
    with (
        LiveServer(*REPLICA_ARGS, "--shutdown-timeout", "30") as draining,
        LiveServer(*REPLICA_ARGS) as other,
    ):
        router = make_router([draining, other], "round_robin")
        scenarios.sigterm_drains_without_a_failed_request(router, draining, other)
