"""Helpers for the router lane: a router subprocess, metrics reads, polling with a deadline."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from tests.lanes import missing_lane
from tests.server import free_port, port_taken

MODEL = "deepseek-flash"
# Fast simulated steps: the lane's requests take milliseconds unless a test wants them long.
REPLICA_ARGS = ("--sim-ttft-ms", "5", "--sim-itl-ms", "5", "--max-model-len", "8192")


def router_binary(name: str, package: str) -> str:
    """The router executable next to this Python, else on PATH; skip the test if absent."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if found is None:
        missing_lane("routers", f"`{name}` is not installed (pip install {package})")
    return found


def smg_binary() -> str:
    """The Shepherd Model Gateway (PyPI `smg`) that scripts/install-smg.sh puts in a venv of its
    own: `$SMG_BIN`, default `$SMG_PREFIX/bin/smg` (SMG_PREFIX: ~/.cache/deepinfer-server/smg).
    Skips the test if it is not there. Not the `smg` next to this Python: that one is
    sglang-router's."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    prefix = Path(os.environ.get("SMG_PREFIX", cache / "deepinfer-server" / "smg"))
    binary = Path(os.environ.get("SMG_BIN", prefix / "bin" / "smg"))
    if not binary.exists():
        missing_lane("smg", f"{binary} is not installed (scripts/install-smg.sh)")
    return str(binary)


def wait_for(condition: Callable[[], Any], what: str, timeout: float, interval: float = 0.1) -> Any:
    """Poll `condition` until it returns something truthy; fail with `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s: {what}")
        time.sleep(interval)


def get_json(url: str) -> Any:
    try:
        response = httpx.get(url, timeout=5)
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None


def metric_sum(base_url: str, name: str) -> float:
    """Sum of every series of `name` in a replica's /metrics."""
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", re.MULTILINE)
    return sum(float(value) for value in pattern.findall(text))


def successes(base_url: str) -> float:
    return metric_sum(base_url, "deepinfer:request_success_total")


def health_status(base_url: str) -> int:
    try:
        return httpx.get(f"{base_url}/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


class Router:
    """A router subprocess on free loopback ports, its log kept for failure messages. A router
    cannot bind port 0 and say which port it bound: one that exits because another process took
    a port first is started again on fresh ones while it is waited for (`workers()`), so `url`
    is read after `wait_healthy`."""

    def __init__(self, command: list[str], log_path: Path, restarts: int = 4) -> None:
        self.log_path = log_path
        self._command = command
        self._restarts = restarts
        self._log = log_path.open("wb")
        self._start()

    def _start(self) -> None:
        self._log.flush()
        self._log_start = self.log_path.stat().st_size  # this start's lines follow
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [
            *self._command,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-port", str(free_port()),  # default 29000 would collide between routers
        ]  # fmt: skip
        self.process = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _start_log(self) -> str:
        """The log of the latest start."""
        with self.log_path.open("rb") as log:
            log.seek(self._log_start)
            return log.read().decode(errors="replace")

    def workers(self) -> list[dict[str, Any]]:
        if self.process.poll() is not None and self._restarts and port_taken(self._start_log()):
            self._restarts -= 1
            self._log.write(b"[test] a port was taken: starting again on fresh ports\n")
            self._start()
            return []
        if self.process.poll() is not None:
            raise AssertionError(f"router exited ({self.process.returncode}):\n{self.log}")
        body = get_json(f"{self.url}/workers")
        return list(body["workers"]) if body else []

    def healthy_urls(self) -> set[str]:
        return {w["url"] for w in self.workers() if w.get("is_healthy")}

    def wait_healthy(self, urls: set[str], timeout: float = 30) -> None:
        wait_for(lambda: self.healthy_urls() == urls, f"router lists {urls} as healthy", timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def vllm_router(worker_urls: list[str], policy: str, log_path: Path) -> Router:
    binary = router_binary("vllm-router", "vllm-router")
    return Router(
        [
            binary, "--worker-urls", *worker_urls, "--policy", policy,
            # Find a dead worker within ~1-2 s; start as soon as the workers answer /health.
            "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
            "--health-check-timeout-secs", "2", "--worker-startup-check-interval", "1",
            "--log-level", "warning",
        ],
        log_path,
    )  # fmt: skip


def sglang_gateway(worker_urls: list[str], policy: str, log_path: Path) -> Router:
    binary = router_binary("smg", "sglang-router")
    return Router(
        [
            binary, "launch", "--worker-urls", *worker_urls, "--policy", policy,
            "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
            "--health-check-timeout-secs", "2", "--worker-startup-check-interval", "1",
            "--log-level", "warn",
        ],
        log_path,
    )  # fmt: skip


def smg_pd_gateway(
    prefill: list[tuple[str, int | None]], decode: list[str], log_path: Path
) -> Router:
    """`smg launch --pd-disaggregation` in front of prefill servers (URL, bootstrap port or
    None) and decode servers, on a free loopback port; not yet waited for (`wait_healthy`)."""
    workers: list[str] = []
    for url, bootstrap_port in prefill:
        workers += ["--prefill", url, "none" if bootstrap_port is None else str(bootstrap_port)]
    for url in decode:
        workers += ["--decode", url]
    return Router(
        [
            smg_binary(), "launch", "--pd-disaggregation", *workers,
            "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
            "--health-check-timeout-secs", "2", "--worker-startup-check-interval", "1",
            "--log-level", "warn",
        ],
        log_path,
    )  # fmt: skip


@contextlib.contextmanager
def pd_gateway(
    prefill: list[tuple[str, int | None]], decode: list[str], log_path: Path
) -> Iterator[Router]:
    """smg in PD mode in front of the given servers, once it lists all of them as healthy;
    stopped on exit. For tests outside tests/routers (the `make_pd_gateway` fixture here)."""
    gateway = smg_pd_gateway(prefill, decode, log_path)
    try:
        # smg registers (and classifies) its workers in the background after it listens.
        gateway.wait_healthy({url for url, _ in prefill} | set(decode))
        yield gateway
    finally:
        gateway.stop()


def chat(
    base_url: str, content: str = "Hello", max_tokens: int = 8, **extra: Any
) -> dict[str, Any]:
    """One non-streamed chat completion; raises on any non-200 answer."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "thinking": {"type": "disabled"},
        **extra,
    }
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, f"{response.status_code}: {response.text}"
    result: dict[str, Any] = response.json()
    assert result["choices"][0]["finish_reason"] in {"stop", "length"}, result
    return result


def stream_chat(base_url: str, max_tokens: int, **extra: Any) -> str:
    """One streamed chat completion read to `[DONE]`; returns its finish_reason.

    Raises on a non-200 answer, an error event or a stream that ends without `[DONE]`.
    """
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "thinking": {"type": "disabled"},
        **extra,
    }
    finish_reason = None
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200, f"{response.status_code}: {response.read()!r}"
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                assert finish_reason is not None, "stream ended without a finish_reason"
                return finish_reason
            event = json.loads(data)
            assert "error" not in event, event
            for choice in event.get("choices", []):
                finish_reason = choice.get("finish_reason") or finish_reason
    raise AssertionError("stream closed before [DONE]")
