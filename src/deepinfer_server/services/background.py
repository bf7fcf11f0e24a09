"""Background responses (`background: true` on `POST /v1/responses`): work that outlives its
connection.

The POST stores the response at once (`status: "queued"`, its input items) and answers with it;
with `stream: true` it streams the events as they come, and the client may leave at any time
without stopping the generation. The generation runs in the API server process that took the
POST, as a `BackgroundRun` that holds the request's admission slot (at the lowest `priority`,
within its key's share of the queue: a flood of them is a 429 to that key alone) until it
ends. Its status goes `queued` → `in_progress` (the engine took it) → `completed`,
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
`HEARTBEAT_INTERVAL` seconds (`services/background_runs.py`: the process's runs, their lease,
the sweep, resuming and cancelling); a run not renewed for `LEASE` seconds (its process was
killed) is marked `failed` (`server_error`, with a reason and a `response.failed` event for
streams) by the first process that sees it: a GET of it, or the sweep every process makes every
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
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import orjson

from deepinfer_server.errors import ShuttingDownError, StoreUnavailableError
from deepinfer_server.ipc.messages import Finish, GeneratedTokens
from deepinfer_server.protocol.core.named_events import named_event
from deepinfer_server.protocol.responses.stored import storable_response
from deepinfer_server.services.failures import api_error_of
from deepinfer_server.services.token_stream import ProtocolOutput, TokenStream
from deepinfer_server.store import ResponseStore

logger = logging.getLogger(__name__)

#: A Responses `response` object as JSON: opaque here, where only its `status` is read (the
#: protocol's output makes it, the store keeps it).
ResponseObject = dict[str, Any]


ACTIVE = frozenset({"queued", "in_progress"})
TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})
SHUTDOWN_MESSAGE = "the server stopped while generating this background response; create it again"


def event_number(frame: str) -> tuple[int, str]:
    """A streamed event's sequence number and type, read from its SSE frame."""
    event = orjson.loads(frame.split("data: ", 1)[1])
    return int(event["sequence_number"]), str(event["type"])


def failed_body(body: ResponseObject, message: str, code: str = "server_error") -> ResponseObject:
    """The response object of a run that failed."""
    return {**body, "status": "failed", "error": {"code": code, "message": message}}


def created_event(body: ResponseObject) -> str:
    """A stream's first event, `response.created` with the response as it is (queued)."""
    event = {"type": "response.created", "response": body, "sequence_number": 0}
    return named_event("response.created", orjson.dumps(event).decode())


def failed_event(body: ResponseObject, number: int) -> str:
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

    def start(self, cached_tokens: int = 0, written_tokens: int = 0) -> list[str]:
        self._on_start()
        return self._output.start(cached_tokens, written_tokens)

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
    final: ResponseObject | None

    def response(self) -> ResponseObject: ...


class RunHost(Protocol):
    """What a run reads of the process's runs (`background_runs.BackgroundRuns`)."""

    @property
    def store(self) -> ResponseStore:
        """The store its progress and end are written to."""
        ...

    @property
    def owner(self) -> str:
        """This process in the store's `background_runs.owner`."""
        ...

    def ended(self, run: BackgroundRun) -> None:
        """The run has ended and recorded its end."""
        ...


class BackgroundRun:
    """One background response generating in this process (module docstring)."""

    def __init__(
        self,
        runs: RunHost,
        response_id: str,
        scope: str,
        body: ResponseObject,
        streaming: bool,
        opening: list[str] | None = None,
        before_end: Callable[[ResponseObject], Awaitable[None]] | None = None,
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
        self._unwritten_body: ResponseObject | None = None
        self._writing: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._running = False
        self._stopping = False

    @property
    def status(self) -> str:
        """The response's status as last stored."""
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

    def _set_body(self, body: ResponseObject) -> None:
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
            error = api_error_of(exc, self.response_id)
            message = SHUTDOWN_MESSAGE if isinstance(exc, ShuttingDownError) else error.message
            # OpenAI's codes of a failed response: the prompt's fault, or the server's.
            code = "invalid_prompt" if error.status_code < 500 else "server_error"
            final = failed_body(self.body, message, code)
            closing = self._failure_events(final)
        self._running = False  # the generation is over: recording its end is not interrupted
        await self._finish(final, closing)

    def _failure_events(self, body: ResponseObject) -> list[str]:
        if not self.streaming:
            return []
        return [failed_event(body, self._numbers[-1] + 1 if self._numbers else 0)]

    async def _finish(self, final: ResponseObject, closing: list[str]) -> None:
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
