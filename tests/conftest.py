"""Shared fixtures: one live DP=2 server for the tests that do not break or reconfigure it."""

from __future__ import annotations

import itertools
import multiprocessing.context
import os
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.deepinfer_twin import NOT_BUILT, runs_on_twin
from tests.lanes import fail_missing_lane, mark_missing_lane
from tests.paths import TESTS
from tests.server import LiveServer

#: Folders whose tests run real server processes: marker `e2e` (`pytest -m "not e2e"` is the
#: fast lane).
_E2E_FOLDERS = frozenset({"e2e", "clients", "routers", "fuzz", "prometheus"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests in the end-to-end folders get the `e2e` marker; tests of DeepInfer's own code
    (marker `deepinfer_twin`) need the CPU twin: the twin lane (tests/lanes.py)."""
    e2e = pytest.mark.e2e
    twin_built = runs_on_twin()
    for item in items:
        parts = item.path.relative_to(TESTS).parts
        uses_a_server = "shared_server" in getattr(item, "fixturenames", ())
        if (parts and parts[0] in _E2E_FOLDERS) or uses_a_server:
            item.add_marker(e2e)
        if not twin_built and "deepinfer_twin" in item.keywords:
            mark_missing_lane(item, "twin", NOT_BUILT)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before any fixture: a test collected without its lane fails where lanes are required."""
    fail_missing_lane(item)


class _ServerProcessInFastLane(AssertionError):
    """A test without the `e2e` marker started a server, rank or worker process."""


def _starts_the_server(args: Any) -> bool:
    """Whether a command runs `python -m deepinfer_server` or the `deepinfer-server` script
    (judged by its words, not its paths: a checkout may be named after the project)."""
    if isinstance(args, (str, bytes, os.PathLike)):
        words = shlex.split(os.fsdecode(args)) if isinstance(args, (str, bytes)) else [args]
    else:
        words = list(args)
    words = [os.fsdecode(word) for word in words]
    if words and os.path.basename(words[0]) == "deepinfer-server":
        return True
    return any(a == "-m" and b == "deepinfer_server" for a, b in itertools.pairwise(words))


@pytest.fixture(autouse=True)
def fast_lane_starts_no_process(request: pytest.FixtureRequest) -> Iterator[None]:
    """The fast lane (`-m "not e2e"`) starts no server process: a test without the `e2e` marker
    that starts the server (`python -m deepinfer_server`) or a spawned process (how the server
    starts its ranks and API server processes) fails, naming the marker it lacks. Grammar
    compile workers (forked from their fork server) are the in-process tests' compiler and
    stay allowed."""
    if request.node.get_closest_marker("e2e") is not None:
        yield
        return
    refusal = f"{request.node.nodeid} starts a process: mark it `e2e` (it is not the fast lane)"

    class GuardedPopen(subprocess.Popen):  # type: ignore[type-arg]
        def __init__(self, args: Any, *rest: Any, **options: Any) -> None:
            if _starts_the_server(args):
                raise _ServerProcessInFastLane(refusal)
            super().__init__(args, *rest, **options)

    def refuse(self: multiprocessing.process.BaseProcess) -> None:
        raise _ServerProcessInFastLane(refusal)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess, "Popen", GuardedPopen)
        patch.setattr(multiprocessing.context.SpawnProcess, "start", refuse)
        yield


@pytest.fixture(scope="session", autouse=True)
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The servers the tests start keep their state (the Responses store) in a temporary
    directory, never in the user's."""
    path = tmp_path_factory.mktemp("state")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DEEPINFER_STATE_DIR", str(path))
        yield path


MODEL = "deepseek-flash"
NO_THINKING = {"thinking": {"type": "disabled"}}
#: A request that runs for far longer than any test (3000 tokens, EOS ignored).
ENDLESS = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "again"}],
    "max_tokens": 3000,
    "ignore_eos": True,
    **NO_THINKING,
}


@pytest.fixture(scope="session")
def shared_server() -> Iterator[LiveServer]:
    """A simulated DP=2 server with fast steps, shared by the read-only end-to-end tests."""
    server = LiveServer(
        "--ep",
        "2",
        "--dp",
        "2",
        "--sim-ttft-ms",
        "5",
        "--sim-itl-ms",
        "2",
        "--max-model-len",
        "4096",
        grammar_warmup=True,  # long-lived, and serves the structured-output tests
        # Healthy once structured output is warm: xgrammar and PyTorch loaded by its fork
        # servers, seconds of CPU each on a loaded machine.
        startup_timeout=180.0,
    )
    with server:
        yield server


@pytest.fixture()
def client(shared_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{shared_server.base_url}/v1", api_key="unused", max_retries=0
    ) as client:
        yield client
