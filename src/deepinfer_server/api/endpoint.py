"""serve_generation: one generation request end to end, the same for every protocol.

Read and decode the body, prepare it with the protocol's recipe glue, admit it to a rank, then
stream named or unnamed SSE events, or collect one JSON body, through a `TokenStream`.
Admission, cancellation, timeouts, metrics and failure handling are identical for every
protocol; a `GenerationProtocol` only says how to prepare, how to frame and how errors look.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Generic, cast

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
from deepinfer_server.api.generation_protocol import Choice, GenerationProtocol, P, Session
from deepinfer_server.api.image_urls import prepare_fetching_images
from deepinfer_server.api.session_route import session_names
from deepinfer_server.api.sse import FrameWriter, SSEResponse, complete, write_all
from deepinfer_server.api.state import LARGE_BODY_BYTES, AppState
from deepinfer_server.coordinator.admission_limits import most_admitted
from deepinfer_server.coordinator.handle import RequestHandle
from deepinfer_server.disaggregation.handoff.bootstrap import release
from deepinfer_server.disaggregation.handoff.params import KVTransferParams
from deepinfer_server.disaggregation.handoff.peers import refuse_unpaired
from deepinfer_server.disaggregation.handoff.requests import request_kv_transfer, with_handoff
from deepinfer_server.disaggregation.role import DisaggregationRole
from deepinfer_server.errors import BadRequestError
from deepinfer_server.ipc.messages import AbortReason, Images, SamplingOptions, StructuredOutput
from deepinfer_server.metrics import ChoiceRecords, RequestRecord, ServerMetrics
from deepinfer_server.protocol.core.choices import ChoiceMerger
from deepinfer_server.protocol.core.images import mentions_images
from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.core.validation import PRIORITY_MAX, read_priority
from deepinfer_server.services.token_stream import ProtocolOutput, TokenStream

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReadRequest(Generic[P]):
    """A generation request as read, before preparation: its body and admission terms."""

    raw: bytes
    #: The body preparation gets: the client's, less the endpoint's own `priority`.
    body: JsonObject
    priority: int
    session: Session[P] | None
    arrival: float

    @property
    def detached(self) -> bool:
        """Whether the request runs in the background, detached from its connection."""
        return self.session is not None and self.session.background


async def serve_generation(request: Request, protocol: GenerationProtocol[P]) -> Response:
    """Handle one generation request end to end (errors raise to the app's handlers): read
    its body, prepare it, admit it, submit its engine requests, respond (JSON or SSE)."""
    read = await read_request(request, protocol)
    choices = await prepare_choices(request, protocol, read)
    session = read.session
    response_id = (
        f"{protocol.id_prefix}{request.state.request_id}"
        if session is None
        else session.response_id
    )
    handles = await submit(request, read, choices, response_id)
    # This function owns the admitted handles until a streaming response takes them over (its
    # `abandon` releases them however it ends); on every other exit, whatever is still open
    # is released here, so no path can keep a slot.
    try:
        response = await _respond(
            request, protocol, choices, handles, response_id, read.arrival, session
        )
    except BaseException:
        _release(handles)
        raise
    if not isinstance(response, SSEResponse) and not read.detached:
        _release(handles)
    return response  # type: ignore[return-value]


async def read_request(request: Request, protocol: GenerationProtocol[P]) -> ReadRequest[P]:
    """The body read and decoded, its `priority`, and the protocol's session if it opens one
    (a background response runs at the lowest priority)."""
    state: AppState = request.app.state.server
    arrival = time.perf_counter()
    received = await read_json_body(request, state.config, state.receiving)
    priority = read_priority(received.value)
    # The endpoint's field, not the protocol's: preparation gets the rest, in a new dict.
    body = {key: value for key, value in received.value.items() if key != "priority"}
    opened = None if protocol.open_session is None else await protocol.open_session(request, body)
    if opened is not None and opened.background:  # work that waits for nothing goes last
        if received.value.get("priority") is not None:
            raise BadRequestError(
                "a background response runs at the lowest priority: omit `priority`",
                param="priority",
            )
        priority = PRIORITY_MAX
    return ReadRequest(received.raw, body, priority, opened, arrival)


async def prepare_choices(
    request: Request, protocol: GenerationProtocol[P], read: ReadRequest[P]
) -> list[P]:
    """The prepared engine requests, one per choice, at most as many as may be in flight.

    Images are decoded and resized while preparing: never on the event loop. Image URLs are
    fetched on it, never on a preparation worker."""
    state: AppState = request.app.state.server
    config = state.config
    session = read.session
    prepare = protocol.prepare if session is None else session.prepare
    # What the request prepares: its body, and what the store expands it with (a body of a few
    # bytes may continue a conversation of megabytes).
    size = len(read.raw)
    if session is not None:
        size += session.expanded_size(LARGE_BODY_BYTES - size)
    on_thread = mentions_images(read.raw)
    prepared = await prepare_fetching_images(
        lambda: state.prepare_body(
            prepare, read.body, size, tenant_of(request.state), on_thread=on_thread
        ),
        state.recipe.image_limits,
        request.receive,
    )
    choices = prepared if isinstance(prepared, list) else [prepared]
    if len(choices) > config.admission_capacity:
        # More engine requests than may ever be in flight at once: a 429 would be retried
        # forever, even on an idle server.
        raise BadRequestError(
            f"the request needs {len(choices)} engine requests (one per prompt and choice) "
            f"but this server admits at most {config.admission_capacity} at a time "
            "(DP x --max-num-seqs + --max-queued-requests): ask for fewer",
            param="n",
        )
    most = most_admitted(config, tenant_of(request.state))
    if len(choices) > most:
        raise BadRequestError(
            f"the request needs {len(choices)} engine requests (one per prompt and choice) "
            f"but this API key may have at most {most} in flight at a time (its share of the "
            "running slots and of the queue: --key-running-share, --key-queued-share, or its "
            "max_running and max_queued in --api-key-file): ask for fewer",
            param="n",
        )
    return choices


async def submit(
    request: Request, read: ReadRequest[P], choices: list[P], response_id: str
) -> list[RequestHandle]:
    """Admit the prepared choices and submit one engine request each (structured output
    compiled first, off the event loop, in the key's turn)."""
    state: AppState = request.app.state.server
    config = state.config
    first = choices[0]
    kv_transfer = request_kv_transfer(
        read.body,
        config.disaggregation_mode,
        len(choices),
        first.prompt_token_ids,
        state.handoff_signer,
        thinking_budget=first.sampling.thinking_budget is not None,
    )
    if kv_transfer is None:
        return await _submit_choices(request, read, choices, response_id, None)
    try:
        if state.prefill_peers is not None:
            state.prefill_peers.seen(kv_transfer, time.monotonic())
            await refuse_unpaired(state.prefill_peers, kv_transfer)
        return await _submit_choices(request, read, choices, response_id, kv_transfer)
    except BaseException:
        # Refused before the engine took it (layout, grammar, admission, a disconnect): no
        # pull will release the prefill rank's hold, so tell it now rather than at its timeout.
        asyncio.get_running_loop().run_in_executor(None, release, kv_transfer)
        raise


async def _submit_choices(
    request: Request,
    read: ReadRequest[P],
    choices: list[P],
    response_id: str,
    kv_transfer: KVTransferParams | None,
) -> list[RequestHandle]:
    """`submit` once the handoff (if any) is verified and paired."""
    state: AppState = request.app.state.server
    config = state.config
    tenant = tenant_of(request.state)
    first = choices[0]
    structured = None
    if first.constraint is not None:
        structured = await state.structured.compile(first.constraint, str(tenant))
    partition = cache_partition(request, config, first.cache_salt)
    stored = None if read.session is None else read.session.response_id
    session = session_names(request, read.body, stored)

    def submit_one(index: int) -> RequestHandle:
        choice = choices[index]
        return state.coordinator.submit(
            state.next_engine_request_id(response_id),
            choice.prompt_token_ids,
            _engine_sampling(choice.sampling, structured, config.disaggregation_mode),
            state.deadline(),
            choice.images,
            kv_transfer_params=kv_transfer,
            cache_salt=partition,
            tenant=tenant,
            priority=read.priority,
            session=session,
        )

    return submit_all(submit_one, len(choices))


def _engine_sampling(
    sampling: SamplingOptions, structured: StructuredOutput | None, mode: DisaggregationRole
) -> SamplingOptions:
    """A choice's sampling options as submitted: with the compiled grammar, and without a
    thinking budget on a prefill server (it computes the prompt and its first token for the
    handoff; the budget is the decode side's, which refuses it)."""
    if structured is not None:
        sampling = msgspec.structs.replace(sampling, structured=structured)
    if sampling.thinking_budget is not None and mode is DisaggregationRole.PREFILL:
        sampling = msgspec.structs.replace(sampling, thinking_budget=None)
    return sampling


def _release(handles: list[RequestHandle]) -> None:
    """Close every handle still open (a no-op for those their streams closed)."""
    for handle in handles:
        handle.close(AbortReason.DISCONNECT)


async def _respond(
    request: Request,
    protocol: GenerationProtocol[P],
    choices: list[P],
    handles: list[RequestHandle],
    response_id: str,
    arrival: float,
    session: Session[P] | None,
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
    body = with_handoff(
        outputs[0].response_json(),
        handles[0].kv_transfer_params,
        state.handoff_signer,
        choices[0].prompt_token_ids,
    )
    return Response(body, media_type="application/json")


async def _serve_choices(
    request: Request,
    protocol: GenerationProtocol[P],
    choices: list[P],
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
    protocol: GenerationProtocol[P],
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
    protocol: GenerationProtocol[P],
    stream: TokenStream,
    write: FrameWriter,
    metrics: ServerMetrics,
    request_id: str,
    record: RequestRecord,
    session: Session[P] | None = None,
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
    protocol: GenerationProtocol[P],
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


def json_frame(event: str | None, body: JsonObject) -> bytes:
    """One SSE message with an optional event name."""
    prefix = b"" if event is None else b"event: " + event.encode() + b"\n"
    return prefix + b"data: " + orjson.dumps(body) + b"\n\n"
