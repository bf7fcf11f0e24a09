"""Processes for the benchmarks: a server (deepinfer-server or the raw baseline) and the client."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Self

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def extract_src(revision: str, into: Path) -> Path:
    """The `src/` of git revision `revision`, extracted under `into` (a directory to put on
    PYTHONPATH in place of this checkout's)."""
    archive = into / "src.tar"
    with archive.open("wb") as out:
        subprocess.run(["git", "archive", revision, "src"], cwd=ROOT, stdout=out, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_listening(port: int, process: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)  # polling a port that only opens once every rank is ready
    raise TimeoutError(f"port {port} did not open")


@dataclass
class _Running:
    """A process the bench started, listening on `port`, stopped on leaving a `with`."""

    process: subprocess.Popen[bytes]
    port: int

    #: Seconds a terminated process has to exit before it is killed.
    stop_grace: ClassVar[float] = 10

    def stop(self) -> None:
        """Terminate the process; kill what is left after `stop_grace` seconds."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(self.stop_grace)
            except subprocess.TimeoutExpired:
                self._kill()

    def _kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class Server(_Running):
    """A running server process and its port."""

    #: A server drains its requests when terminated.
    stop_grace: ClassVar[float] = 30

    @classmethod
    def deepinfer(cls, *args: str, env: dict[str, str] | None = None) -> Server:
        """deepinfer-server on the simulated engine; `env`, when given, is its environment (a
        PYTHONPATH that selects another revision's sources, say)."""
        port = free_port()
        command = [
            sys.executable,
            "-m",
            "deepinfer_server",
            "--engine",
            "simulated",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--disable-access-log",
            "--log-level",
            "warning",
            *args,
        ]
        return cls._launch(port, command, env)

    @classmethod
    def paced_floor(cls, tick_ms: float) -> Server:
        return cls._script("paced_floor.py", "--tick-ms", str(tick_ms))

    @classmethod
    def raw_baseline(cls, first_token_ms: float = 0.0) -> Server:
        return cls._script("raw_asgi.py", "--first-token-ms", str(first_token_ms))

    @classmethod
    def _script(cls, script: str, *args: str) -> Server:
        """One of bench/'s own servers, on a free port."""
        port = free_port()
        return cls._launch(port, [sys.executable, str(HERE / script), "--port", str(port), *args])

    @classmethod
    def _launch(cls, port: int, command: list[str], env: dict[str, str] | None = None) -> Server:
        process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
        )
        _wait_listening(port, process)
        return cls(process, port)

    def tree(self) -> list[psutil.Process]:
        parent = psutil.Process(self.process.pid)
        return [parent, *parent.children(recursive=True)]

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far of the API process ("api") and of all its children ("ranks")."""
        processes = self.tree()

        def used(p: psutil.Process) -> float:
            times = p.cpu_times()
            return float(times.user + times.system)

        return {"api": used(processes[0]), "ranks": sum(used(p) for p in processes[1:])}

    def http_cpu_times(self) -> tuple[float, float]:
        """(user, system) CPU seconds so far of every process listening on the server's port
        (the HTTP processes: one, or --api-server-count of them), read from /proc."""
        user = system = 0.0
        for process in self.tree():
            try:
                listening = any(
                    c.status == psutil.CONN_LISTEN and c.laddr.port == self.port
                    for c in process.net_connections("tcp")
                )
                if listening:
                    times = process.cpu_times()
                    user += times.user
                    system += times.system
            except psutil.NoSuchProcess:
                continue
        return user, system

    def rss_bytes(self) -> int:
        return int(psutil.Process(self.process.pid).memory_info().rss)

    def _kill(self) -> None:
        # Its ranks and API processes too: the server is not there to stop them.
        for process in self.tree():
            process.kill()
        self.process.wait()


def smg_binary() -> str:
    """The Shepherd Model Gateway that scripts/install-smg.sh installs in a venv of its own:
    `$SMG_BIN`, default `$SMG_PREFIX/bin/smg` (SMG_PREFIX: ~/.cache/deepinfer-server/smg)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    prefix = Path(os.environ.get("SMG_PREFIX", cache / "deepinfer-server" / "smg"))
    binary = Path(os.environ.get("SMG_BIN", prefix / "bin" / "smg"))
    if not binary.exists():
        raise RuntimeError(f"{binary} is not installed (scripts/install-smg.sh)")
    return str(binary)


@dataclass
class Gateway(_Running):
    """smg in front of servers, on a free loopback port, once it lists them all as healthy."""

    @classmethod
    def smg(cls, workers: list[str], expected: int, timeout: float = 60) -> Gateway:
        """`smg launch WORKERS...` (`--worker-urls URL`, or `--pd-disaggregation --prefill URL
        PORT --decode URL`) serving `expected` workers."""
        import httpx

        port = free_port()
        command = [
            smg_binary(), "launch", *workers, "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(free_port()), "--log-level", "warn",
            "--health-check-interval-secs", "1", "--worker-startup-check-interval", "1",
        ]  # fmt: skip
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        gateway = cls(process, port)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"smg exited with {process.returncode}")
            try:
                workers_now = httpx.get(f"http://127.0.0.1:{port}/workers", timeout=2).json()
            except (httpx.HTTPError, ValueError):
                workers_now = {}
            healthy = [w for w in workers_now.get("workers", []) if w.get("is_healthy")]
            if len(healthy) == expected:
                return gateway
            time.sleep(0.2)  # smg registers its workers in the background after it listens
        gateway.stop()
        raise TimeoutError(f"smg did not list {expected} healthy workers")


def run_client(
    port: int,
    body: dict[str, Any],
    concurrency: int,
    duration: float,
    timing: bool = False,
    requests: int | None = None,
    frame_gaps: bool = False,
    path: str = "/v1/chat/completions",
    distinct: str | None = None,
) -> dict[str, Any]:
    """Run bench/loadgen.py in its own process; returns its JSON result. With `distinct`, that
    string in the body is replaced by a number of its own in every request."""
    command = [
        sys.executable,
        str(HERE / "loadgen.py"),
        "--port",
        str(port),
        "--path",
        path,
        "--body",
        json.dumps(body),
        "--concurrency",
        str(concurrency),
        "--duration",
        str(duration),
    ]
    if timing:
        command.append("--timing")
    if requests is not None:
        command += ["--requests", str(requests)]
    if frame_gaps:
        command.append("--frame-gaps")
    if distinct is not None:
        command += ["--distinct", distinct]
    if os.cpu_count() and os.cpu_count() > 1:  # type: ignore[operator]
        command += ["--cpu", str(os.cpu_count() - 1)]  # type: ignore[operator]
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return dict(json.loads(output))


def run_wrk(port: int, body: dict[str, Any], concurrency: int, duration: float) -> dict[str, Any]:
    """Run wrk (one thread, pinned to the last CPU) for POST requests; returns rates and CPU."""
    import re
    import resource
    import shutil
    import tempfile

    wrk = shutil.which("wrk")
    if wrk is None:
        raise RuntimeError("wrk is not installed (Debian: apt-get install wrk)")
    script = (
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = {json.dumps(json.dumps(body))}\n"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as lua:
        lua.write(script)
    command = [
        wrk,
        "-t1",
        f"-c{concurrency}",
        f"-d{duration:g}s",
        "--timeout",
        "60s",
        "-s",
        lua.name,
        f"http://127.0.0.1:{port}/v1/chat/completions",
    ]
    cpus = os.cpu_count() or 1
    if cpus > 1 and shutil.which("taskset"):
        command = ["taskset", "-c", str(cpus - 1), *command]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    os.unlink(lua.name)
    rate = re.search(r"Requests/sec:\s+([\d.]+)", output)
    non_2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", output)
    errors = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output
    )
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "requests_per_second": float(rate.group(1)) if rate else 0.0,
        "errors": (int(non_2xx.group(1)) if non_2xx else 0)
        + (sum(int(g) for g in errors.groups()) if errors else 0),
        "client_cpu": cpu / elapsed,
        "elapsed": elapsed,
    }
