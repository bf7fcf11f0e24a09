"""The rank process body: build the engine, report ready, run the loop, close together.

`run_rank` is the spawn target; it is the only code that runs in a rank process. The engine
module is imported here, inside the child, from the backend's `builder` path: the API process
never imports an engine implementation.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable

import zmq

from deepinfer_server.engines.backend import BuiltEngine, EngineSpec, SharedState
from deepinfer_server.ipc.messages import RankFailed, RankReady, from_rank_encoder
from deepinfer_server.ipc.stop_agreement import StopAgreement
from deepinfer_server.rank.child_watch import ChildWatchdog, exit_rank_process
from deepinfer_server.rank.loop import RankLoop
from deepinfer_server.rank.spec import RankSpec

logger = logging.getLogger("deepinfer_server.rank")

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the API process dies, so no rank is orphaned."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def build_engine(spec: RankSpec, shared: SharedState | None) -> BuiltEngine:
    """Import the backend's builder (here, in the rank process) and construct the engine."""
    module_name, _, function_name = spec.builder.partition(":")
    builder: Callable[[EngineSpec, SharedState | None], BuiltEngine] = getattr(
        importlib.import_module(module_name), function_name
    )
    return builder(spec.engine, shared)


def _fail_from_watchdog(spec: RankSpec, message: str) -> None:
    """Report a dead engine child, then end the process (called on the watchdog thread).

    A context of its own: sockets are not thread-safe, and `term()` blocks until the report
    is delivered, which must happen before `os._exit`.
    """
    context = zmq.Context()
    socket = context.socket(zmq.PUSH)
    socket.setsockopt(zmq.LINGER, 2000)
    socket.connect(spec.outbox_address)
    socket.send(from_rank_encoder.encode(RankFailed(spec.rank, message, "")))
    socket.close()
    context.term()
    exit_rank_process(1)


def run_rank(spec: RankSpec, stop: StopAgreement, shared: SharedState | None) -> None:
    """Spawn target of DP rank `spec.rank`."""
    _die_with_parent()
    # Signals sent to the whole process group (Ctrl-C, `kill -TERM -PGID`) are the API
    # process's to handle: it stops the ranks together, then kills what is left.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.environ.update(spec.engine.environment)
    logging.basicConfig(
        level=spec.log_level.upper(),
        format=f"%(asctime)s %(levelname)s [rank {spec.rank}] %(name)s: %(message)s",
    )
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.connect(spec.inbox_address)
    outbox = context.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 5000)
    outbox.connect(spec.outbox_address)
    exit_code = 0
    try:
        logger.info("[startup] constructing the %s engine", spec.backend_name)
        built = build_engine(spec, shared)
        watchdog = ChildWatchdog(built.children, lambda message: _fail_from_watchdog(spec, message))
        watchdog.start()
        outbox.send(from_rank_encoder.encode(RankReady(spec.rank, os.getpid())))
        logger.info("[startup] ready")
        RankLoop(spec.rank, built.core, inbox, outbox, stop, spec.idle_wait_seconds).run()
        logger.info("[shutdown] closing the engine")
        watchdog.stop()
        built.core.close()
    except BaseException as exc:
        exit_code = 1
        logger.error("engine failed: %s", exc)
        failure = RankFailed(spec.rank, f"{type(exc).__name__}: {exc}", traceback.format_exc())
        outbox.send(from_rank_encoder.encode(failure))
    finally:
        inbox.close(linger=0)
        outbox.close()
        context.term()
    sys.exit(exit_code)
