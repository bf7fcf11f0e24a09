"""The KV-cache gauge end to end: rank step reports -> coordinator -> /metrics and /get_load."""

from __future__ import annotations

import httpx

from tests.metrics_scrape import scrape, value
from tests.server import LiveServer, wait_until

GAUGE = "deepinfer:kv_cache_usage_perc"


def test_kv_usage_rises_while_a_request_runs_and_falls_when_it_ends() -> None:
    # 11 blocks (10 allocatable): a short prompt holds one, 10% of the pool.
    with LiveServer("--sim-kv-blocks", "11", "--sim-itl-ms", "5", "--dp", "2") as server:
        usage = {
            rank: lambda r=rank: value(scrape(server.base_url), GAUGE, dp_rank=r)
            for rank in ("0", "1")
        }
        assert usage["0"]() == usage["1"]() == 0.0
        body = {
            "model": "deepseek-flash",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2000,
            "ignore_eos": True,
            "stream": True,
            "thinking": {"type": "disabled"},
        }
        url = f"{server.base_url}/v1/chat/completions"
        with httpx.stream("POST", url, json=body, timeout=30) as response:
            lines = response.iter_lines()
            next(lines)
            wait_until(
                lambda: max(usage["0"](), usage["1"]()) > 0, 20, "KV usage reported while running"
            )
            assert sorted([usage["0"](), usage["1"]()]) in ([0.0, 0.1], [0.0, 0.2])
            assert httpx.get(f"{server.base_url}/get_load", timeout=30).json() == {"load": 1}
        # Closing the stream aborts the request: its blocks are freed and reported.
        wait_until(
            lambda: usage["0"]() == usage["1"]() == 0.0, 20, "KV usage back to 0 after the abort"
        )
        assert httpx.get(f"{server.base_url}/get_load", timeout=30).json() == {"load": 0}
