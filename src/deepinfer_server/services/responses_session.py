"""The Responses store around one `POST /v1/responses`: what is read before, written after.

`api/store_session.py`'s `open_session` decides: a request that neither stores (`store: false`)
nor continues stored state (`previous_response_id`, item references) takes the stateless path
unchanged. Otherwise its session reads what the input continues from the store before
preparation (a store outage: 503, before anything reaches the engine), expands the input as the
first step of the preparation (on a preparation worker, off the event loop, when what the store
adds is large: `expanded_size`; both in `services/stored_input.py`), and after generation writes
the response with the request's own input items. The write waits for nothing on the token path:
a stored stream's deltas go out as they come, and only its terminal event (or the JSON body)
waits for the write, so that a client that sends its next turn at once finds this one stored,
whichever API server process or replica answers it.

A response asked to be stored (`store: true`, the default) is stored or the client is told: a
write that fails, or is not done within `WRITE_WAIT` (longer than the store's own bounds on a
locked or unreachable database), is a 503 `response_store_unavailable` in place of the JSON body,
and an `error` event of that code in place of a stream's terminal event (a response past the cap
of one: a 400 the same way); it is logged and counted (`response_store_writes{result="failed"}`).
A request whose own input alone is past the cap of one stored response is refused with a 400
before it reaches the engine.

With `conversation` (OpenAI's Conversations API, `store/conversations.py`), the conversation's
items come before the request's input, and once the response is `completed` or `incomplete`
its input and output items are appended to the conversation, before the client hears the end
(the JSON body, or a stream's terminal event), whether or not the response itself is stored.

A batch line's request (`services/batch_line.py`) writes its response and its turn in one
transaction with the mark of the line's answer (`store/batch_effects.py`): a line answered
twice (its server killed before the runner recorded it) writes them once.

Scope: the API key the request authenticated with, as an HMAC under the store's salt (the key is
never stored), or "none" on a server without `--api-key`. A stored object read in another scope
is a 404, exactly as if it did not exist.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import orjson

from deepinfer_server.coordinator.handle import RequestHandle
from deepinfer_server.errors import BadRequestError, StoreUnavailableError
from deepinfer_server.metrics import RequestRecord, ServerMetrics
from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.core.preparation_size import preparation_size
from deepinfer_server.protocol.core.recipe import RecipeContext
from deepinfer_server.protocol.responses.output import (
    ResponsesOutput,
    StoredEcho,
    responses_output,
)
from deepinfer_server.protocol.responses.request import PreparedResponses, prepare_responses
from deepinfer_server.protocol.responses.stored import storable_response
from deepinfer_server.services.background import BackgroundRun, ResponseObject, created_event
from deepinfer_server.services.background_runs import BackgroundRuns
from deepinfer_server.services.batch_line import line_answered
from deepinfer_server.services.stored_input import Expansion, expand_input, read_expansion
from deepinfer_server.services.token_stream import TokenStream
from deepinfer_server.store import ResponseStore, ResponseTooLarge
from deepinfer_server.store.batch_effects import LineEffects, LineIdentity
from deepinfer_server.store.conversations import ConversationStore
from deepinfer_server.store.database import Step
from deepinfer_server.store.records import NewResponse

logger = logging.getLogger(__name__)

#: Seconds a response's last event (or body) waits for its write: past the store's own bounds
#: (SQLite's busy timeout, PostgreSQL's connection and statement timeouts). A write still
#: running then is reported as failed, and finishes (or fails) in the background.
WRITE_WAIT = 12.0
#: Fields of the body the session serves itself (the preparation rejects them otherwise).
_STORE_FIELDS = ("store", "previous_response_id", "background", "conversation")
_STORED_STATUSES = frozenset({"completed", "incomplete"})


class SessionHost(Protocol):
    """What a session reads of the server (`api.state.AppState`)."""

    @property
    def recipe(self) -> RecipeContext:
        """The recipe context the body is prepared with."""
        ...

    @property
    def metrics(self) -> ServerMetrics:
        """Where the store's writes are counted."""
        ...

    @property
    def background_runs(self) -> BackgroundRuns | None:
        """This process's background responses (with a store)."""
        ...

    def background(
        self, work: asyncio.Future[None], on_done: Callable[[asyncio.Future[None]], None]
    ) -> None:
        """Keep `work` alive until it is done, then call `on_done` with it."""
        ...


class ResponsesSession:
    """One Responses request the store serves (see the module docstring)."""

    def __init__(
        self,
        host: SessionHost,
        store: ResponseStore,
        scope: str,
        response_id: str,
        stored: bool,
        previous_response_id: str | None,
        background: bool = False,
        conversation: str | None = None,
        appends: bool = True,
    ) -> None:
        self._host = host
        #: `background: true`: generated detached from the request (services/background.py).
        self.background = background
        self._prepared: PreparedResponses | None = None
        self._store = store
        self._scope = scope
        self.response_id = response_id
        self._stored = stored
        self._previous = previous_response_id
        #: The conversation the response belongs to, and whether its turn is appended to it
        #: (a prefill server's is not: the decode server that answers appends it).
        self._conversation = conversation
        self._appends = appends
        self._conversations = ConversationStore(store)
        self._body: JsonObject = {}
        #: What `expand` read, until `prepare` expands it (and the stored part's items).
        self._expansion: Expansion | None = None
        self._stored_parts: list[list[Any]] = []
        self._own_input: list[Any] = []
        self._output: ResponsesOutput | None = None

    async def expand(self, body: JsonObject) -> None:
        """Read what the request continues from the store (`stored_input.read_expansion`).
        Nothing heavy runs here, on the event loop: the expansion itself (reasoning sealed
        and restored over every item) is part of `prepare`, which runs on a preparation
        worker when `expanded_size` is large."""
        expansion = await read_expansion(
            self._store, self._conversations, self._scope, self._conversation, self._previous, body
        )
        self._stored_parts = [expansion.history, expansion.referenced]
        self._expansion = expansion
        self._body = {k: v for k, v in body.items() if k not in _STORE_FIELDS}

    def expanded_size(self, bound: int) -> int:
        """The bytes the store adds to what the request prepares (`preparation_size`: counted
        until past `bound`, an image past any bound)."""
        return preparation_size(self._stored_parts, bound)

    def _expand(self, expansion: Expansion) -> None:
        """The body to prepare (`stored_input.expand_input`) and the request's own input
        items as they will be stored."""
        expanded, self._own_input = expand_input(expansion, self._host.recipe.reasoning_seal)
        if self._stored:
            self._check_size(self._own_input)
        self._body["input"] = expanded

    def _check_size(self, own_input: list[Any]) -> None:
        """A 400 before generation when the input alone is past the cap of one response."""
        size = sum(len(orjson.dumps(item)) for item in own_input)
        try:
            self._store.check_size(size)
        except ResponseTooLarge as exc:
            raise BadRequestError(
                f"the input is {size} bytes as stored, more than this server stores for one "
                f"response ({exc.limit} bytes, --response-store-max-response-mb); send "
                "'store': false to answer it without storing it",
                param="store",
            ) from None

    def prepare(self, body: JsonObject, recipe: RecipeContext) -> PreparedResponses:
        """`prepare_responses` on the expanded body (the one passed in is the client's),
        expanded first (once: a preparation that stops for image URLs runs again)."""
        expansion, self._expansion = self._expansion, None
        if expansion is not None:
            self._expand(expansion)
        return prepare_responses(self._body, recipe)

    def make_output(
        self, prepared: PreparedResponses, response_id: str, recipe: RecipeContext
    ) -> ResponsesOutput:
        """The Responses output, echoing what the session stores (`store`, `background`, the
        previous response, the conversation)."""
        self._prepared = prepared
        self._output = responses_output(prepared, response_id, recipe, self._echo())
        return self._output

    def _echo(self) -> StoredEcho:
        return StoredEcho(self._stored, self._previous, self.background, self._conversation)

    async def start_in_background(
        self, handle: RequestHandle, record: RequestRecord, streaming: bool
    ) -> tuple[BackgroundRun, ResponseObject]:
        """Store the response as queued and start its run (which owns `handle` from here on);
        the run and the queued response (the run's events, when `streaming`, open with it)."""
        runs, output, prepared = self._host.background_runs, self._output, self._prepared
        assert runs is not None and output is not None and prepared is not None
        recipe = self._host.recipe
        quiet = dataclasses.replace(prepared, stream=False)
        queued = responses_output(quiet, self.response_id, recipe, self._echo()).response()
        queued = {**queued, "status": "queued"}
        new = NewResponse(
            self.response_id,
            self._scope,
            time.time(),
            storable_response(queued),
            self._own_input,
            self._previous,
        )
        # A stream opens at once, as OpenAI's does: the response, queued (stored with it).
        opening = [created_event(queued)] if streaming else []
        try:
            await self._store.start_background(new, runs.owner, [(0, frame) for frame in opening])
        except ResponseTooLarge as exc:
            raise BadRequestError(
                f"the input is {exc.size} bytes as stored, more than this server stores for "
                f"one response ({exc.limit} bytes, --response-store-max-response-mb)",
                param="input",
            ) from None
        run = BackgroundRun(
            runs,
            self.response_id,
            self._scope,
            queued,
            streaming,
            opening,
            before_end=self._append_turn if self._appending else None,
        )
        stream = TokenStream(handle, run.watch(output), record, self._host.metrics)
        runs.add(run)
        run.start(stream, output)
        return run, queued

    async def finished(self) -> list[str]:
        """Store the finished response (when asked to) and append its turn to its
        conversation; the held closing payloads. StoreUnavailableError when either is asked
        for and not done."""
        output = self._output
        assert output is not None, "finished() before make_output()"
        if not self._stored and not self._appending:
            return output.held  # a prefill server's turn: nothing to write, its end goes out
        response = output.final if output.final is not None else output.response()
        if response.get("status") in _STORED_STATUSES:
            await self._write(response)
        return output.held

    @property
    def _appending(self) -> bool:
        return self._conversation is not None and self._appends

    def _turn(self, response: ResponseObject) -> list[Any]:
        """The items a response appends to its conversation (its input and output items),
        none unless it ended `completed` or `incomplete`."""
        if self._conversation is None or response.get("status") not in _STORED_STATUSES:
            return []
        output = storable_response(response).get("output") or []
        return [*self._own_input, *(item for item in output if isinstance(item, dict))]

    async def _append_turn(self, response: ResponseObject) -> None:
        """Append the turn to its conversation (`_turn`); a conversation deleted meanwhile
        takes nothing."""
        items = self._turn(response)
        if items and not await self._conversations.append(
            self._scope, str(self._conversation), items, generated=True
        ):
            self._turn_dropped()

    def _turn_dropped(self) -> None:
        logger.info(
            "conversation %s was deleted before %s ended; its turn is not kept",
            self._conversation,
            self.response_id,
        )

    def _new_response(self, response: ResponseObject) -> NewResponse:
        return NewResponse(
            self.response_id,
            self._scope,
            time.time(),
            storable_response(response),
            self._own_input,
            self._previous,
        )

    async def _persist(self, response: ResponseObject) -> None:
        line = line_answered()
        if line is not None:
            await self._persist_line(line, response)
            return
        if self._stored:
            await self._store.save(self._new_response(response))
        if self._appending:
            await self._append_turn(response)

    async def _persist_line(self, line: LineIdentity, response: ResponseObject) -> None:
        """A batch line's writes with the mark of its answer, in one transaction: written
        once however often the line is answered (`store/batch_effects.py`)."""
        steps: list[Step] = []
        if self._stored:
            steps += await self._store.insert_steps(self._new_response(response))
        appended = len(steps)
        items = self._turn(response) if self._appending else []
        if items:
            steps += self._conversations.append_steps(
                self._scope, str(self._conversation), items, generated=True
            )
        changed = await LineEffects(self._store).commit(line, response, steps)
        if items and not changed[appended]:
            self._turn_dropped()

    async def _write(self, response: ResponseObject) -> None:
        write = asyncio.ensure_future(self._persist(response))
        self._host.background(write, self._on_written)
        done, _ = await asyncio.wait({write}, timeout=WRITE_WAIT)
        if not done:
            logger.warning(
                "response store: storing %s took more than %gs; reported as not stored",
                self.response_id,
                WRITE_WAIT,
            )
            raise StoreUnavailableError(
                f"the response was generated but {self._storing} did not finish within "
                f"{WRITE_WAIT:g}s (the response store is busy or unreachable); retry"
                + (", or send 'store': false" if self._stored else "")
            )
        failure = write.exception()
        if isinstance(failure, ResponseTooLarge):  # a 400: the same request would fail again
            raise BadRequestError(
                f"the response was generated but not stored: {failure.size} bytes, more than "
                f"this server stores for one response ({failure.limit} bytes, "
                "--response-store-max-response-mb); ask for a shorter answer or send "
                "'store': false",
                param="store",
            )
        if failure is not None:
            what = "could not be stored" if not self._appending else f"{self._storing} failed"
            raise StoreUnavailableError(
                f"the response was generated but {what} (the response store failed); retry "
                "later" + (", or send 'store': false" if self._stored else "")
            )

    @property
    def _storing(self) -> str:
        """What the write after the generation does, for its errors."""
        if not self._appending:
            return "storing it"
        turn = f"adding its turn to conversation {self._conversation!r}"
        return f"storing it and {turn}" if self._stored else turn

    def _on_written(self, write: asyncio.Future[None]) -> None:
        failed = write.cancelled() or write.exception() is not None
        self._host.metrics.observe_store_write(failed)
        if failed:
            logger.warning("response store: %s was not stored", self.response_id)
