"""Two or more simulated replicas behind vLLM Router (PyPI `vllm-router`)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.routers.fleet import (
    REPLICA_ARGS,
    Router,
    chat,
    get_json,
    health_status,
    metric_sum,
    router_binary,
    stream_chat,
    successes,
    vllm_router,
    wait_for,
)
from tests.server import LiveServer

pytestmark = [pytest.mark.routers, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[LiveServer, LiveServer]]:
    """Two healthy replicas shared by the tests that do not break them."""
    router_binary("vllm-router", "vllm-router")  # skip before starting anything
    with LiveServer(*REPLICA_ARGS) as a, LiveServer(*REPLICA_ARGS) as b:
        yield a, b


@pytest.fixture()
def make_router(tmp_path: Path) -> Iterator[object]:
    routers: list[Router] = []

    def make(replicas: list[LiveServer], policy: str) -> Router:
        router = vllm_router([r.base_url for r in replicas], policy, tmp_path / "router.log")
        routers.append(router)
        router.wait_healthy({r.base_url for r in replicas})
        return router

    yield make
    for router in routers:
        router.stop()


def test_burst_is_spread_over_both_replicas(pair, make_router) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    router = make_router([a, b], "round_robin")
    before = {s.base_url: successes(s.base_url) for s in pair}
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: chat(router.url, f"request {i}"), range(24)))
    assert len(results) == 24
    served = {s.base_url: successes(s.base_url) - before[s.base_url] for s in pair}
    assert sum(served.values()) == 24, served
    assert all(count > 0 for count in served.values()), served


def test_power_of_two_prefers_the_less_loaded_replica(pair, make_router) -> None:  # type: ignore[no-untyped-def]
    busy, idle = pair
    router = make_router([busy, idle], "power_of_two")
    stop = threading.Event()
    long_requests = 6

    def hold_a_stream() -> None:
        body = {
            "model": "deepseek-flash",
            "messages": [{"role": "user", "content": "long"}],
            "max_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
            "thinking": {"type": "disabled"},
        }
        with httpx.stream(
            "POST", f"{busy.base_url}/v1/chat/completions", json=body, timeout=60
        ) as response:
            for _ in response.iter_lines():
                if stop.is_set():
                    return  # closing the stream cancels the request

    threads = [threading.Thread(target=hold_a_stream) for _ in range(long_requests)]
    for thread in threads:
        thread.start()
    try:
        wait_for(
            lambda: metric_sum(busy.base_url, "deepinfer:num_requests_running") >= long_requests,
            "the busy replica runs the long requests",
            20,
        )

        def router_sees_load() -> bool:
            loads = get_json(f"{router.url}/get_loads") or {"workers": []}
            by_url = {w["worker"]: w["load"] for w in loads["workers"]}
            return by_url.get(busy.base_url, -1) >= long_requests

        wait_for(
            router_sees_load,
            "vLLM Router reads the busy replica's load from GET /get_load ({'load': N}); "
            f"router /get_loads: {get_json(f'{router.url}/get_loads')}",
            10,
        )
        # Its load monitor polls every worker about once a second: two more polls of the busy
        # replica after the load was visible mean the policy's cached load includes it.
        polls = sum("GET /get_load" in line for line in busy.lines)
        wait_for(
            lambda: sum("GET /get_load" in line for line in busy.lines) >= polls + 2,
            "the router polls /get_load again",
            10,
        )
        before = {s.base_url: successes(s.base_url) for s in pair}
        for i in range(20):
            chat(router.url, f"short {i}")
        served = {s.base_url: successes(s.base_url) - before[s.base_url] for s in pair}
        assert sum(served.values()) == 20, served
        assert served[idle.base_url] >= 18, served
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)


def test_replica_with_a_killed_rank_is_taken_out(make_router) -> None:  # type: ignore[no-untyped-def]
    router_binary("vllm-router", "vllm-router")
    with LiveServer(*REPLICA_ARGS) as broken, LiveServer(*REPLICA_ARGS) as healthy:
        router = make_router([broken, healthy], "round_robin")
        (rank,) = broken.rank_processes()
        rank.send_signal(signal.SIGKILL)
        wait_for(lambda: health_status(broken.base_url) == 503, "killed rank -> /health 503", 30)
        router.wait_healthy({healthy.base_url}, timeout=15)
        before = successes(healthy.base_url)
        for i in range(10):
            chat(router.url, f"after the kill {i}")
        assert successes(healthy.base_url) - before == 10


def test_sigterm_drains_without_a_failed_request(make_router) -> None:  # type: ignore[no-untyped-def]
    router_binary("vllm-router", "vllm-router")
    with (
        LiveServer(*REPLICA_ARGS, "--shutdown-timeout", "30") as draining,
        LiveServer(*REPLICA_ARGS) as other,
    ):
        router = make_router([draining, other], "round_robin")
        with ThreadPoolExecutor(4) as pool:
            # Round-robin puts two of these ~2 s streams on the draining replica.
            streams = [pool.submit(stream_chat, router.url, 400) for _ in range(4)]
            wait_for(
                lambda: metric_sum(draining.base_url, "deepinfer:num_requests_running") >= 1,
                "requests in flight on the replica about to be stopped",
                20,
            )
            draining.process.send_signal(signal.SIGTERM)
            sent = 0
            # New requests during the drain and after the exit: the router must not fail any.
            while draining.process.poll() is None or draining.base_url in router.healthy_urls():
                chat(router.url, f"during the drain {sent}")
                sent += 1
                assert sent < 2000, "the replica never finished draining"
            for _ in range(5):
                chat(router.url, "after the drain")
            assert [s.result() for s in streams] == ["length"] * 4
        assert draining.process.wait(30) == 0
        assert sent > 0
