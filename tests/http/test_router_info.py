"""What routers read from a replica: GET /get_load, the SGLang info endpoints, the KV gauge;
with several API server processes, their merged views."""

from __future__ import annotations

import asyncio
import re

import pytest

from deepinfer_server.disaggregation.layout import KVLayout
from deepinfer_server.metrics import RankLoad, ServerMetrics
from deepinfer_server.metrics.aggregate import Snapshot, take_snapshot
from tests.http.harness import MODEL, Harness, Script, run, serve

CHAT = "/v1/chat/completions"


async def _held_request(h: Harness) -> asyncio.Task[object]:
    """A chat request the fake engine holds (admitted, no token yet)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    task = asyncio.create_task(h.client.post(CHAT, json=body))
    async with asyncio.timeout(10):  # a request that is never admitted fails here, not at 30 s
        await h.coordinator.wait_admitted()
    return task


def test_get_load_counts_admitted_requests_in_vllm_routers_shape() -> None:
    async def body() -> None:
        async with serve(script=Script(hold=True)) as h:
            assert (await h.client.get("/get_load")).json() == {"load": 0}
            task = await _held_request(h)
            response = await h.client.get("/get_load")
            assert response.status_code == 200
            assert response.json() == {"load": 1}
            task.cancel()

    run(body)


def test_get_load_in_the_sglang_gateways_shape() -> None:
    async def body() -> None:
        for args, query in ((("--get-load-format", "sglang"), ""), ((), "?format=sglang")):
            async with serve(*args, script=Script(hold=True)) as h:
                task = await _held_request(h)
                (entry,) = (await h.client.get("/get_load" + query)).json()
                prompt_tokens = len(h.coordinator.submitted[0][1])
                assert entry == {
                    "dp_rank": 0,
                    "num_reqs": 1,
                    "num_waiting_reqs": 1,
                    "num_tokens": prompt_tokens,
                }
                task.cancel()

    run(body)


def test_an_unknown_load_format_is_a_400_naming_the_param() -> None:
    async def body() -> None:
        async with serve() as h:
            response = await h.client.get("/get_load?format=xml")
            assert response.status_code == 400
            error = response.json()["error"]
            assert error["param"] == "format"
            assert error["type"] == "invalid_request_error"

    run(body)


#: A prefill rank's KV layout as it reports it with its readiness (its transport stamped on).
RANK_LAYOUT = KVLayout(
    engine="simulated",
    block_size=128,
    block_bytes=1024,
    state_bytes=64,
    dtype="int32",
    transport="nvlink",
    node="0123456789abcdef",
)


@pytest.mark.parametrize("path", ["/server_info", "/get_server_info"])
def test_server_info_describes_the_replica(path: str) -> None:
    async def body() -> None:
        async with serve("--max-num-seqs", "3") as h:
            info = (await h.client.get(path)).json()
            assert info["served_model_name"] == MODEL
            assert info["dp_size"] == 1
            assert info["max_model_len"] == info["context_length"] == 4096
            assert info["max_running_requests"] == 3
            assert info["engine"] == "simulated"
            assert info["model_path"]
            assert info["disaggregation_mode"] == "null"
            assert info["disaggregation_bootstrap_port"] is None
            assert info["disaggregation_bootstrap_ports"] == []
            assert info["disaggregation_transport"] is None
            h.coordinator.bootstrap_ports = {1: 41001, 0: 41000}  # as two prefill ranks report
            h.coordinator.readiness.layout = RANK_LAYOUT  # as they report it ready
            info = (await h.client.get(path)).json()
            assert info["disaggregation_bootstrap_port"] == 41000
            assert info["disaggregation_bootstrap_ports"] == [41000, 41001]
            assert info["disaggregation_transport"] == "nvlink"

    run(body)


@pytest.mark.parametrize("path", ["/model_info", "/get_model_info"])
def test_model_info_is_a_generative_model(path: str) -> None:
    async def body() -> None:
        async with serve() as h:
            info = (await h.client.get(path)).json()
            assert info["is_generation"] is True
            assert info["served_model_name"] == MODEL
            assert info["max_model_len"] == 4096

    run(body)


def test_kv_cache_usage_gauge_per_rank() -> None:
    async def body() -> None:
        async with serve() as h:
            h.coordinator.kv_cache_usage = 0.25
            text = (await h.client.get("/metrics")).text
            found = re.search(
                r'^deepinfer:kv_cache_usage_perc\{dp_rank="0",model_name="deepseek-flash"\} '
                r"(\S+)$",
                text,
                re.MULTILINE,
            )
            assert found is not None, text
            assert float(found.group(1)) == 0.25

    run(body)


def test_router_probes_stay_open_when_api_keys_are_set() -> None:
    async def body() -> None:
        async with serve("--api-key", "secret") as h:
            for path in ("/get_load", "/server_info", "/get_model_info"):
                assert (await h.client.get(path)).status_code == 200, path
            assert (await h.client.get("/v1/models")).status_code == 401

    run(body)


class _OtherProcess:
    """`Peers` of API server process 1, whose one peer holds two requests on rank 0."""

    index = 1
    all_serving = True
    all_warm = True

    def __init__(self) -> None:
        self.loads = [RankLoad(0, 1, 1, 50, 0.5)]
        self.metrics = ServerMetrics(MODEL)
        self.metrics.watch_ranks(lambda: self.loads, lambda: True)

    async def snapshots(self, metrics: bool = True) -> list[Snapshot]:
        if not metrics:
            return [Snapshot(rank_loads=self.loads)]
        return [take_snapshot(self.metrics, self.loads)]


def test_with_several_api_server_processes_the_views_are_merged() -> None:
    async def body() -> None:
        async with serve(script=Script(hold=True)) as h:
            other = _OtherProcess()
            other.metrics.observe_failure(429)
            h.state.peers = other
            task = await _held_request(h)
            assert (await h.client.get("/get_load")).json() == {"load": 3}
            text = (await h.client.get("/metrics")).text
            assert (
                'deepinfer:request_failure_total{model_name="' + MODEL + '",status="429"} 1.0'
                in text
            )
            assert re.search(r'num_requests_running\{dp_rank="0",model_name="[^"]+"\} 1\.0', text)
            assert re.search(r'num_requests_waiting\{dp_rank="0",model_name="[^"]+"\} 2\.0', text)
            # Engine request IDs name the process: unique even for a reused X-Request-Id.
            (engine_request_id,) = h.coordinator.handles
            assert re.fullmatch(r"chatcmpl-[0-9a-f]+-1\.1", engine_request_id)
            task.cancel()

    run(body)


def test_health_says_starting_until_every_api_server_process_is_warm() -> None:
    async def body() -> None:
        async with serve() as h:
            other = _OtherProcess()
            other.all_warm = False  # another process's compile workers are still starting
            h.state.peers = other
            starting = await h.client.get("/health")
            assert starting.status_code == 503
            assert starting.json()["status"] == "starting"
            assert "another API server process" in starting.json()["reason"]
            other.all_warm = True  # the supervisor's AllWarm
            assert (await h.client.get("/health")).json() == {"status": "ok"}

    run(body)
