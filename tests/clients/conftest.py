"""The client lane: real clients (Claude Code, Codex CLI, LiteLLM, LangChain, the SDKs) against a
live simulated server, through a logging proxy that records what each client sent.

Install the clients with `scripts/install-test-clients.sh`; run with `pytest -m clients`.
A test skips only when its client is not installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.clients.proxy import Exchange, LoggingProxy
from tests.lanes import missing_lane
from tests.server import LiveServer

MODEL = "deepseek-flash"
MAX_MODEL_LEN = 32768
# The lane's server seals Responses reasoning with this key, so tests can open the blobs.
REASONING_SECRET = "client-lane-secret"
REPO = Path(__file__).resolve().parents[2]
# Where scripts/install-test-clients.sh puts the npm clients (TEST_CLIENTS_PREFIX overrides).
NPM_PREFIX = Path(os.environ.get("TEST_CLIENTS_PREFIX", REPO / ".test-clients"))
# Set to a directory to keep every test's recorded exchanges there as JSON.
TRACE_DIR = os.environ.get("DEEPINFER_CLIENT_TRACE_DIR")
# What the environment of a client subprocess keeps from ours (no keys, no user settings).
INHERITED_ENV = ("PATH", "LANG", "LC_ALL", "TERM", "TZ", "SSL_CERT_FILE", "NODE_EXTRA_CA_CERTS")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "clients: runs a real client (CLI or library) against a live server"
    )


def marker() -> str:
    """A unique word the echo engine must hand back."""
    return f"MARK{uuid.uuid4().hex[:10].upper()}"


@pytest.fixture(autouse=True)
def close_leftover_event_loop() -> Iterator[None]:
    """Close the event loop a synchronous client library left behind.

    LiteLLM's synchronous `completion()` calls `asyncio.get_event_loop()` for its service
    logger, which creates a loop, sets it as the thread's current loop and never closes it. Left
    open, that loop is garbage-collected at some later point of the session and its
    ResourceWarning (an error here) fails whichever test happens to run then."""
    yield
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        policy = asyncio.get_event_loop_policy()
        try:
            loop = policy.get_event_loop()
        except RuntimeError:  # no current loop, and none may be created here
            return
    if not loop.is_running():
        loop.close()
        policy.set_event_loop(None)


@pytest.fixture(scope="session")
def server_args() -> list[str]:
    """DP=1, 32k context as on the real deployment, fast simulated steps (Claude Code's echoed
    turn is ~2.5k tokens: its system reminders ride in the user turn)."""
    return [
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--sim-itl-ms",
        "1",
        "--sim-ttft-ms",
        "5",
        "--reasoning-secret",
        REASONING_SECRET,
    ]


@contextlib.contextmanager
def live_server(*args: str) -> Iterator[LiveServer]:
    """LiveServer, also when it fails to start, reaped completely: process waited for, output
    pipe closed once its reader thread is done (nothing left for ResourceWarnings)."""
    before = set(threading.enumerate())
    server = LiveServer.__new__(LiveServer)
    try:
        server.__init__(*args)  # type: ignore[misc]
        with server:
            yield server
    finally:
        pumps = [t for t in set(threading.enumerate()) - before if "_pump" in t.name]
        process = getattr(server, "process", None)
        if process is not None:
            if process.poll() is None:
                server.kill_tree()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
            for pump in pumps:
                pump.join(10)
            if process.stdout is not None and not any(p.is_alive() for p in pumps):
                process.stdout.close()


@pytest.fixture(scope="session")
def client_server(server_args: list[str]) -> Iterator[LiveServer]:
    """One simulated server for the whole lane: DP=1, 32k context as on the real deployment."""
    with live_server(*server_args) as server:
        yield server


@pytest.fixture(scope="session")
def session_proxy(client_server: LiveServer) -> Iterator[LoggingProxy]:
    with LoggingProxy(client_server.base_url) as proxy:
        yield proxy


@dataclass
class Recorder:
    """The exchanges of one test, and the server's log lines written meanwhile."""

    proxy: LoggingProxy
    server: LiveServer
    start: int
    log_start: int

    @property
    def base_url(self) -> str:
        return self.proxy.base_url

    @property
    def exchanges(self) -> list[Exchange]:
        return self.proxy.since(self.start)

    def to(self, path: str) -> list[Exchange]:
        return [exchange for exchange in self.exchanges if exchange.path == path]

    @property
    def server_log(self) -> str:
        return "".join(self.server.lines[self.log_start :])

    def report(self) -> str:
        """For assertion messages: every request with the server's answer."""
        lines = [exchange.summary() for exchange in self.exchanges] or ["(no requests)"]
        return "\n".join(lines)


@pytest.fixture()
def recorder(
    request: pytest.FixtureRequest, session_proxy: LoggingProxy, client_server: LiveServer
) -> Iterator[Recorder]:
    rec = Recorder(session_proxy, client_server, session_proxy.mark(), len(client_server.lines))
    yield rec
    if TRACE_DIR:
        Path(TRACE_DIR).mkdir(parents=True, exist_ok=True)
        name = re.sub(r"[^\w.-]+", "_", request.node.nodeid.split("::", 1)[-1])
        trace = [
            {
                "method": exchange.method,
                "target": exchange.target,
                "headers": exchange.headers,
                "body": _maybe_json(exchange.body),
                "status": exchange.status,
                "response": exchange.response_text,
            }
            for exchange in rec.exchanges
        ]
        (Path(TRACE_DIR) / f"{name}.json").write_text(json.dumps(trace, indent=1))


def _maybe_json(body: bytes) -> object:
    try:
        return json.loads(body)
    except ValueError:
        return body.decode(errors="replace")


def find_client(name: str) -> str:
    """The installed binary, from the project-local npm prefix or PATH; skip when missing."""
    local = NPM_PREFIX / "node_modules" / ".bin" / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if found:
        return found
    missing_lane(
        "clients",
        f"{name} is not installed (run scripts/install-test-clients.sh; looked in {local} "
        "and on PATH)",
    )


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    """A client's environment: a throwaway HOME and nothing of ours that could steer it."""
    env = {key: os.environ[key] for key in INHERITED_ENV if key in os.environ}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), NO_COLOR="1")
    env.update(extra)
    return env


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str

    def describe(self, recorder: Recorder) -> str:
        return (
            f"exit {self.returncode}\n--- stdout\n{self.stdout[-3000:]}\n--- stderr\n"
            f"{self.stderr[-3000:]}\n--- requests\n{recorder.report()}"
        )


def run_client(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 60) -> Run:
    """Run a client's command in a session of its own. Its whole process group is killed when
    the command is done, times out or is interrupted (GuideLLM's fork-server workers, an agent
    CLI's children), not only its first process."""
    with subprocess.Popen(
        args,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        encoding="utf-8",
        errors="replace",
        start_new_session=True,
    ) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # Not reaped yet, so the group id is still this session's.
            _kill_group(process.pid)
            out, err = _rest_of_output(process)
            return Run(-1, out, f"{err}\nTIMED OUT after {timeout} s")
        except BaseException:
            _kill_group(process.pid)
            raise
        _kill_group(process.pid)
    return Run(process.returncode, out, err)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def _rest_of_output(process: subprocess.Popen[str]) -> tuple[str, str]:
    """What a killed client wrote; nothing more if a process that left its group holds the
    pipes open."""
    try:
        return process.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        return "", ""


def sse_events(text: str) -> list[dict[str, object]]:
    """The JSON payloads of a server-sent event stream (`[DONE]` left out)."""
    events = []
    for line in text.splitlines():
        if line.startswith("data:"):
            payload = line[5:].strip()
            if payload and payload != "[DONE]":
                events.append(json.loads(payload))
    return events
