"""The rank process body: build the engine, report ready, run the loop, close together.

`run_rank` is the spawn target; it is the only code that runs in a rank process. The engine
module is imported here, inside the child, from the backend's `builder` path: the API process
never imports an engine implementation.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import multiprocessing
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

from deepinfer_server.config.logs import configure_logging
from deepinfer_server.engines.backend import BuiltEngine, EngineSpec, SharedState
from deepinfer_server.ipc.messages import GrammarWarm, RankFailed, RankReady
from deepinfer_server.ipc.stop_agreement import StopAgreement
from deepinfer_server.rank.child_watch import ChildWatchdog, exit_rank_process
from deepinfer_server.rank.links import ApiLinks, report
from deepinfer_server.rank.loop import RankLoop
from deepinfer_server.rank.spec import RankSpec

logger = logging.getLogger("deepinfer_server.rank")

_PR_SET_PDEATHSIG = 1
#: Seconds engine children get to leave on their own after close() before they are killed.
_CHILD_EXIT_GRACE_SECONDS = 2.0


def die_with_parent(parent: int | None = None) -> None:
    """Ask Linux to SIGKILL this process when its parent (pid `parent`, by default the current
    one) dies, so nothing is orphaned."""
    parent = os.getppid() if parent is None else parent
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _engine_child_setup(rank_pid: int) -> Callable[[], None]:
    """The at-fork hook for every process the engine forks (DeepInfer's multi-modal-worker-0):
    die with the rank, and take default signal dispositions so that `terminate()` ends it."""

    def after_fork_in_child() -> None:
        die_with_parent(rank_pid)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    return after_fork_in_child


def _own_process_group() -> None:
    """Make the rank the leader of a new session: its engine children join its process group,
    which the API process kills whole (`server.ranks`), and signals sent to the API
    process's group (Ctrl-C, `kill -TERM -PGID`) no longer reach it: the API process stops
    the ranks in order itself."""
    with contextlib.suppress(PermissionError):  # already a leader (never for a spawned rank)
        os.setsid()


def reap_engine_children(grace: float) -> None:
    """Wait up to `grace` seconds for the processes the engine started, then kill the rest.

    DeepInfer keeps no handle to its CP workers, and its multimodal worker blocks on a queue
    forever; left alone, multiprocessing's exit handler would join them without a timeout.
    """
    deadline = time.monotonic() + grace
    children = multiprocessing.active_children()
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
    for child in children:
        if child.is_alive():
            logger.warning("[shutdown] killing engine child %s (pid %s)", child.name, child.pid)
            child.kill()
            child.join(5.0)


def _exit_rank(code: int, grace: float) -> NoReturn:
    """Leave the rank process without multiprocessing's unbounded join of children and without
    running engine finalizers (`__del__` -> `close()` is a world barrier)."""
    reap_engine_children(grace)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def build_engine(spec: RankSpec, shared: SharedState | None) -> BuiltEngine:
    """Import the backend's builder (here, in the rank process) and construct the engine."""
    module_name, _, function_name = spec.builder.partition(":")
    builder: Callable[[EngineSpec, SharedState | None], BuiltEngine] = getattr(
        importlib.import_module(module_name), function_name
    )
    return builder(spec.engine, shared)


def _report(spec: RankSpec, failure: RankFailed) -> None:
    """Send one failure report to every API process on connections of its own (the loop's
    thread owns the links); returns once the bytes are with the kernel, before `os._exit`."""
    report(spec.api_addresses, spec.rank, failure)


def _fail_from_watchdog(spec: RankSpec, message: str) -> None:
    """Report a dead engine child, then end the process (called on the watchdog thread)."""
    _report(spec, RankFailed(spec.rank, message, ""))
    reap_engine_children(0.0)
    exit_rank_process(1)


def _ready(spec: RankSpec, built: BuiltEngine) -> RankReady:
    """The rank's readiness report: its bootstrap port and KV layout (a prefill or decode
    rank's), and whether its grammar builder still warms up."""
    return RankReady(
        spec.rank,
        os.getpid(),
        built.bootstrap_port,
        built.after_ready is not None,
        layout=built.layout,
    )


def run_rank(spec: RankSpec, stop: StopAgreement, shared: SharedState | None) -> None:
    """Spawn target of DP rank `spec.rank`."""
    _own_process_group()
    die_with_parent()
    # Before the engine forks anything: spawned children start with default signals anyway
    # (nothing here ignores one); forked ones also get a parent-death signal.
    os.register_at_fork(after_in_child=_engine_child_setup(os.getpid()))
    os.environ.update(spec.engine.environment)
    configure_logging(spec.log_level, f"rank {spec.rank}")
    try:
        logger.info("[startup] constructing the %s engine", spec.backend_name)
        built = build_engine(spec, shared)
    except BaseException as exc:
        logger.error("engine construction failed: %s", exc)
        failure = RankFailed(spec.rank, f"{type(exc).__name__}: {exc}", traceback.format_exc())
        _report(spec, failure)
        _exit_rank(1, 0.0)
    # Only now are the API processes' sockets opened: DeepInfer forks its multimodal worker
    # during construction, and a forked child must not inherit them.
    links = ApiLinks(spec.api_addresses, spec.rank)
    exit_code = 0
    grace = 0.0
    watchdog = ChildWatchdog(built.children, lambda message: _fail_from_watchdog(spec, message))
    try:
        watchdog.start()
        links.send_all(_ready(spec, built))
        logger.info("[startup] ready")
        if built.after_ready is not None:
            built.after_ready(lambda: report(spec.api_addresses, spec.rank, GrammarWarm(spec.rank)))
        RankLoop(
            spec.rank, built.core, links, stop, spec.idle_wait_seconds, spec.heartbeat_seconds
        ).run()
        logger.info("[shutdown] closing the engine")
        watchdog.stop()
        built.core.close()
        grace = _CHILD_EXIT_GRACE_SECONDS
    except BaseException as exc:
        watchdog.stop()  # the children are killed on exit: that is no second failure
        exit_code = 1
        logger.error("engine failed: %s", exc)
        failure = RankFailed(spec.rank, f"{type(exc).__name__}: {exc}", traceback.format_exc())
        links.send_all(failure)
    finally:
        links.close()
    _exit_rank(exit_code, grace)
