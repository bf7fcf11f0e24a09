"""The rank process body: build the engine, report ready, run the loop, close together.

`run_rank` is the spawn target; it is the only code that runs in a rank process. Engine
modules are imported here, inside the child, never in the API process.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import traceback
from multiprocessing.process import BaseProcess

import zmq

from deepinfer_server.ipc.lockstep import LockstepGroup
from deepinfer_server.ipc.messages import RankFailed, RankReady, from_rank_encoder
from deepinfer_server.rank.adapter import EngineAdapter
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


def build_engine(
    spec: RankSpec, lockstep: LockstepGroup
) -> tuple[EngineAdapter, list[BaseProcess]]:
    """Construct this rank's engine (the only difference between the two engine kinds).

    Returns the adapter and the child processes the engine started, for the watchdog.
    """
    if spec.engine == "simulated":
        from deepinfer_server.engines.simulated.engine import LLMEngine, SimEngineArgs
        from deepinfer_server.engines.simulated.outputs import RequestOutput
        from deepinfer_server.tokenizer import load_tokenizer_json

        args = SimEngineArgs(
            tokenizer_json=load_tokenizer_json(spec.model),
            lockstep=lockstep,
            engine_rank=spec.rank,
            data_parallel_size=spec.data_parallel_size,
            max_model_len=spec.max_model_len,
            max_num_seqs=spec.max_num_seqs,
            max_num_batched_tokens=spec.max_num_batched_tokens,
            ttft_ms=spec.sim_ttft_ms,
            itl_ms=spec.sim_itl_ms,
            tokens_per_step=spec.sim_tokens_per_step,
            zero_overhead_scheduling=spec.sim_zero_overhead_scheduling,
            fault=spec.sim_fault,
            fault_after_steps=spec.sim_fault_after_steps,
        )
        return EngineAdapter(LLMEngine.from_engine_args(args), RequestOutput), []
    from deepinfer_server.engines.deepinfer import build_deepinfer_engine

    return build_deepinfer_engine(spec)


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


def run_rank(spec: RankSpec, lockstep: LockstepGroup) -> None:
    """Spawn target of DP rank `spec.rank`."""
    _die_with_parent()
    # Signals sent to the whole process group (Ctrl-C, `kill -TERM -PGID`) are the API
    # process's to handle: it stops the ranks together, then kills what is left.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.environ.update(spec.environment)
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
        logger.info("[startup] constructing the %s engine", spec.engine)
        adapter, children = build_engine(spec, lockstep)
        watchdog = ChildWatchdog(children, lambda message: _fail_from_watchdog(spec, message))
        watchdog.start()
        outbox.send(from_rank_encoder.encode(RankReady(spec.rank, os.getpid())))
        logger.info("[startup] ready")
        RankLoop(spec.rank, adapter, inbox, outbox, lockstep, spec.idle_wait_seconds).run()
        logger.info("[shutdown] closing the engine")
        watchdog.stop()
        adapter.close()
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
