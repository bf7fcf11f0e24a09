"""scripts/smoke.py passes against a live server and fails against a dead one."""

from __future__ import annotations

import subprocess
import sys

from tests.paths import REPO
from tests.server import LiveServer, refusing_port

SMOKE = REPO / "scripts" / "smoke.py"


def test_smoke_passes_against_the_live_server(shared_server: LiveServer) -> None:
    result = subprocess.run(
        [sys.executable, str(SMOKE), "--base-url", shared_server.base_url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("PASS") == 4
    assert "FAIL" not in result.stdout


def test_smoke_fails_without_a_server() -> None:
    with refusing_port() as port:
        result = subprocess.run(
            [sys.executable, str(SMOKE), "--base-url", f"http://127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 1
    assert "FAIL GET /health" in result.stdout
