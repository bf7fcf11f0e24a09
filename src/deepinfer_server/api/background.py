"""Background responses (`background: true` on `POST /v1/responses`): work that outlives its
connection.

The POST stores the response at once (`status: "queued"`, its input items) and answers with it;
with `stream: true` it streams the events as they come, and the client may leave at any time
without stopping the generation. The generation runs in the API server process that took the
POST, as a `BackgroundRun` that holds the request's admission slot (at the lowest `priority`)
until it ends. Its status goes `queued` → `in_progress` (the engine took it) → `completed`,
`incomplete`, `failed` or `cancelled`; every change is written to the store, so a
`GET /v1/responses/{id}` from any API server process (or replica, on PostgreSQL) sees it.

A streamed run's events (each with its `sequence_number`) are written to the store as they
come: one transaction per write, taking every event that came while the previous write ran, so a
busy store batches more rather than falling behind. A stream shows an event once it is stored
(the store's commit comes before the client's copy), so whatever a client saw can be resumed,
even after a kill -9. `GET ...?stream=true&starting_after=N`
replays the stored events past N and follows the rest: from memory in the process that runs it,
else by reading the store every `RESUME_POLL` seconds, until the terminal event.

The run dies with its process. Each process renews its runs' lease in the store every
`HEARTBEAT_INTERVAL` seconds; a run not renewed for `LEASE` seconds (its process was killed) is
marked `failed` (`server_error`, with a reason and a `response.failed` event for streams) by the
first process that sees it: a GET of it, or the sweep every process makes every
`SWEEP_INTERVAL` seconds.
A server that stops gracefully lets running background responses finish during its drain
(`--shutdown-timeout`), then marks those left `failed` before it exits. Cancelling (`POST
/v1/responses/{id}/cancel`) aborts the engine request and frees its slot; in another process it
is asked for through the store and acted on at that process's next heartbeat.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import orjson

from deepinfer_server.api.error_responses import as_api_error
from deepinfer_server.api.token_stream import ProtocolOutput, TokenStream
from deepinfer_server.errors import ShuttingDownError, StoreUnavailableError
from deepinfer_server.ipc.messages import Finish, GeneratedTokens
from deepinfer_server.metrics import ServerMetrics
from deepinfer_server.protocol.core.named_events import named_event
from deepinfer_server.protocol.responses.stored import storable_response
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

ACTIVE = frozenset({"queued", "in_progress"})
TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})
SHUTDOWN_MESSAGE = "the server stopped while generating this background response; create it again"
LOST_MESSAGE = (
    "the server process generating this background response stopped (it did not renew its "
    "run for {lease:g}s); create it again"
)


def event_number(frame: str) -> tuple[int, str]:
    """A streamed event's sequence number and type, read from its SSE frame."""
    event = orjson.loads(frame.split("data: ", 1)[1])
    return int(event["sequence_number"]), str(event["type"])


def failed_body(body: dict[str, Any], message: str, code: str = "server_error") -> dict[str, Any]:
    """The response object of a run that failed."""
    return {**body, "status": "failed", "error": {"code": code, "message": message}}


def created_event(body: dict[str, Any]) -> str:
    """A stream's first event, `response.created` with the response as it is (queued)."""
    event = {"type": "response.created", "response": body, "sequence_number": 0}
    return named_event("response.created", orjson.dumps(event).decode())


def failed_event(body: dict[str, Any], number: int) -> str:
    """The `response.failed` event that ends the stream of a run that failed."""
    event = {"type": "response.failed", "response": body, "sequence_number": number}
    return named_event("response.failed", orjson.dumps(event).decode())


class _Watched:
    """A protocol output that says when the engine took the request (its opening)."""

    def __init__(self, output: ProtocolOutput, on_start: Callable[[], None]) -> None:
        self._output = output
        self._on_start = on_start

    @property
    def finished(self) -> bool:
        return self._output.finished

    @property
    def client_finish_reason(self) -> str | None:
        return self._output.client_finish_reason

    def start(self, cached_tokens: int = 0) -> list[str]:
        self._on_start()
        return self._output.start(cached_tokens)

    def push(self, tokens: GeneratedTokens) -> list[str]:
        return self._output.push(tokens)

    def finish(self, finish: Finish) -> list[str]:
        return self._output.finish(finish)

    def close(self) -> None:
        self._output.close()

    def response_json(self) -> bytes:
        return self._output.response_json()


class ResponsesRun(ProtocolOutput, Protocol):
    """What a run reads of its Responses output besides the `ProtocolOutput`."""

    held: list[str]
    final: dict[str, Any] | None

    def response(self) -> dict[str, Any]: ...


class BackgroundRun:
    """One background response generating in this process (module docstring)."""

    def __init__(
        self,
        runs: BackgroundRuns,
        response_id: str,
        scope: str,
        body: dict[str, Any],
        streaming: bool,
        opening: list[str] | None = None,
        before_end: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
    ) -> None:
        """`opening`: the first event frames of a stream, already stored; `before_end`: what
        is done with the final response before its end is stored (a conversation's turn is
        appended, so that whoever sees the end finds it there)."""
        self._before_end = before_end
        self._runs = runs
        self.response_id = response_id
        self.scope = scope
        #: The response object as last stored (its status).
        self.body = body
        self.streaming = streaming
        #: The streamed events so far: sequence numbers and SSE frames, in order.
        self._frames: list[str] = list(opening or [])
        self._numbers: list[int] = [event_number(frame)[0] for frame in self._frames]
        #: How many of them are in the store: a stream shows no event before it is stored,
        #: so whatever a client saw can be resumed after a kill.
        self._stored = len(self._frames)
        self._changed = asyncio.Event()
        self.done = False
        self.cancelled = False
        self._unwritten: list[tuple[int, str]] = []
        self._unwritten_body: dict[str, Any] | None = None
        self._writing: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._running = False
        self._stopping = False

    @property
    def status(self) -> str:
        return str(self.body.get("status"))

    def start(self, stream: TokenStream, output: ResponsesRun) -> None:
        """Generate `stream` (made on `watch(output)`) detached from the request."""
        self._task = asyncio.ensure_future(self._main(stream, output))

    def watch(self, output: ProtocolOutput) -> ProtocolOutput:
        """The output to generate into, which marks the run `in_progress` when it starts."""
        return _Watched(output, self._started)

    def _started(self) -> None:
        if self.status == "queued":
            self._set_body({**self.body, "status": "in_progress"})

    def _set_body(self, body: dict[str, Any]) -> None:
        self.body = body
        self._unwritten_body = body
        self._write_behind()

    def on_payloads(self, payloads: list[str]) -> None:
        """The sink of the run's token stream: each payload is one event's SSE frame (an event
        numbered like one it has already, the output's `response.created` after the run's own
        queued one, is left out)."""
        for frame in payloads:
            number, kind = event_number(frame)
            if self._numbers and number <= self._numbers[-1]:
                continue
            self._numbers.append(number)
            self._frames.append(frame)
            self._unwritten.append((number, frame))
            if kind in ("response.created", "response.in_progress"):
                response = orjson.loads(frame.split("data: ", 1)[1])["response"]
                if self.status != response.get("status"):
                    self.body = response
                    self._unwritten_body = response
        self._write_behind()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _write_behind(self) -> None:
        if self._writing is None or self._writing.done():
            self._writing = asyncio.ensure_future(self._write_progress())

    async def _write_progress(self) -> None:
        """Write what the run has not written yet, until nothing is left (a failed write is
        retried by the next one, or by the run's end)."""
        store = self._runs.store
        while self._unwritten or self._unwritten_body is not None:
            events, body = self._unwritten, self._unwritten_body
            self._unwritten, self._unwritten_body = [], None
            try:
                await store.record_progress(self.response_id, body, events)
            except StoreUnavailableError:
                self._unwritten = events + self._unwritten
                if self._unwritten_body is None:
                    self._unwritten_body = body
                return
            self._stored = len(self._frames) - len(self._unwritten)
            self._notify()

    async def wait_written(self) -> None:
        """Until what the run has made so far is in the store."""
        while self._writing is not None and not self._writing.done():
            await asyncio.shield(self._writing)

    async def _main(self, stream: TokenStream, output: ResponsesRun) -> None:
        closing: list[str] = []
        self._running = True
        try:
            if self.cancelled or self._stopping:  # before the task first ran
                stream.abandon()
                raise asyncio.CancelledError
            await stream.run(self.on_payloads)
            if self.streaming:
                final = output.final if output.final is not None else output.response()
                closing = output.held
            else:
                final = output.response()
        except asyncio.CancelledError:
            if self.cancelled:
                final = {**self.body, "status": "cancelled"}
            else:
                final = failed_body(self.body, SHUTDOWN_MESSAGE)
                closing = self._failure_events(final)
        except Exception as exc:  # the request's error, as the response's
            error = as_api_error(exc, self.response_id)
            message = SHUTDOWN_MESSAGE if isinstance(exc, ShuttingDownError) else error.message
            # OpenAI's codes of a failed response: the prompt's fault, or the server's.
            code = "invalid_prompt" if error.status_code < 500 else "server_error"
            final = failed_body(self.body, message, code)
            closing = self._failure_events(final)
        self._running = False  # the generation is over: recording its end is not interrupted
        await self._finish(final, closing)

    def _failure_events(self, body: dict[str, Any]) -> list[str]:
        if not self.streaming:
            return []
        return [failed_event(body, self._numbers[-1] + 1 if self._numbers else 0)]

    async def _finish(self, final: dict[str, Any], closing: list[str]) -> None:
        if self._writing is not None:
            with contextlib.suppress(Exception):
                await self._writing
        events = [*self._unwritten, *((event_number(frame)[0], frame) for frame in closing)]
        self._unwritten, self._unwritten_body = [], None
        store = self._runs.store
        if self._before_end is not None:
            try:
                await self._before_end(final)
            except StoreUnavailableError:
                logger.warning(
                    "background response %s: its conversation was not updated", self.response_id
                )
        try:
            if await store.claim_run(self.response_id, self._runs.owner, stale_before=0.0):
                stored = storable_response(final)  # reasoning blobs are sealed per GET
                await store.finish_background(self.response_id, self.scope, stored, events)
        except StoreUnavailableError:
            logger.warning(
                "background response %s ended (%s) but its end was not stored",
                self.response_id,
                final.get("status"),
            )
        finally:
            for number, frame in events[len(events) - len(closing) :]:
                self._numbers.append(number)
                self._frames.append(frame)
            self.body = final
            self.done = True
            self._notify()
            self._runs.ended(self)

    def cancel(self) -> None:
        """Stop the generation (its slot is freed); the run ends `cancelled`."""
        if not self.done and not self.cancelled:
            self.cancelled = True
            self._interrupt()

    def stop(self) -> None:
        """Stop the generation for a shutdown (the run ends `failed`)."""
        if not self.done and not self._stopping:
            self._stopping = True
            self._interrupt()

    def _interrupt(self) -> None:
        # A task cancelled before it first ran never enters its body: it sees the flags then.
        if self._task is not None and self._running:
            self._task.cancel()

    async def wait(self) -> None:
        """Until the run has ended and recorded its end."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def follow(self, after: int) -> AsyncIterator[str]:
        """The run's event frames past sequence number `after`, as they come, to its end."""
        index = bisect.bisect_right(self._numbers, after)
        while True:
            changed = self._changed
            # Once the run is done, its end is stored or will never be: everything goes out.
            shown = len(self._frames) if self.done else self._stored
            while index < shown:
                yield self._frames[index]
                index += 1
            if self.done and index == len(self._frames):
                return
            await changed.wait()


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
        self.runs[run.response_id] = run
        self.start()

    def ended(self, run: BackgroundRun) -> None:
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

    async def mark_lost(self, scope: str, response_id: str) -> dict[str, Any] | None:
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


async def cancel(runs: BackgroundRuns, scope: str, response_id: str) -> dict[str, Any] | None:
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
