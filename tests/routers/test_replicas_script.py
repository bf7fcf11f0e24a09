"""scripts/replicas.py: the one-command local fleet (replicas behind vLLM Router)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.routers.fleet import REPLICA_ARGS, chat, router_binary, successes, wait_for

pytestmark = [pytest.mark.routers, pytest.mark.timeout(120)]

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "replicas.py"


def test_replicas_script_serves_through_the_router_and_stops_everything(tmp_path: Path) -> None:
    router_binary("vllm-router", "vllm-router")
    log = (tmp_path / "replicas.log").open("w+")
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--replicas", "2", "--", *REPLICA_ARGS],
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:

        def printed() -> str:
            log.seek(0)
            return log.read()

        found = wait_for(
            lambda: re.search(r"^router \(vllm, round_robin\): (\S+)$", printed(), re.M),
            "the script prints the router URL",
            90,
        )
        replicas = re.search(r"^replicas: (.+)$", printed(), re.M)
        assert replicas is not None
        urls = replicas.group(1).split()
        assert len(urls) == 2
        descendants = psutil.Process(process.pid).children(recursive=True)
        for i in range(6):
            chat(found.group(1), f"hello {i}")
        assert all(successes(url) > 0 for url in urls)
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0, printed()
        # Router, replicas and their rank processes are all gone.
        wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                                 for p in descendants), "every process stopped", 10)  # fmt: skip
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()
