"""serve_generation: one generation request end to end, the same for every protocol.

Read and decode the body, prepare it with the protocol's recipe glue, admit it to a rank, then
stream named or unnamed SSE events, or collect one JSON body, through a `TokenStream`.
Admission, cancellation, timeouts, metrics and failure handling are identical for every
protocol; a `GenerationProtocol` only says how to prepare, how to frame and how errors look.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import msgspec
import orjson
from starlette.requests import Request
from starlette.responses import Response

from deepinfer_server.api.auth import tenant_of
from deepinfer_server.api.body import read_json_body
from deepinfer_server.api.cache_partition import cache_partition
from deepinfer_server.api.disconnect import until_disconnect
from deepinfer_server.api.error_responses import as_api_error
from deepinfer_server.api.fan_out import merge_streams, submit_all
from deepinfer_server.api.image_urls import prepare_fetching_images
from deepinfer_server.api.sse import FrameWriter, SSEResponse, complete, write_all
from deepinfer_server.api.state import AppState
from deepinfer_server.api.token_stream import ProtocolOutput, TokenStream
from deepinfer_server.coordinator.handle import RequestHandle
from deepinfer_server.disaggregation.handoff.requests import request_kv_transfer, with_handoff
from deepinfer_server.disaggregation.role import DisaggregationRole
from deepinfer_server.errors import ApiError, BadRequestError
from deepinfer_server.grammar import Constraint
from deepinfer_server.ipc.messages import AbortReason, Images, SamplingOptions
from deepinfer_server.metrics import ChoiceRecords, RequestRecord, ServerMetrics
from deepinfer_server.protocol.core.choices import ChoiceMerger
from deepinfer_server.protocol.core.images import mentions_images
from deepinfer_server.protocol.core.recipe import RecipeContext
from deepinfer_server.protocol.core.validation import PRIORITY_MAX, read_priority

logger = logging.getLogger(__name__)


class Prepared(Protocol):
    """What every protocol's preparation yields."""

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def sampling(self) -> SamplingOptions: ...

    @property
    def stream(self) -> bool: ...

    @property
    def constraint(self) -> Constraint | None: ...

    @property
    def images(self) -> Images | None: ...

    @property
    def cache_salt(self) -> str | None: ...


class Choice(Protocol):
    """What a prepared choice of a several-choice request adds (chat n > 1, completions)."""

    @property
    def index(self) -> int: ...

    @property
    def prompt_index(self) -> int: ...


class Session(Protocol):
    """A request that a protocol serves with state (the Responses store): its own preparation
    and output, and what it does once the output is complete."""

    @property
    def response_id(self) -> str: ...

    def prepare(self, body: dict[str, Any], recipe: RecipeContext) -> Any: ...

    def make_output(self, prepared: Any, response_id: str, recipe: RecipeContext) -> Any: ...

    async def finished(self) -> list[str]:
        """After the request ended normally: the closing payloads its output held back."""
        ...

    @property
    def background(self) -> bool:
        """Whether the request runs detached from its connection (`run_in_background`)."""
        ...

    async def run_in_background(
        self, handle: RequestHandle, record: RequestRecord, streaming: bool
    ) -> Response | SSEResponse:
        """Start the detached run, which owns `handle` from then on; the answer."""
        ...


@dataclass(frozen=True)
class GenerationProtocol:
    """How one client protocol prepares requests, frames its stream and shapes its errors."""

    id_prefix: str
    prepare: Callable[[dict[str, Any], RecipeContext], Any]
    make_output: Callable[[Any, str, RecipeContext], ProtocolOutput]
    frames: Callable[[list[str]], bytes]
    done_frame: bytes
    #: The stream's last message when the request fails after the stream started.
    error_frame: Callable[[ApiError], bytes]
    #: A protocol with state: the session of a request that needs it (None: the stateless
    #: path, exactly as for a protocol without state).
    open_session: Callable[[Request, dict[str, Any]], Awaitable[Session | None]] | None = None


async def serve_generation(request: Request, protocol: GenerationProtocol) -> Response:
    """Handle one generation request end to end (errors raise to the app's handlers).

    A protocol's `prepare` may return a list: one prepared choice per engine request (n > 1).
    """
    state: AppState = request.app.state.server
    config = state.config
    request_id: str = request.state.request_id
    arrival = time.perf_counter()
    received = await read_json_body(request, config, state.receiving)
    raw, body = received.raw, received.value
    priority_given = body.get("priority") is not None
    priority = read_priority(body)
    tenant = tenant_of(request.state)
    session = None if protocol.open_session is None else await protocol.open_session(request, body)
    detached = session is not None and session.background
    if detached:  # work that waits for nothing goes after every other request of its key
        if priority_given:
            raise BadRequestError(
                "a background response runs at the lowest priority: omit `priority`",
                param="priority",
            )
        priority = PRIORITY_MAX
    prepare = protocol.prepare if session is None else session.prepare
    # Images are decoded and resized while preparing: never on the event loop. Image URLs are
    # fetched on it, never on a preparation worker.
    on_thread = mentions_images(raw)
    prepared_any = await prepare_fetching_images(
        lambda: state.prepare_body(prepare, body, len(raw), on_thread=on_thread),
        state.recipe.image_limits,
        request.receive,
    )
    choices: list[Prepared] = prepared_any if isinstance(prepared_any, list) else [prepared_any]
    if len(choices) > config.admission_capacity:
        # More engine requests than may ever be in flight at once: a 429 would be retried
        # forever, even on an idle server.
        raise BadRequestError(
            f"the request needs {len(choices)} engine requests (one per prompt and choice) "
            f"but this server admits at most {config.admission_capacity} at a time "
            "(DP x --max-num-seqs + --max-queued-requests): ask for fewer",
            param="n",
        )
    kv_transfer = request_kv_transfer(
        body,
        config.disaggregation_mode,
        len(choices),
        len(choices[0].prompt_token_ids),
        thinking_budget=choices[0].sampling.thinking_budget is not None,
    )
    if kv_transfer is not None and state.prefill_peers is not None:
        state.prefill_peers.seen(kv_transfer, time.monotonic())
    structured = None
    if choices[0].constraint is not None:
        # Compiling can take seconds: off the event loop, in this key's turn.
        structured = await state.structured.compile(choices[0].constraint, str(tenant))
    response_id = f"{protocol.id_prefix}{request_id}" if session is None else session.response_id
    partition = cache_partition(request, config, choices[0].cache_salt)

    def submit(index: int) -> RequestHandle:
        sampling = choices[index].sampling
        if structured is not None:
            sampling = msgspec.structs.replace(sampling, structured=structured)
        if (
            sampling.thinking_budget is not None
            and config.disaggregation_mode is DisaggregationRole.PREFILL
        ):
            # A prefill server computes the prompt and its first token for the handoff; the
            # budget is the decode side's, which refuses it.
            sampling = msgspec.structs.replace(sampling, thinking_budget=None)
        return state.coordinator.submit(
            state.next_engine_request_id(response_id),
            choices[index].prompt_token_ids,
            sampling,
            state.deadline(),
            choices[index].images,
            kv_transfer_params=kv_transfer,
            cache_salt=partition,
            tenant=tenant,
            priority=priority,
        )

    handles = submit_all(submit, len(choices))
    # This function owns the admitted handles until a streaming response takes them over (its
    # `abandon` releases them however it ends); on every other exit, whatever is still open
    # is released here, so no path can keep a slot.
    try:
        response = await _respond(
            request, protocol, choices, handles, response_id, arrival, session
        )
    except BaseException:
        _release(handles)
        raise
    if not isinstance(response, SSEResponse) and not detached:
        _release(handles)
    return response  # type: ignore[return-value]


def _release(handles: list[RequestHandle]) -> None:
    """Close every handle still open (a no-op for those their streams closed)."""
    for handle in handles:
        handle.close(AbortReason.DISCONNECT)


async def _respond(
    request: Request,
    protocol: GenerationProtocol,
    choices: list[Prepared],
    handles: list[RequestHandle],
    response_id: str,
    arrival: float,
    session: Session | None,
) -> Response | SSEResponse:
    state: AppState = request.app.state.server
    records = [RequestRecord(arrival=arrival) for _ in choices]
    for record, choice in zip(records, choices, strict=True):
        record.prompt_tokens = Images.prompt_tokens(choice.prompt_token_ids, choice.images)
        record.admitted_at = time.perf_counter()
    request.state.record = records[0]
    make_output = protocol.make_output if session is None else session.make_output
    outputs = [make_output(choice, response_id, state.recipe) for choice in choices]
    if len(choices) > 1:
        assert session is None, "a session serves a request of one choice"
        prompts = [cast(Choice, choice).prompt_index for choice in choices]
        request.state.record = ChoiceRecords(records, prompts)
        return await _serve_choices(request, protocol, choices, handles, outputs, records)
    if session is not None and session.background:
        return await session.run_in_background(handles[0], records[0], choices[0].stream)
    stream = TokenStream(handles[0], outputs[0], records[0], state.metrics)
    if choices[0].stream:
        request_id: str = request.state.request_id

        async def write_body(write: FrameWriter) -> None:
            await _stream(protocol, stream, write, state.metrics, request_id, records[0], session)

        return SSEResponse(write_body, abandon=stream.abandon)
    try:
        await until_disconnect(request.receive, stream.run())
    finally:
        stream.abandon()
    if session is not None:
        await session.finished()
    body = with_handoff(outputs[0].response_json(), handles[0].kv_transfer_params)
    return Response(body, media_type="application/json")


async def _serve_choices(
    request: Request,
    protocol: GenerationProtocol,
    choices: list[Prepared],
    handles: list[RequestHandle],
    outputs: list[ProtocolOutput],
    records: list[RequestRecord],
) -> Response | SSEResponse:
    state: AppState = request.app.state.server
    metrics = state.metrics
    merger = ChoiceMerger(
        [cast(Choice, choice).index for choice in choices],
        [cast(Choice, choice).prompt_index for choice in choices],
    )
    streams = [
        TokenStream(handle, output, record, metrics).batches()
        for handle, output, record in zip(handles, outputs, records, strict=True)
    ]
    if choices[0].stream:
        frames = _stream_choices(
            protocol, merger, streams, metrics, request.state.request_id, records[0]
        )
        return SSEResponse(
            lambda write: write_all(frames, write), abandon=lambda: _release(handles)
        )

    async def collect() -> bytes:
        async for _ in merge_streams(streams):
            pass
        return merger.merge_bodies([output.response_json() for output in outputs])

    return Response(
        await until_disconnect(request.receive, collect()), media_type="application/json"
    )


async def _stream_choices(
    protocol: GenerationProtocol,
    merger: ChoiceMerger,
    streams: list[AsyncIterator[list[str]]],
    metrics: ServerMetrics,
    request_id: str,
    record: RequestRecord,
) -> AsyncGenerator[bytes, None]:
    try:
        async for index, payloads in merge_streams(streams):
            renumbered = merger.renumber(index, payloads)
            if renumbered:
                yield protocol.frames(renumbered)
        final = merger.final_usage()
        if final:
            yield protocol.frames(final)
    except Exception as exc:
        yield _failed_stream_frame(protocol, exc, metrics, request_id, record)
    if protocol.done_frame:
        yield protocol.done_frame


async def _stream(
    protocol: GenerationProtocol,
    stream: TokenStream,
    write: FrameWriter,
    metrics: ServerMetrics,
    request_id: str,
    record: RequestRecord,
    session: Session | None = None,
) -> None:
    frames = protocol.frames
    try:
        await stream.run(lambda payloads: write(frames(payloads)))
        if session is not None:  # the closing payloads wait for the session's work
            closing = await session.finished()
            if closing:
                await complete(write(frames(closing)))
    except Exception as exc:
        await complete(write(_failed_stream_frame(protocol, exc, metrics, request_id, record)))
    if protocol.done_frame:
        await complete(write(protocol.done_frame))


def _failed_stream_frame(
    protocol: GenerationProtocol,
    exc: Exception,
    metrics: ServerMetrics,
    request_id: str,
    record: RequestRecord,
) -> bytes:
    """The protocol's last event for a stream that failed after it started (logged, counted)."""
    error = as_api_error(exc, request_id)
    metrics.observe_failure(error.status_code)
    record.error_kind = error.kind.value
    logger.warning(
        "request %s: the stream failed after it started: %s (%s)",
        request_id,
        error.message,
        error.kind.value,
    )
    return protocol.error_frame(error)


def json_frame(event: str | None, body: dict[str, Any]) -> bytes:
    """One SSE message with an optional event name."""
    prefix = b"" if event is None else b"event: " + event.encode() + b"\n"
    return prefix + b"data: " + orjson.dumps(body) + b"\n\n"
