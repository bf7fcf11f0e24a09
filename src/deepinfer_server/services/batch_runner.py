"""BatchRunner: each API server process works through the batches in the store.

Every line is answered by the server's own app, in process (the ASGI app called directly, as a
request of the batch's API key: the same authentication, validation, admission and error
envelopes as the live endpoint), at the lowest admission priority (`PRIORITY_MAX`), at most
`--batch-concurrency` lines at a time per process, and only while the engines have running
slots idle besides one kept for interactive requests, a line counting one per engine request it
makes (its prompts times its `n`, `batch_slots.py`): admission does not preempt, so a line that
took the last slot would make the next interactive request wait for it.

A line is claimed in the store with a lease (`LEASE`, renewed every `HEARTBEAT_INTERVAL` while
it runs) and its result written as soon as it ends, by the claim that holds it only: a batch
resumes where it stopped after a restart, and several processes or replicas work through one
batch without answering a line twice. A line whose process died is claimed again once its lease
ends. A line admission turns away for now (429, or 503 while the server drains) is given back
and tried again later. A Responses line writes its stored response and conversation turn with a
mark of the line, in one transaction (`store/batch_effects.py`; the line is named to the app out
of band, `batch_line.py`): claimed again after its process died, a line so marked is recorded
with the answer stored, not run again, so its writes are never made twice.

A batch goes `validating` → `in_progress` (taken by a runner) → `finalizing` (no line left)
→ `completed`, with its output and error files written in the same transaction as its end;
`cancelling` (asked) → `cancelled` once no process holds a line of it; `expired` when its
completion window passes with lines unanswered.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import Any

import httpx
import orjson

from deepinfer_server.errors import StoreUnavailableError
from deepinfer_server.metrics import ServerMetrics
from deepinfer_server.protocol.core.validation import PRIORITY_MAX
from deepinfer_server.services.batch_line import answering
from deepinfer_server.services.batch_slots import IdleSlots, engine_requests
from deepinfer_server.services.store_scope import NO_AUTH_SCOPE, key_scope
from deepinfer_server.store.batch_effects import LineIdentity
from deepinfer_server.store.batches import (
    PENDING,
    BatchRow,
    BatchStore,
    ClaimedLine,
    FileRow,
    LineResult,
)
from deepinfer_server.store.lease import HEARTBEAT_INTERVAL, LEASE

logger = logging.getLogger(__name__)

_Message = MutableMapping[str, Any]
#: An ASGI application (the server's own app answers the lines), as httpx calls one in process.
ASGIApp = Callable[
    [_Message, Callable[[], Awaitable[_Message]], Callable[[_Message], Awaitable[None]]],
    Awaitable[None],
]

#: Seconds between two looks at the store for batches (a new batch here wakes the runner now).
POLL_INTERVAL = 1.0
#: Statuses of a line's answer that mean "not now" (admission full, the server draining): the
#: line is given back and claimed again later.
_RETRY_STATUSES = frozenset({429, 503})
#: The endpoint whose lines may write to the store as they are answered (`batch_effects.py`).
RESPONSES = "/v1/responses"
#: Fields a batch line may not set: it runs at the lowest priority, as one JSON answer.
_REFUSED = {
    "priority": "a batch request runs at the lowest priority: omit `priority`",
    "stream": "a batch request is answered as one JSON body: omit `stream`",
    "background": "a batch request runs in the background already: omit `background`",
}


#: A batch's two output files: its succeeded lines', its errored lines'.
_KINDS = ("output", "error")


def output_file_id(batch_id: str, kind: str) -> str:
    """The ID of a batch's output (`kind` "output") or error file: one per batch, so that a
    finalization done twice (a process died in it) stores it once."""
    return "file-" + hashlib.sha256(f"{batch_id}/{kind}".encode()).hexdigest()[:24]


def refused(body: Mapping[str, object]) -> str | None:
    """Why a line's request body cannot run in a batch, or None."""
    for field, message in _REFUSED.items():
        if body.get(field) not in (None, False):
            return message
    return None


def openai_line(batch_id: str, line: int, custom_id: str, result: Mapping[str, object]) -> bytes:
    """A line of an OpenAI batch's output or error file."""
    digest = hashlib.sha256(f"{batch_id}/{line}".encode()).hexdigest()[:24]
    record = {
        "id": f"batch_req_{digest}",
        "custom_id": custom_id,
        "response": result.get("response"),
        "error": result.get("error"),
    }
    return orjson.dumps(record)


class BatchRunner:
    """This process's share of the work on every batch in the store (module docstring)."""

    def __init__(
        self,
        store: BatchStore,
        api_keys: tuple[str, ...],
        concurrency: int,
        metrics: ServerMetrics,
        slots: IdleSlots | None = None,
    ) -> None:
        """`slots`: the running slots the server may give batch lines (default: unlimited)."""
        self.store = store
        self._slots = slots or IdleSlots()
        #: The engine requests each line this process runs makes (`engine_requests`).
        self._costs: dict[tuple[str, int], int] = {}
        self.metrics = metrics
        self._api_keys = api_keys
        self.concurrency = concurrency
        #: This process in `batch_lines.claimed_by`.
        self.owner = uuid.uuid4().hex
        self._app: ASGIApp | None = None
        self._client: httpx.AsyncClient | None = None
        self._keys: dict[str, str | None] = {}
        self._running: dict[tuple[str, int], tuple[ClaimedLine, asyncio.Task[None]]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._renewed = 0.0
        metrics.watch_batches(lambda: len(self._running))

    def bind(self, app: ASGIApp) -> None:
        """The app whose routes answer the lines (the HTTP layer's, bound when it is built)."""
        self._app = app

    def start(self) -> None:
        """Start working (once; at start-up, or with the first batch)."""
        if self._task is None and self._app is not None:
            self._client = httpx.AsyncClient(
                transport=httpx.ASGITransport(app=self._app),
                base_url="http://batch.internal",
                timeout=None,
            )
            self._task = asyncio.ensure_future(self._main())

    def wake(self) -> None:
        """Look at the store now (a batch was created or cancelled here)."""
        self.start()
        self._wake.set()

    @property
    def lines_running(self) -> int:
        """The lines this process is answering now."""
        return len(self._running)

    async def stop(self) -> None:
        """Stop working: the lines running are given back unanswered (another process, or
        this server after a restart, answers them)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        running = list(self._running.values())
        for _, task in running:
            task.cancel()
        for line, task in running:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            with contextlib.suppress(StoreUnavailableError):
                await self.store.release(line)
        self._running.clear()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _main(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self.work()
            except StoreUnavailableError:
                pass  # logged by the store; tried again at the next look
            except Exception:
                logger.exception("batch runner: a round failed; trying again")
            # Not asyncio.wait_for: on Python 3.11 it swallows a cancel that arrives as the
            # wake-up does, and `stop()` then waited (29 s of a 30 s test).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_INTERVAL):
                    await self._wake.wait()

    async def work(self) -> None:
        """One look at every batch at work: renew, claim lines, finish batches."""
        if self._running and time.monotonic() - self._renewed >= HEARTBEAT_INTERVAL:
            await self.store.renew([line for line, _ in self._running.values()], LEASE)
            self._renewed = time.monotonic()
        for batch_id, status in await self.store.active_batches():
            if status == "validating":
                await self.store.move(batch_id, "in_progress", sources=("validating",))
                status = "in_progress"
            batch = await self.store.batch(None, batch_id)
            if batch is None:
                continue
            if status == "in_progress":
                await self._advance(batch)
            elif status == "cancelling":
                await self._cancel(batch)
            elif status == "finalizing":
                await self._finalize(batch, "completed")

    async def _advance(self, batch: BatchRow) -> None:
        if batch.counts.get(PENDING, 0) == 0:
            if await self.store.move(batch.id, "finalizing", sources=("in_progress",)):
                await self._finalize(batch, "completed")
            return
        if time.time() >= batch.expires_at:
            self._abort(batch.id)
            if await self.store.move(batch.id, "finalizing", sources=("in_progress",)):
                await self._finalize(batch, "expired")
            return
        self._costs = {key: cost for key, cost in self._costs.items() if key in self._running}
        # Each line makes one engine request at least: never more lines than the budget.
        own = sum(self._costs.values())
        free = min(self.concurrency - len(self._running), self._slots.budget(own))
        if free <= 0:
            return
        if self._running:  # renewed before a claim: the lease of every line runs from now
            self._renewed = 0.0
        for line in await self.store.claim(batch.id, self.owner, free, LEASE):
            cost = engine_requests(line.body)
            if not self._slots.fits(cost, own):
                await self.store.release(line)  # claimed again when there is room for it
                continue
            own += cost
            self._costs[(batch.id, line.line)] = cost
            task = asyncio.ensure_future(self._answer(batch, line))
            self._running[(batch.id, line.line)] = (line, task)
            self._renewed = time.monotonic()

    def _abort(self, batch_id: str) -> None:
        for (owner_batch, _), (_, task) in list(self._running.items()):
            if owner_batch == batch_id:
                task.cancel()

    async def _cancel(self, batch: BatchRow) -> None:
        self._abort(batch.id)
        if any(key[0] == batch.id for key in self._running):
            return  # its lines are being given back
        if await self.store.held(batch.id) == 0:
            await self._finalize(batch, "cancelled")

    async def _answer(self, batch: BatchRow, line: ClaimedLine) -> None:
        try:
            outcome = await self._request(batch, line)
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # Stopped (a cancel, a shutdown): the app answered the abort as a client that
                # left, which is no answer of the line's.
                raise asyncio.CancelledError
            if outcome is None:
                self.metrics.observe_batch_line("retried")
                await self.store.release(line)
            else:
                status, result = outcome
                if await self.store.record(line, status, result):
                    self.metrics.observe_batch_line(status)
        except asyncio.CancelledError:
            self.metrics.observe_batch_line("retried")
            with contextlib.suppress(StoreUnavailableError):
                await asyncio.shield(self.store.release(line))
        except StoreUnavailableError:
            pass  # its lease ends; it is claimed again
        except Exception:
            # Not the request's answer (the app answers every error itself): left to its
            # lease, it is tried again.
            logger.exception("batch %s line %d: no answer", batch.id, line.line)
        finally:
            self._running.pop((batch.id, line.line), None)
            self._wake.set()

    async def _request(
        self, batch: BatchRow, line: ClaimedLine
    ) -> tuple[str, dict[str, Any]] | None:
        """The line's answer (its status and result), or None: not now."""
        message = refused(line.body)
        if message is not None:
            error = {"type": "invalid_request_error", "message": message, "param": None}
            body = {"error": error} if batch.kind == "openai" else {"type": "error", "error": error}
            return "errored", {"response": {"status_code": 400, "request_id": None, "body": body}}
        assert self._client is not None
        request_id = f"{batch.id}-{line.line}"
        if batch.endpoint == RESPONSES:
            stored = await self.store.effect(batch.id, line.line)
            if stored is not None:  # answered before its process died: recorded, not rerun
                response = {"status_code": 200, "request_id": request_id, "body": stored}
                return "succeeded", {"response": response}
        headers = {"x-request-id": request_id}
        key = await self._key(batch.scope)
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        with answering(LineIdentity(batch.id, line.line)):
            answer = await self._client.post(
                batch.endpoint,
                content=orjson.dumps({**line.body, "priority": PRIORITY_MAX}),
                headers={**headers, "content-type": "application/json"},
            )
        if answer.status_code in _RETRY_STATUSES:
            return None
        response = {
            "status_code": answer.status_code,
            "request_id": answer.headers.get("x-request-id"),
            "body": orjson.loads(answer.content),
        }
        return ("succeeded" if answer.is_success else "errored"), {"response": response}

    async def _key(self, scope: str) -> str | None:
        """The API key whose scope is `scope` (None without keys, or a key since removed:
        its lines are then refused by the authentication, as its requests would be)."""
        if scope not in self._keys:
            salt = await self.store.scope_salt()
            found = {key_scope(salt, key.encode()): key for key in self._api_keys}
            self._keys[scope] = None if scope == NO_AUTH_SCOPE else found.get(scope)
        return self._keys[scope]

    async def _finalize(self, batch: BatchRow, status: str) -> None:
        """Write the batch's output files and end it (once, whichever process gets there)."""
        by_kind: dict[str, tuple[FileRow, str]] = {}
        if batch.kind == "openai":
            lines = await self.store.results(batch.id)
            # Up to --batch-max-lines results to encode (50,000 of 1 KB: 0.2 s): off the loop.
            by_kind = await asyncio.to_thread(_output_files, batch.id, lines)
        files = list(by_kind.values())
        output_id, error_id = (by_kind[kind][0].id if kind in by_kind else None for kind in _KINDS)
        if await self.store.finish(batch, status, files, output_id, error_id):
            self.metrics.observe_batch_end(status)
            logger.info("batch %s %s", batch.id, status)


def _output_files(batch_id: str, lines: Sequence[LineResult]) -> dict[str, tuple[FileRow, str]]:
    """An OpenAI batch's output file (its succeeded lines) and error file (its errored ones),
    by kind, each if it has a line."""
    files: dict[str, tuple[FileRow, str]] = {}
    now = time.time()
    for kind, status in zip(_KINDS, ("succeeded", "errored"), strict=True):
        rows = [
            openai_line(batch_id, r.line, r.custom_id, r.result)
            for r in lines
            if r.status == status and r.result is not None
        ]
        if rows:
            content = b"".join(row + b"\n" for row in rows)
            name = f"{batch_id}_{kind}.jsonl"
            file = FileRow(output_file_id(batch_id, kind), now, "batch_output", name, len(content))
            files[kind] = (file, content.decode())
    return files
