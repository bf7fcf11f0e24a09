"""RankLoop: the lockstep loop of one DP rank. No asyncio; the loop's thread owns the engine.

Each iteration, on every rank:
  1. stop here if the ranks agreed to stop at this iteration (StopAgreement.should_stop);
  2. take every pending message (new requests, aborts, wake-ups); when the last round was idle
     everywhere, first wait for one, at most `idle_wait` seconds;
  3. `EngineCore.iterate()`: for DeepInfer-contract engines `has_unfinished_requests()` (a
     collective over the DP ranks), then `step()` if any rank has work, else
     `flush_inflight_reqs()`;
  4. send one StepOutputs message with every request's new tokens (and the KV usage and
     prefix-cache counters after the iteration); with several API server
     processes (`--api-server-count`), one to each, carrying the deltas of the requests it sent
     (every process sees every step report: its liveness watch and step metrics need them);
     when there was nothing to report for `heartbeat` seconds, a RankAlive to every process
     instead (the liveness watch times the loop itself, busy or idle).
Because step 3's collective gives every rank the same answer in the same round, all ranks call
the same engine methods the same number of times; nothing else is needed to keep lockstep.
"""

from __future__ import annotations

import logging
import time

from deepinfer_server.engines.backend import EngineCore
from deepinfer_server.ipc.messages import (
    AbortRequests,
    AddRequest,
    EngineCounters,
    PrefixCacheStats,
    RankAlive,
    RequestDelta,
    StepOutputs,
    to_rank_decoder,
)
from deepinfer_server.ipc.stop_agreement import StopAgreement
from deepinfer_server.rank.links import ApiLinks

logger = logging.getLogger(__name__)

#: How often the loop logs a step-timing summary at debug level.
_SUMMARY_SECONDS = 10.0


class RankLoop:
    """Runs `EngineCore.iterate()` in lockstep with the other ranks until told to stop."""

    def __init__(
        self,
        rank: int,
        core: EngineCore,
        links: ApiLinks,
        stop: StopAgreement,
        idle_wait: float,
        heartbeat: float = 1.0,
    ) -> None:
        self._rank = rank
        self._core = core
        self._links = links
        self._stop = stop
        self._idle_wait_ms = max(1, int(idle_wait * 1000))
        self._heartbeat = heartbeat
        #: Which API process each live request came from; None with one API process.
        self._clients: dict[str, int] | None = {} if links.count > 1 else None

    def run(self) -> None:
        """Loop until the stop agreement ends it; engine exceptions propagate to the caller."""
        iteration = 0
        idle = True
        summary = _StepSummary(self._rank)
        reported_usage: float | None = None
        reported_cache: PrefixCacheStats | None = None
        last_sent = time.perf_counter()
        while not self._stop.should_stop(iteration):
            self._take_messages(wait=idle)
            started = time.perf_counter()
            unfinished, deltas = self._core.iterate()
            elapsed = time.perf_counter() - started
            if unfinished:
                summary.add(elapsed, started)
            usage = self._core.kv_cache_usage()
            cache = self._core.prefix_cache_stats()
            counters = self._core.counters()
            # An abort while idle frees KV blocks without a step: report that too (and a
            # cache that changed in a flush, or a held prompt's KV freed).
            changed = usage != reported_usage or cache != reported_cache or counters is not None
            if deltas or unfinished or changed:
                self._publish(deltas, elapsed, usage, cache, counters)
                reported_usage = usage
                reported_cache = cache
                last_sent = started + elapsed
            elif started + elapsed - last_sent >= self._heartbeat:
                self._links.send_all(RankAlive(self._rank))
                last_sent = started + elapsed
            idle = not unfinished
            iteration += 1

    def _publish(
        self,
        deltas: list[RequestDelta],
        elapsed: float,
        usage: float | None,
        cache: PrefixCacheStats | None,
        counters: EngineCounters | None,
    ) -> None:
        clients = self._clients
        if clients is None:
            self._links.send(0, StepOutputs(self._rank, deltas, elapsed, usage, cache, counters))
            return
        routed: list[list[RequestDelta]] = [[] for _ in range(self._links.count)]
        for delta in deltas:
            client = clients.get(delta.request_id)
            if client is None:
                continue
            if delta.finish is not None:
                del clients[delta.request_id]
            routed[client].append(delta)
        for client, client_deltas in enumerate(routed):
            self._links.send(
                client, StepOutputs(self._rank, client_deltas, elapsed, usage, cache, counters)
            )

    def _take_messages(self, wait: bool) -> None:
        if wait and not self._links.wait(self._idle_wait_ms):
            return
        for payload in self._links.receive():
            self._apply(payload)

    def _apply(self, payload: bytes) -> None:
        message = to_rank_decoder.decode(payload)
        if isinstance(message, AddRequest):
            rejection = self._core.add(message)
            if rejection is not None:
                self._links.send(message.client, rejection)
            elif self._clients is not None:
                self._clients[message.request_id] = message.client
        elif isinstance(message, AbortRequests):
            self._core.abort(message.request_ids)
            if self._clients is not None:
                for request_id in message.request_ids:
                    self._clients.pop(request_id, None)
        # Wake and Shutdown only end the idle wait; the stop itself comes from the agreement.


class _StepSummary:
    """Debug-level step statistics, logged every `_SUMMARY_SECONDS` while the rank steps."""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._enabled = logger.isEnabledFor(logging.DEBUG)
        self._since = time.perf_counter()
        self._steps = 0
        self._seconds = 0.0

    def add(self, seconds: float, now: float) -> None:
        if not self._enabled:
            return
        self._steps += 1
        self._seconds += seconds
        window = now - self._since
        if window >= _SUMMARY_SECONDS:
            logger.debug(
                "DP rank %d: %d steps in %.1fs, mean %.2f ms, busy %.0f%%",
                self._rank,
                self._steps,
                window,
                1000 * self._seconds / self._steps,
                100 * self._seconds / window,
            )
            self._since, self._steps, self._seconds = now, 0, 0.0
