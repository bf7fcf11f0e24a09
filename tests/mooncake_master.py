"""A real `mooncake_master` for the tests of the shared store tier (the disaggregation extra:
`tests.lanes.require_disaggregation` first)."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

from tests.server import PortTaken, free_port, on_free_ports, port_taken, wait_until


class MooncakeMaster:
    """A `mooncake_master` on free loopback ports (its RPC port and its metrics port)."""

    def __init__(self, log: Path) -> None:
        self._log = log
        self.port = self.metrics_port = 0
        self._process: subprocess.Popen[bytes] | None = None
        on_free_ports(self._start)

    def _start(self) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        binary = Path(sys.executable).parent / "mooncake_master"
        with self._log.open("wb") as log:
            self._process = subprocess.Popen(
                [str(binary), f"--rpc_port={self.port}", f"--metrics_port={self.metrics_port}"],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_until(lambda: self._ready(), 30, "mooncake_master serves its metrics")

    def _ready(self) -> bool:
        assert self._process is not None
        if self._process.poll() is not None:
            if port_taken(self._log.read_text(errors="replace")):
                raise PortTaken(f"mooncake_master: port {self.port} is taken")
            raise AssertionError(f"mooncake_master exited:\n{self._log.read_text()}")
        return self.keys() is not None

    def keys(self) -> int | None:
        """The keys the master holds (None while it does not answer)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                body = answer.read().decode()
        except OSError:
            return None
        lines = body.splitlines()
        counts = [line.split()[1] for line in lines if line.startswith("master_key_count ")]
        return int(float(counts[0])) if counts else None

    def close(self) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
