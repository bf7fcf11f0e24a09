"""Pulls: a decode engine's KV pulls, run off the lockstep loop.

A pull reads a prompt's KV blocks and state from a prefill rank into blocks and a state slot
the decode engine reserved, checks them, and tells the prefill rank it may free them (a
release on its bootstrap port, sent whatever the outcome: a failed or abandoned pull will not
be retried). The engine's thread submits pulls and takes the finished ones at each step, so a
slow peer never holds up the rank's other decodes.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from deepinfer_server.disaggregation.handoff.bootstrap import bootstrap_call
from deepinfer_server.disaggregation.handoff.params import KVTransferParams
from deepinfer_server.disaggregation.transfer.agent import TransferAgent, TransferError
from deepinfer_server.disaggregation.transfer.queues import drain

logger = logging.getLogger(__name__)

#: Seconds a release notice may take; a prefill side that misses it frees on its timeout.
RELEASE_TIMEOUT = 2.0


@dataclass
class PullResult:
    """One finished pull: the bytes moved and its time, or why it failed."""

    request_id: str
    nbytes: int
    seconds: float
    failure: TransferError | None = None


@dataclass(frozen=True)
class _Pull:
    """One pull to run: into what, from where, and the check of what arrived."""

    request_id: str
    params: KVTransferParams
    pieces: list[tuple[int, int, int]]
    check: Callable[[], None]


def release(params: KVTransferParams) -> None:
    """Tell the prefill rank of `params` it may free that transfer's KV (best effort)."""
    try:
        bootstrap_call(
            params.remote_host,
            params.remote_bootstrap_port,
            {"op": "release", "transfer_id": params.transfer_id, "proof": params.release_proof},
            RELEASE_TIMEOUT,
        )
    except OSError as exc:
        logger.info("release of transfer %s not delivered: %s", params.transfer_id, exc)


class Pulls:
    """A small pool of transfer threads and the queue of their results."""

    def __init__(self, agent: TransferAgent, workers: int = 4) -> None:
        self._agent = agent
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kv-pull")
        self._done: queue.SimpleQueue[PullResult] = queue.SimpleQueue()

    def submit(
        self,
        request_id: str,
        params: KVTransferParams,
        pieces: Sequence[tuple[int, int, int]],
        check: Callable[[], None],
    ) -> None:
        """Start pulling `pieces` (local, remote, length) from `params`' peer; `check` runs
        after the read and raises TransferError when the KV is not what was promised."""
        self._pool.submit(self._run, _Pull(request_id, params, list(pieces), check))

    def release_only(self, params: KVTransferParams) -> None:
        """The request went away before its pull: free the prefill side's KV now."""
        self._pool.submit(release, params)

    def take_done(self) -> list[PullResult]:
        """The pulls that finished since the last call."""
        return drain(self._done)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, pull: _Pull) -> None:
        request_id, params = pull.request_id, pull.params
        started = time.monotonic()
        session = f"{params.remote_host}:{params.remote_port}"
        try:
            nbytes = self._agent.read(session, pull.pieces)
            pull.check()
            result = PullResult(request_id, nbytes, time.monotonic() - started)
        except TransferError as exc:
            result = PullResult(request_id, 0, time.monotonic() - started, exc)
        except Exception as exc:  # the library's own errors: the request fails, not the rank
            logger.exception("KV pull for request %s failed", request_id)
            result = PullResult(
                request_id, 0, time.monotonic() - started, TransferError("transfer_error", str(exc))
            )
        self._done.put(result)
        release(params)
