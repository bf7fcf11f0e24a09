"""LivePrometheus: a real Prometheus (Debian's package) as a subprocess on a free loopback port
(another one if a process takes it first).

It scrapes what the given configuration says, loads its rule files, and answers PromQL through
its HTTP API. Readiness is its own `/-/ready`, polled with a deadline.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.lanes import missing_lane
from tests.routers.fleet import wait_for
from tests.server import PortTaken, free_port, on_free_ports, port_taken

INSTALL_HINT = "Debian's `prometheus` package: scripts/install-prometheus.sh"


def binary(name: str) -> str:
    """`prometheus` or `promtool` on PATH; skip the test if it is not installed."""
    found = shutil.which(name)
    if found is None:
        missing_lane("prometheus", f"`{name}` is not installed ({INSTALL_HINT})")
    return found


class QueryError(AssertionError):
    """Prometheus refused or failed to evaluate a query."""


class LivePrometheus:
    """Prometheus with `config` (a parsed prometheus.yml) in `directory`; stopped on exit."""

    def __init__(self, config: dict[str, Any], directory: Path, startup_timeout: float = 30.0):
        self.port = 0
        self.url = ""
        config_file = directory / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config))
        self.log_file = directory / "prometheus.log"
        on_free_ports(lambda: self._start(config_file, directory, startup_timeout))

    def _start(self, config_file: Path, directory: Path, startup_timeout: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        with self.log_file.open("w") as log:
            self.process = subprocess.Popen(
                [
                    binary("prometheus"),
                    f"--config.file={config_file}",
                    f"--storage.tsdb.path={directory / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            wait_for(self._ready, f"Prometheus ready at {self.url}", startup_timeout)
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            if port_taken(self.log):
                raise PortTaken(f"Prometheus: port {self.port} is taken")
            raise RuntimeError(f"prometheus exited ({self.process.returncode}):\n{self.log}")
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def log(self) -> str:
        return self.log_file.read_text()

    def api(self, path: str, **params: str) -> Any:
        """The `data` of a successful /api/v1 answer; QueryError with Prometheus's message."""
        response = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10)
        body = response.json()
        if body.get("status") != "success":
            raise QueryError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector `expr` evaluates to now (a scalar comes back as one sample)."""
        data = self.api("query", query=expr)
        if data["resultType"] == "vector":
            return list(data["result"])
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        raise QueryError(f"{expr}: a {data['resultType']}, not an instant vector")

    def value(self, expr: str) -> float:
        """The value of `expr`, which must be one sample (0 when it is empty)."""
        result = self.query(expr)
        assert len(result) <= 1, f"{expr}: {len(result)} series"
        return float(result[0]["value"][1]) if result else 0.0

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def __enter__(self) -> LivePrometheus:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.stop()
