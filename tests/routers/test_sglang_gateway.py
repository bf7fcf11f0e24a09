"""The same smoke through the SGLang Model Gateway (PyPI `sglang-router`, command `smg`).

smg 0.3.2 re-serialises chat requests into its own schema and drops fields it does not know,
`thinking` among them: requests through it run with the server's default thinking mode.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.routers.fleet import REPLICA_ARGS, Router, chat, router_binary, successes
from tests.server import LiveServer

pytestmark = [pytest.mark.routers, pytest.mark.timeout(120)]


def test_burst_through_the_sglang_gateway(tmp_path: Path) -> None:
    binary = router_binary("smg", "sglang-router")
    with LiveServer(*REPLICA_ARGS) as a, LiveServer(*REPLICA_ARGS) as b:
        router = Router(
            [
                binary, "launch", "--worker-urls", a.base_url, b.base_url,
                "--policy", "round_robin", "--health-check-interval-secs", "1",
                "--worker-startup-check-interval", "1", "--log-level", "warn",
            ],
            tmp_path / "smg.log",
        )  # fmt: skip
        try:
            # smg registers workers in the background after it starts listening.
            router.wait_healthy({a.base_url, b.base_url})
            before = {s.base_url: successes(s.base_url) for s in (a, b)}
            with ThreadPoolExecutor(4) as pool:
                results = list(pool.map(lambda i: chat(router.url, f"r{i}", 16), range(12)))
            assert len(results) == 12
            served = {s.base_url: successes(s.base_url) - before[s.base_url] for s in (a, b)}
            assert sum(served.values()) == 12, served
            assert all(count > 0 for count in served.values()), served
        finally:
            router.stop()
