"""Router behaviours checked against both routers: load-aware picks, fail-over, drain.

Each scenario takes a running router and the replicas behind it; the test files choose the
router (vLLM Router or the SGLang gateway) and start the replicas.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.routers.fleet import (
    MODEL,
    Router,
    chat,
    get_json,
    health_status,
    metric_sum,
    stream_chat,
    successes,
    wait_for,
)
from tests.server import LiveServer

#: Makes a router in front of these replicas with this policy, and waits until it lists them.
MakeRouter = Callable[[list[LiveServer], str], Router]


def burst_is_spread(router: Router, replicas: tuple[LiveServer, ...], count: int = 24) -> None:
    """Every request of a concurrent burst succeeds and every replica serves some."""
    before = {s.base_url: successes(s.base_url) for s in replicas}
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: chat(router.url, f"request {i}"), range(count)))
    assert len(results) == count
    served = {s.base_url: successes(s.base_url) - before[s.base_url] for s in replicas}
    assert sum(served.values()) == count, served
    assert all(n > 0 for n in served.values()), served


def power_of_two_prefers_the_idle_replica(
    router: Router, busy: LiveServer, idle: LiveServer, busy_load: Callable[[], bool]
) -> None:
    """With long requests held on `busy`, short requests through the router go to `idle`.

    `busy_load` says whether the router's own /get_loads shows the busy replica as loaded.
    """
    stop = threading.Event()
    long_requests = 6

    def hold_a_stream() -> None:
        body = {
            "model": MODEL,
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
        assert metric_sum(busy.base_url, "deepinfer:kv_cache_usage_perc") > 0
        assert metric_sum(idle.base_url, "deepinfer:kv_cache_usage_perc") == 0
        wait_for(
            busy_load,
            "the router reads the busy replica's load from its GET /get_load",
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
        before = {s.base_url: successes(s.base_url) for s in (busy, idle)}
        for i in range(20):
            chat(router.url, f"short {i}")
        served = {s.base_url: successes(s.base_url) - before[s.base_url] for s in (busy, idle)}
        assert sum(served.values()) == 20, served
        assert served[idle.base_url] >= 18, served
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)


def router_load_of(router: Router, replica: LiveServer) -> int:
    """The load the router last read for `replica` (-1 when it has none)."""
    loads = get_json(f"{router.url}/get_loads") or {"workers": []}
    return int({w["worker"]: w["load"] for w in loads["workers"]}.get(replica.base_url, -1))


def killed_rank_is_taken_out(router: Router, broken: LiveServer, healthy: LiveServer) -> None:
    """After a replica's rank dies, every new request succeeds on the other replica."""
    (rank,) = broken.rank_processes()
    rank.send_signal(signal.SIGKILL)
    wait_for(lambda: health_status(broken.base_url) == 503, "killed rank -> /health 503", 30)
    router.wait_healthy({healthy.base_url}, timeout=15)
    before = successes(healthy.base_url)
    for i in range(10):
        chat(router.url, f"after the kill {i}")
    assert successes(healthy.base_url) - before == 10


def sigterm_drains_without_a_failed_request(
    router: Router, draining: LiveServer, other: LiveServer
) -> None:
    """A SIGTERM'd replica finishes its streams while the router moves new requests away.

    `draining` must run with a --shutdown-timeout long enough for ~2 s streams.
    """
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
