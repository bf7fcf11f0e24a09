"""BackgroundRuns: this process's background responses (`services/background.py`), its lease
on them in the store, the sweep that marks the runs of dead processes `failed`, and what the
routes do with a run any process may hold: follow its events (`resume`) and `cancel` it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

from deepinfer_server.errors import StoreUnavailableError
from deepinfer_server.metrics import ServerMetrics
from deepinfer_server.services.background import (
    ACTIVE,
    TERMINAL_EVENTS,
    BackgroundRun,
    ResponseObject,
    event_number,
    failed_body,
    failed_event,
)
from deepinfer_server.store import ResponseStore
from deepinfer_server.store.lease import HEARTBEAT_INTERVAL, LEASE

logger = logging.getLogger(__name__)

#: Seconds between two sweeps for runs whose lease has passed.
SWEEP_INTERVAL = 5.0
#: Seconds between two reads of the store by a resumed stream another process runs.
RESUME_POLL = 0.05
#: Seconds a cancel waits for the run to end (another process acts at its next heartbeat).
CANCEL_WAIT = 3 * HEARTBEAT_INTERVAL + 2.0
#: Seconds the runs still going at shutdown (after the drain) may take to record their end.
STOP_WAIT = 5.0
LOST_MESSAGE = (
    "the server process generating this background response stopped (it did not renew its "
    "run for {lease:g}s); create it again"
)


class BackgroundRuns:
    """This process's background responses, its lease on them, and the sweep that marks the
    runs of dead processes (module docstring)."""

    def __init__(self, store: ResponseStore, metrics: ServerMetrics) -> None:
        self.store = store
        self.metrics = metrics
        #: This process in the store's `background_runs.owner`.
        self.owner = uuid.uuid4().hex
        self.runs: dict[str, BackgroundRun] = {}
        self._maintenance: asyncio.Task[None] | None = None
        metrics.watch_background(self.counts)

    def counts(self) -> dict[str, int]:
        """This process's runs by status (queued, in_progress)."""
        found = dict.fromkeys(ACTIVE, 0)
        for run in self.runs.values():
            if run.status in found:
                found[run.status] += 1
        return found

    def add(self, run: BackgroundRun) -> None:
        """Hold `run` (already stored) and make sure the heartbeat runs."""
        self.runs[run.response_id] = run
        self.start()

    def ended(self, run: BackgroundRun) -> None:
        """Let go of a run that recorded its end, and count it."""
        self.runs.pop(run.response_id, None)
        self.metrics.observe_background_end(run.status)

    def start(self) -> None:
        """Start the heartbeat and the sweep (once; at start-up, or with the first run)."""
        if self._maintenance is None:
            self._maintenance = asyncio.ensure_future(self._maintain())

    async def _maintain(self) -> None:
        last_sweep = 0.0
        while True:
            with contextlib.suppress(StoreUnavailableError):
                if self.runs:
                    await self.renew()
                if time.monotonic() - last_sweep >= SWEEP_INTERVAL:
                    last_sweep = time.monotonic()
                    await self.sweep()
            await asyncio.sleep(HEARTBEAT_INTERVAL)

    async def renew(self) -> None:
        """Renew this process's runs in the store, and cancel those asked to be cancelled
        and those no longer there (deleted, evicted, or taken for dead: nobody would see
        what they make)."""
        runs = list(self.runs.values())  # each stored before it was added
        await self.store.heartbeat(self.owner)
        owned = await self.store.runs_of(self.owner)
        for run in runs:
            if owned.get(run.response_id, True):
                run.cancel()

    async def sweep(self) -> None:
        """Mark failed every run whose process stopped renewing it."""
        for response_id, scope in await self.store.stale_runs(time.time() - LEASE):
            await self.mark_lost(scope, response_id)

    async def mark_lost(self, scope: str, response_id: str) -> ResponseObject | None:
        """Mark failed a run whose process stopped renewing it (unless another process did
        first, or it ended meanwhile); the response as it is now stored."""
        store = self.store
        if await store.claim_run(response_id, self.owner, stale_before=time.time() - LEASE):
            stored = await store.response(scope, response_id)
            if stored is not None and stored.body.get("status") in ACTIVE:
                body = failed_body(stored.body, LOST_MESSAGE.format(lease=LEASE))
                events = []
                last = await store.last_event(response_id)
                if last is not None:
                    number = last + 1
                    events.append((number, failed_event(body, number)))
                await store.finish_background(response_id, scope, body, events)
                logger.warning(
                    "background response %s: its process stopped; marked failed", response_id
                )
        stored = await store.response(scope, response_id)
        return None if stored is None else stored.body

    async def stop(self) -> None:
        """At shutdown, after the drain: stop every run still going (each ends `failed`,
        recorded within `STOP_WAIT`), then the heartbeat."""
        runs = list(self.runs.values())
        for run in runs:
            run.stop()
        if runs:
            await asyncio.wait(
                [asyncio.ensure_future(run.wait()) for run in runs], timeout=STOP_WAIT
            )
        if self._maintenance is not None:
            self._maintenance.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._maintenance
            self._maintenance = None


def lost(heartbeat_at: float | None) -> bool:
    """Whether a stored run's process stopped renewing it (None: no run, nothing lost)."""
    return heartbeat_at is not None and heartbeat_at < time.time() - LEASE


async def resume(
    runs: BackgroundRuns, scope: str, response_id: str, after: int
) -> AsyncIterator[str]:
    """A background response's event frames past sequence number `after`, to its end: from
    the run itself when this process runs it, else from the store (read every
    `RESUME_POLL` seconds while it runs)."""
    run = runs.runs.get(response_id)
    if run is not None:
        async for frame in run.follow(after):
            yield frame
        return
    store = runs.store
    while True:
        events = await store.events_after(response_id, after)
        for number, frame in events:
            yield frame
            after = number
            if event_number(frame)[1] in TERMINAL_EVENTS:
                return
        if events:
            continue
        stored = await store.response(scope, response_id)
        if stored is None or stored.body.get("status") not in ACTIVE:
            # Its end and last events are written in one transaction: read them once more.
            for _, frame in await store.events_after(response_id, after):
                yield frame
            return
        if lost(stored.heartbeat_at):
            await runs.mark_lost(scope, response_id)
            continue
        await asyncio.sleep(RESUME_POLL)


async def cancel(runs: BackgroundRuns, scope: str, response_id: str) -> ResponseObject | None:
    """Cancel a background response that is still running; the response as it is then (a
    finished one unchanged). None when it is not stored for this scope."""
    store = runs.store
    run = runs.runs.get(response_id)
    if run is not None and run.scope == scope:
        run.cancel()
        await run.wait()
        return run.body
    stored = await store.response(scope, response_id)
    if stored is None or stored.body.get("status") not in ACTIVE:
        return None if stored is None else stored.body
    if lost(stored.heartbeat_at):
        return await runs.mark_lost(scope, response_id)
    await store.request_cancel(response_id)
    deadline = time.monotonic() + CANCEL_WAIT
    while time.monotonic() < deadline:
        await asyncio.sleep(RESUME_POLL)
        stored = await store.response(scope, response_id)
        if stored is None or stored.body.get("status") not in ACTIVE:
            break
    return None if stored is None else stored.body
