#!/usr/bin/env python3
"""Start N simulated deepinfer-server replicas behind a router on this machine.

    python scripts/replicas.py --replicas 2 --policy round_robin [-- --sim-itl-ms 5 ...]

Each replica is `python -m deepinfer_server --engine simulated --host 127.0.0.1 --port P` (the
arguments after `--` are added to every replica); the router is vLLM Router (`vllm-router`,
PyPI `vllm-router`) or, with `--router sglang`, the SGLang Model Gateway (`smg launch`, PyPI
`sglang-router`; its replicas get `--get-load-format sglang`, the /get_load shape it reads).
The script waits until every replica answers /health and the router has them all, prints the
router URL, and runs until Ctrl-C or SIGTERM; then it stops the router and the replicas
(SIGTERM, then SIGKILL of each process group after --stop-timeout), so no rank process is left
behind. Standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

POLICIES = ["round_robin", "random", "power_of_two", "cache_aware", "consistent_hash"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()
    except (OSError, urllib.error.URLError):
        return 0, b""


def router_command(kind: str, port: int, urls: list[str], policy: str) -> list[str]:
    name = "vllm-router" if kind == "vllm" else "smg"
    local = Path(sys.executable).parent / name
    binary = str(local) if local.exists() else shutil.which(name)
    if binary is None:
        package = "vllm-router" if kind == "vllm" else "sglang-router"
        sys.exit(f"replicas.py: `{name}` not found; install it with: pip install {package}")
    common = [
        "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
        "--policy", policy, "--prometheus-port", str(free_port()),
        "--worker-startup-check-interval", "1", "--health-check-interval-secs", "5",
    ]  # fmt: skip
    return [binary, *common] if kind == "vllm" else [binary, "launch", *common]


def router_has_workers(url: str, count: int) -> bool:
    status, body = get(f"{url}/workers")
    if status != 200:
        return False
    try:
        workers = json.loads(body)["workers"]
    except (ValueError, KeyError, TypeError):
        return False
    return sum(1 for w in workers if w.get("is_healthy")) >= count


class Fleet:
    """The processes started, each in a process group of its own."""

    def __init__(self) -> None:
        self.processes: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, command: list[str]) -> subprocess.Popen[bytes]:
        # Own process group: the replica's rank processes can be signalled with it.
        process = subprocess.Popen(command, start_new_session=True)
        self.processes.append((name, process))
        return process

    def dead(self) -> list[str]:
        return [f"{n} (exit {p.returncode})" for n, p in self.processes if p.poll() is not None]

    def stop(self, timeout: float) -> None:
        for _, process in reversed(self.processes):  # router first, then replicas
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for _, process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.0, deadline - time.monotonic()))
        for _, process in self.processes:  # whatever is left of each group, ranks included
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            if process.poll() is None:
                process.wait()


def wait_until(condition: Callable[[], bool], what: str, timeout: float, fleet: Fleet) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if fleet.dead():
            raise RuntimeError(f"exited while waiting for {what}: {', '.join(fleet.dead())}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1 :]
        argv = argv[: argv.index("--")]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--router", choices=["vllm", "sglang"], default="vllm")
    parser.add_argument("--policy", choices=POLICIES, default="round_robin")
    parser.add_argument("--router-port", type=int, default=0, help="default: a free port")
    parser.add_argument("--startup-timeout", type=float, default=120.0)
    parser.add_argument("--stop-timeout", type=float, default=40.0)
    args = parser.parse_args(argv)

    if args.router == "sglang":
        extra = ["--get-load-format", "sglang", *extra]
    fleet = Fleet()
    stop_requested = False

    def request_stop(signum: int, _frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        urls = []
        for index in range(args.replicas):
            port = free_port()
            urls.append(f"http://127.0.0.1:{port}")
            fleet.start(
                f"replica {index}",
                [sys.executable, "-m", "deepinfer_server", "--engine", "simulated",
                 "--host", "127.0.0.1", "--port", str(port), *extra],
            )  # fmt: skip
        for url in urls:
            wait_until(lambda u=url: get(f"{u}/health")[0] == 200, f"{url}/health",
                       args.startup_timeout, fleet)  # fmt: skip
        router_port = args.router_port or free_port()
        router_url = f"http://127.0.0.1:{router_port}"
        fleet.start("router", router_command(args.router, router_port, urls, args.policy))
        wait_until(lambda: router_has_workers(router_url, len(urls)), f"{router_url}/workers",
                   args.startup_timeout, fleet)  # fmt: skip
        print(f"replicas: {' '.join(urls)}", flush=True)
        print(f"router ({args.router}, {args.policy}): {router_url}", flush=True)
        print(f"OpenAI base URL: {router_url}/v1  (Ctrl-C stops everything)", flush=True)
        while not stop_requested:
            if fleet.dead():
                print(f"replicas.py: exited: {', '.join(fleet.dead())}", file=sys.stderr)
                return 1
            time.sleep(0.5)
        return 0
    except (RuntimeError, TimeoutError) as error:
        print(f"replicas.py: {error}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        fleet.stop(args.stop_timeout)


if __name__ == "__main__":
    sys.exit(main())
