"""Pulls: a decode engine's KV pulls, run off the lockstep loop.

A pull reads a prompt's KV blocks and state from a prefill rank into blocks and a state slot
the decode engine reserved, checks them, and tells the prefill rank it may free them (a
release on its bootstrap port, sent whatever the outcome: a failed or abandoned pull will not
be retried). The engine's thread submits pulls and takes the finished ones at each step, so a
slow peer never holds up the rank's other decodes; each peer's pulls run on that peer's own
threads (`lanes`), so a hung peer never holds up the other peers' pulls either.

A pull that has started cannot be stopped: Mooncake's `batch_transfer_sync_read` returns only
when the peer answers or its connection fails, and a peer that was stopped and resumes sends
the KV then, into the blocks the read named. So the engine gives up on a late request at once,
but keeps the blocks of a started pull reserved (quarantined) until its read returns; a pull
still queued on its peer's lane is cancelled and its blocks are free at once (`abandon`).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from deepinfer_server.disaggregation.handoff.bootstrap import bootstrap_call, release
from deepinfer_server.disaggregation.handoff.params import KVTransferParams
from deepinfer_server.disaggregation.transfer.agent import TransferAgent, TransferError
from deepinfer_server.disaggregation.transfer.lanes import PULL_THREADS_PER_PEER, PeerLanes
from deepinfer_server.disaggregation.transfer.queues import drain

logger = logging.getLogger(__name__)

#: Seconds a peer not read from yet has to answer a ping on its bootstrap port first (the ping
#: waits on the peer's own lane, never on the engine: a busy prefill rank's answer may take
#: more than a second on a loaded node, and one failed first contact fails a request).
FIRST_CONTACT_TIMEOUT = 3.0


@dataclass
class PullResult:
    """One finished pull: the bytes moved and its time, or why it failed."""

    request_id: str
    nbytes: int
    seconds: float
    failure: TransferError | None = None
    #: The peer pulled from (its transfer engine's `host:port`).
    peer: str = ""


@dataclass(frozen=True)
class _Pull:
    """One pull to run: into what, from where, and the check of what arrived."""

    request_id: str
    params: KVTransferParams
    pieces: list[tuple[int, int, int]]
    check: Callable[[], None]


@dataclass(frozen=True)
class _Submitted:
    """A pull handed to its peer's lane: where from, and its future (cancellable until its
    thread takes it)."""

    peer: str
    params: KVTransferParams
    future: Future[None]


def peer_of(params: KVTransferParams) -> str:
    """The transfer engine a handoff's KV is read from, as `host:port`."""
    return f"{params.remote_host}:{params.remote_port}"


def _unhealthy(peer: str) -> TransferError:
    return TransferError(
        "peer_unhealthy", f"a KV pull from {peer} outlived the transfer timeout recently"
    )


def _first_contact(params: KVTransferParams) -> None:
    """Ping the prefill rank before the first read from it: the transfer library opens a new
    peer under its one engine-wide lock, so opening a stalled one would hold up every read from
    every peer until it answered. Raises TransferError when it does not answer."""
    # The holding rank's own port (each rank reports the one it bound).
    port = params.remote_bootstrap_port
    try:
        bootstrap_call(params.remote_host, port, {"op": "ping"}, FIRST_CONTACT_TIMEOUT)
    except OSError as exc:
        raise TransferError(
            "transfer_error",
            f"the prefill rank at {params.remote_host}:{port} did not answer: {exc}",
        ) from exc


class Pulls:
    """The transfer threads of each peer (`lanes`) and the queue of their results."""

    def __init__(
        self,
        agent: TransferAgent,
        threads_per_peer: int = PULL_THREADS_PER_PEER,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._agent = agent
        self._clock = clock
        self._lanes = PeerLanes(threads_per_peer)
        self._done: queue.SimpleQueue[PullResult] = queue.SimpleQueue()
        #: The pulls not yet taken as done, by request ID.
        self._running: dict[str, _Submitted] = {}
        #: Peers whose last read succeeded (set and cleared by the lanes' threads).
        self._known: set[str] = set()

    def healthy(self, params: KVTransferParams) -> bool:
        """Whether a pull from `params`' peer may start (False: it is sick, fail at once)."""
        return not self._lanes.sick(peer_of(params), self._clock())

    def submit(
        self,
        request_id: str,
        params: KVTransferParams,
        pieces: Sequence[tuple[int, int, int]],
        check: Callable[[], None],
    ) -> None:
        """Start pulling `pieces` (local, remote, length) from `params`' peer; `check` runs
        after the read and raises TransferError when the KV is not what was promised. A sick
        peer's pull fails at once."""
        peer = peer_of(params)
        if self._lanes.sick(peer, self._clock()):
            self._done.put(PullResult(request_id, 0, 0.0, _unhealthy(peer), peer))
            self.release_only(params)
            return
        lane = self._lanes.lane(peer, self._clock())
        pull = _Pull(request_id, params, list(pieces), check)
        self._running[request_id] = _Submitted(peer, params, lane.pulls.submit(self._run, pull))
        lane.requests.add(request_id)

    def abandon(self, request_id: str, timed_out: bool = False) -> bool:
        """The request of a submitted pull ended. True: the pull had not started and never
        will (its blocks are free now; the caller sends the release). False: its read is
        running, so its blocks stay reserved until its result comes back. A pull that
        `timed_out` (running, or still queued behind its peer's other pulls) makes its peer
        sick, and the other pulls queued on that peer fail at once ("peer_unhealthy")."""
        submitted = self._running.get(request_id)
        if submitted is None or submitted.future.done():
            return False  # its result is queued: the caller frees on taking it
        if timed_out:  # started late or never: either way its peer did not keep up
            self._lanes.mark_sick(submitted.peer, self._clock())
            self._fail_queued(submitted.peer, request_id)
        if submitted.future.cancel():
            self._forget(request_id, submitted.peer)
            return True
        return False

    def release_only(self, params: KVTransferParams) -> None:
        """The request went away before its pull: free the prefill side's KV now."""
        self._lanes.lane(peer_of(params), self._clock()).releases.submit(release, params)

    def take_done(self) -> list[PullResult]:
        """The pulls that finished since the last call."""
        results = drain(self._done)
        for result in results:
            if result.request_id in self._running:
                self._forget(result.request_id, result.peer)
            if result.failure is None:
                self._lanes.mark_well(result.peer)
        for peer in self._lanes.prune(self._clock()):
            self._known.discard(peer)  # a peer back after its lane closed is pinged again
        return results

    def peers(self) -> set[str]:
        """The peers with transfer threads now."""
        return self._lanes.peers()

    def close(self) -> None:
        """Stop every peer's threads (reads under way return on their own)."""
        self._lanes.close()

    def _forget(self, request_id: str, peer: str) -> None:
        del self._running[request_id]
        self._lanes.lane(peer, self._clock()).requests.discard(request_id)

    def _fail_queued(self, peer: str, keep: str) -> None:
        """Cancel the pulls queued on `peer`'s lane, each reported as failed now (and its
        release sent, as a pull's thread would)."""
        for request_id in list(self._lanes.lane(peer, self._clock()).requests - {keep}):
            submitted = self._running[request_id]
            if submitted.future.cancel():
                self._forget(request_id, peer)
                self._done.put(PullResult(request_id, 0, 0.0, _unhealthy(peer), peer))
                self.release_only(submitted.params)

    def _run(self, pull: _Pull) -> None:
        request_id, params = pull.request_id, pull.params
        started = time.monotonic()
        session = peer_of(params)
        try:
            if session not in self._known:
                _first_contact(params)
            nbytes = self._agent.read(session, pull.pieces)
            self._known.add(session)
            pull.check()
            result = PullResult(request_id, nbytes, time.monotonic() - started, peer=session)
        except TransferError as exc:
            self._known.discard(session)
            result = PullResult(request_id, 0, time.monotonic() - started, exc, session)
        except Exception as exc:  # the library's own errors: the request fails, not the rank
            self._known.discard(session)
            logger.exception("KV pull for request %s failed", request_id)
            failure = TransferError("transfer_error", str(exc))
            result = PullResult(request_id, 0, time.monotonic() - started, failure, session)
        self._done.put(result)
        release(params)
