"""A server stopped during its grammar warm-up stops quietly and at once: no traceback, no false
"worker failed to start", and no process left behind (the workers' fork server, still loading
xgrammar, used to outlive the server by the rest of its load, and the stop waited for it)."""

from __future__ import annotations

import signal

import psutil
import pytest

from tests.lanes import require_grammar
from tests.routers.fleet import wait_for
from tests.server import LiveServer

require_grammar()
pytestmark = pytest.mark.grammar


def _fork_server(server: LiveServer) -> psutil.Process | None:
    """The compile workers' fork server among the server's processes, once it runs."""
    for process in psutil.Process(server.process.pid).children(recursive=True):
        try:
            if "multiprocessing.forkserver" in " ".join(process.cmdline()):
                return process
        except psutil.NoSuchProcess:
            continue
    return None


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_stop_during_the_grammar_warmup_is_quiet_and_leaves_no_process() -> None:
    with LiveServer(
        "--sim-itl-ms", "1", startup_timeout=180.0, grammar_warmup=True, healthy=False
    ) as server:
        wait_for(lambda: _fork_server(server), "the warm-up's fork server", timeout=60)
        # Still loading xgrammar: the warm-up has not finished.
        assert "grammar compile workers ready" not in server.log
        family = psutil.Process(server.process.pid).children(recursive=True)
        assert server.stop(signal.SIGTERM, timeout=30) == 0
        _, alive = psutil.wait_procs(family, timeout=5)
        assert not [p.pid for p in alive if _running(p)]
        server._pump_thread.join(10)  # every line the server wrote has been read
    assert "Traceback" not in server.log
    assert "failed to start" not in server.log
    assert "[shutdown] done" in server.log
