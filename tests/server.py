"""LiveServer: the real `deepinfer-server` run as a subprocess on a loopback port, for tests."""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import httpx
import psutil

#: Test parameter: one API server process (no supervisor), or two under a supervisor.
API_SERVER_COUNTS = [1, 2]
_API_PREFIX = re.compile(r"\[api (\d+)\]")
_probes = itertools.count()


#: The start-up line's address: `serving <models> on 127.0.0.1:<port>`.
_SERVING = re.compile(r"serving .* on 127\.0\.0\.1:(\d+)")
_GRACEFUL_STOP_S = 15.0
_Started = TypeVar("_Started")


def _measured_by_coverage() -> bool:
    """Whether the server's processes measure their coverage: coverage.py's
    `patch = ["subprocess"]` (pyproject.toml) sets the variable in a measured test process, and
    every Python process started from it then writes its data as it exits."""
    return "COVERAGE_PROCESS_CONFIG" in os.environ


def free_port() -> int:
    """A loopback port free at this moment, for an external program that cannot bind port 0 and
    say which port it bound (PostgreSQL, Prometheus, the routers). Another process may bind it
    before the program does: start such a program through `on_free_ports`. Our own servers
    bind port 0 and name the port they bound."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class PortTaken(Exception):
    """An external program could not bind the `free_port()` it was given: another process
    took the port in between."""


def port_taken(log: str) -> bool:
    """Whether a program's log says a port it was given is taken (PostgreSQL's, Go's and Rust's
    wording of EADDRINUSE)."""
    return "address already in use" in log.lower()


def on_free_ports(start: Callable[[], _Started], attempts: int = 5) -> _Started:
    """`start()`, which takes its ports from `free_port()`, again with fresh ports while it
    raises PortTaken: a port taken between `free_port()` and the program's bind cannot fail a
    test."""
    for _ in range(attempts - 1):
        with contextlib.suppress(PortTaken):
            return start()
    return start()


@contextlib.contextmanager
def refusing_port() -> Iterator[int]:
    """A loopback port where nothing listens while the block runs: it is bound (so no other
    process can listen on it) but not listening, and a connection to it is refused."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        yield int(holder.getsockname()[1])


def wait_until(condition: Callable[[], object], timeout: float, what: str) -> None:
    """Poll `condition` every 50 ms until it is true; fail naming `what` at the deadline.

    Only for another process's state that no event reaches the test from (a gauge on /metrics,
    /get_load, a process's exit): whatever can be awaited is awaited instead.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def _leads_session(process: psutil.Process) -> bool:
    try:
        return os.getsid(process.pid) == process.pid
    except ProcessLookupError:
        return False


def _alive(process: psutil.Process) -> bool:
    """Whether `process` still runs. A killed grandchild of the test stays a zombie until the
    init process reaps it (seconds here, not ours to wait for): it holds no port, file or
    memory any more, so it counts as gone."""
    try:
        return bool(process.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def _limit_files(limit: int) -> None:
    """In the child before exec: soft and hard open-file limit `limit` (ulimit -n)."""
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))


class LiveServer:
    """Starts the server, waits for the line that says it listens, and stops it."""

    def __init__(
        self,
        *args: str,
        engine: str = "simulated",
        env: dict[str, str] | None = None,
        startup_timeout: float | None = None,
        file_limit: int | None = None,
        api_servers: int = 1,
        grammar_warmup: bool = False,
        healthy: bool = True,
    ) -> None:
        """`startup_timeout`: seconds to be healthy; by default 60 on the simulated engine and
        180 on DeepInfer's (the twin's ranks import torch and build DeepInfer's engine: 25-45 s
        each on a loaded machine, and a test may start several ranks at once).

        `grammar_warmup`: prepare the grammar compile workers once the server listens, as in
        production (off by default: about 20 s of CPU per server, which most tests never use;
        their first structured request prepares them, as `--no-grammar-warmup` says; with it,
        `/health` answers 200 once structured output is warm).

        `healthy`: return once `/health` answers 200; False: once the server listens (its
        start-up line names the port), to watch what it does before it is healthy."""
        self.api_servers = api_servers
        #: The port the server bound (`--port 0`: the system picks it, the start-up line names
        #: it), known once the server serves; unless `args` give a port of their own.
        self.port = 0
        self.base_url = ""
        self.args = [
            sys.executable,
            "-m",
            "deepinfer_server",
            "--engine",
            engine,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            *(["--api-server-count", str(api_servers)] if api_servers > 1 else []),
            *([] if grammar_warmup else ["--no-grammar-warmup"]),
            *args,
        ]
        self.lines: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.process = subprocess.Popen(
            self.args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            preexec_fn=None if file_limit is None else lambda: _limit_files(file_limit),
        )
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()
        timeout = (
            startup_timeout
            if startup_timeout is not None
            else (180.0 if engine == "deepinfer" else 60.0)
        )
        try:
            if healthy:
                self.wait_until_healthy(timeout)
            else:
                self._wait_for_port(time.monotonic() + timeout)
        except BaseException:
            self.kill_tree()
            raise

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)
            self._lines.put(line)
        self._lines.put(None)

    def _wait_for_port(self, deadline: float) -> None:
        """Read the bound port off the start-up line (`serving ... on 127.0.0.1:PORT`)."""
        try:
            line = self.wait_for_line("[startup]", deadline - time.monotonic(), _SERVING)
        except TimeoutError:
            raise TimeoutError(f"the server never said it serves; log:\n{self.log}") from None
        match = _SERVING.search(line)
        assert match is not None, line
        self.port = int(match.group(1))
        self.base_url = f"http://127.0.0.1:{self.port}"

    def wait_until_healthy(self, timeout: float) -> None:
        """Block until `/health` answers 200 (every rank is ready and HTTP is served), as a
        load balancer's readiness probe would; raise if the server exits first."""
        deadline = time.monotonic() + timeout
        if not self.port:
            self._wait_for_port(deadline)
        with httpx.Client(base_url=self.base_url, timeout=2.0) as probe:
            while True:
                if self.process.poll() is not None:
                    self._pump_thread.join(5)
                    raise RuntimeError(f"server exited ({self.process.poll()}); log:\n{self.log}")
                try:
                    if probe.get("/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass  # not listening yet
                if time.monotonic() > deadline:
                    raise TimeoutError(f"/health never answered 200; log:\n{self.log}")
                # Wake on the next log line (start-up progress), at the latest after 50 ms.
                with contextlib.suppress(queue.Empty):
                    self._lines.get(timeout=0.05)

    def wait_for_health(self, status: str, timeout: float) -> dict[str, Any]:
        """Block until `/health` answers with `status` ("draining", "failed"): the state a load
        balancer sees (503 from the moment a drain starts or the service fails); its JSON. No
        event crosses the process boundary, so this polls with a deadline, waking on each log
        line or after 50 ms."""
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.base_url, timeout=2.0) as probe:
            while True:
                with contextlib.suppress(httpx.TransportError):  # stopped listening: go on
                    answer = probe.get("/health")
                    if answer.json().get("status") == status:
                        assert answer.status_code == 503, answer.text
                        return dict(answer.json())
                if time.monotonic() > deadline:
                    raise TimeoutError(f"/health never said {status!r}; log:\n{self.log}")
                with contextlib.suppress(queue.Empty):
                    self._lines.get(timeout=0.05)

    def wait_for_line(
        self, text: str, timeout: float, pattern: re.Pattern[str] | None = None
    ) -> str:
        """Block until a log line containing `text` (and matching `pattern`, if given) appears
        (an event, not a sleep). For tests whose feature is the line itself; a state change is
        awaited on /health or /metrics."""
        deadline = time.monotonic() + timeout

        def wanted(line: str) -> bool:
            return text in line and (pattern is None or pattern.search(line) is not None)

        for line in self.lines:
            if wanted(line):
                return line
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no log line with {text!r}; log:\n{self.log}")
            try:
                line = self._lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(5)
                raise RuntimeError(f"server exited ({self.process.poll()}); log:\n{self.log}")
            if wanted(line):
                return line

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def rank_processes(self) -> list[psutil.Process]:
        """The DP rank processes (spawned children of the server that lead a session)."""
        return [p for p in self._spawned() if _leads_session(p)]

    def api_processes(self) -> list[psutil.Process]:
        """The API server processes of `--api-server-count` (none with one: the server is it)."""
        return [p for p in self._spawned() if not _leads_session(p)]

    def _spawned(self) -> list[psutil.Process]:
        parent = psutil.Process(self.process.pid)
        spawned = []
        for child in parent.children(recursive=True):
            try:
                command = " ".join(child.cmdline())
            except psutil.Error:  # exited (a zombie until the server reaps it)
                continue
            if "multiprocessing" in command and "spawn_main" in command:
                spawned.append(child)
        return spawned

    def bootstrap_ports(self) -> list[int]:
        """A prefill server's disaggregation bootstrap ports, by DP rank, as its ranks bound
        them (`--disaggregation-bootstrap-port 0`) and its server info reports them."""
        info = httpx.get(f"{self.base_url}/server_info", timeout=10).json()
        ports = info["disaggregation_bootstrap_ports"]
        assert isinstance(ports, list) and all(isinstance(port, int) for port in ports), info
        return ports

    def answered_by(self, request_id: str, timeout: float = 10.0) -> int:
        """Which API server process answered request `request_id` (from its access-log line)."""
        line = self.wait_for_line(f"request_id={request_id} ", timeout)
        match = _API_PREFIX.search(line)
        return int(match.group(1)) if match else 0

    def on_every_api_server(
        self, method: str, path: str, attempts: int = 40, **kwargs: Any
    ) -> dict[int, httpx.Response]:
        """Send the request on fresh connections until every API server process has answered
        it once; each process's response, by process number."""
        answers: dict[int, httpx.Response] = {}
        extra_headers = kwargs.pop("headers", {})
        for _ in range(attempts):
            request_id = f"probe-{next(_probes)}"
            headers = {"X-Request-Id": request_id, **extra_headers}
            # A process's first request with tools waits for its grammar compiler's first
            # compile: tens of seconds on a loaded 2-core machine.
            response = httpx.request(
                method, self.base_url + path, headers=headers, timeout=120, **kwargs
            )
            answers.setdefault(self.answered_by(request_id), response)
            if len(answers) == self.api_servers:
                return answers
        raise AssertionError(f"only API server processes {sorted(answers)} answered {path}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send `sig` and wait for the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise

    def __enter__(self) -> LiveServer:
        return self

    def __exit__(self, *exc: object) -> None:
        if _measured_by_coverage():
            # Coverage writes each process's data as it exits: a graceful stop first, so the
            # server's processes count towards the coverage floor (a kill would lose it).
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.stop(signal.SIGTERM, timeout=_GRACEFUL_STOP_S)
        self.kill_tree()

    def kill_tree(self) -> None:
        """Last-resort cleanup so a failing test leaves no process behind (and no open pipe)."""
        try:
            parent = psutil.Process(self.process.pid)
            family: Sequence[psutil.Process] = [*parent.children(recursive=True), parent]
        except psutil.NoSuchProcess:
            family = []
        for process in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)
        others = [process for process in family if process.pid != self.process.pid]
        wait_until(lambda: not any(map(_alive, others)), 10, "the server's processes to exit")
        self._pump_thread.join(10)
        if self.process.stdout is not None:
            self.process.stdout.close()
