"""A simulated server's start-up and its first structured requests, for checkouts side by side.

For each checkout (`--checkout DIR`, its sources `DIR/src` first on the path; by default this
one), starts `deepinfer-server --engine simulated` and times launch -> /health 200, then one
structured request (a schema never compiled before), then a second with another schema. It also
reads the CPU time the server's processes had used when /health answered and once the second
request was answered (what a server costs a machine that starts many, as CI does). With
`--idle S` it first leaves the server idle for S seconds after /health and reads its CPU time
then too (what a server that is never asked for structured output costs), so the first request
comes after any warm-up. Rounds alternate the checkouts; each figure is the median over the
rounds, and every figure is also given as a ratio to the first checkout's:

    python bench/grammar_startup.py --checkout /path/to/main --checkout . --rounds 3
    python bench/grammar_startup.py --checkout /path/to/main --checkout . --rounds 1 --idle 60
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil


@dataclass(frozen=True)
class Run:
    """One server's figures, in seconds."""

    ready: float
    first: float
    second: float
    cpu_at_ready: float
    cpu_idle: float
    cpu_after: float


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_healthy(server: subprocess.Popen[bytes], base_url: str, what: str, poll: float) -> None:
    """Until `/health` answers 200 (read every `poll` seconds); exit if `server` exits first."""
    while True:
        try:
            if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            raise SystemExit(f"{what} exited with {server.returncode}")
        time.sleep(poll)


def _cpu(server: psutil.Process) -> float:
    """User and system CPU seconds of the server and its live descendants."""
    total = 0.0
    for process in [server, *server.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def _structured(base_url: str, name: str) -> float:
    schema = {"type": "object", "properties": {name: {"type": "integer"}}, "required": [name]}
    body = {
        "model": "deepseek-flash",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 64,
        "thinking": {"type": "disabled"},
        "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
    }
    started = time.perf_counter()
    response = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    return time.perf_counter() - started


def run_once(checkout: Path, idle: float) -> Run:
    """Start a server from `checkout`'s sources and time it (see the module)."""
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(checkout / "src")}
    command = [sys.executable, "-m", "deepinfer_server", "--engine", "simulated"]
    started = time.perf_counter()
    server = subprocess.Popen(
        [*command, "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    process = psutil.Process(server.pid)
    try:
        wait_healthy(server, base_url, f"the server of {checkout}", poll=0.05)
        ready = time.perf_counter() - started
        cpu_at_ready = _cpu(process)
        if idle:
            time.sleep(idle)
        cpu_idle = _cpu(process)
        first = _structured(base_url, "first")
        second = _structured(base_url, "second")
        return Run(ready, first, second, cpu_at_ready, cpu_idle, _cpu(process))
    finally:
        server.terminate()
        server.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkout",
        action="append",
        type=Path,
        help="a checkout to measure (repeat to compare; the first is the baseline)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle", type=float, default=0.0, help="seconds idle after /health")
    args = parser.parse_args()
    # Stopped, it still stops the server it started (the `finally` of `run_once`).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    checkouts: list[Path] = [
        path.resolve() for path in args.checkout or [Path(__file__).resolve().parents[1]]
    ]
    runs: dict[Path, list[Run]] = {path: [] for path in checkouts}
    for round_index in range(args.rounds):
        for path in checkouts:
            run = run_once(path, args.idle)
            runs[path].append(run)
            print(f"round {round_index + 1} {path}: {run}", file=sys.stderr)
    fields = ("ready", "first", "second", "cpu_at_ready", "cpu_idle", "cpu_after")
    medians = {
        path: {name: statistics.median(getattr(r, name) for r in runs[path]) for name in fields}
        for path in checkouts
    }
    base = medians[checkouts[0]]
    print(f"median of {args.rounds} rounds, seconds (ratio to {checkouts[0]})")
    print(f"{'checkout':40} " + " ".join(f"{name:>20}" for name in fields))
    for path in checkouts:
        cells = [f"{medians[path][n]:8.2f} ({medians[path][n] / base[n]:5.2f}x)" for n in fields]
        print(f"{str(path)[-40:]:40} " + " ".join(f"{cell:>20}" for cell in cells))


if __name__ == "__main__":
    main()
