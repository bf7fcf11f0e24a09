"""Background responses in-process with the official openai client: `background: true` answers
queued and runs detached from its connection, polled with GET, a stream resumed with
`starting_after` (from this process's run and, as another API server process does, from the
store), cancel freeing the slot, API-key scopes, the lowest priority, and the marking of runs
whose process stopped (killed: after the lease; stopping: at once)."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from deepinfer_server.api.transport import HTTP_PROTOCOL
from deepinfer_server.coordinator.handle import RequestHandle
from deepinfer_server.errors import ServiceFailedError
from deepinfer_server.ipc.messages import Finish, GeneratedTokens
from deepinfer_server.metrics import ServerMetrics
from deepinfer_server.protocol.core.validation import PRIORITY_MAX
from deepinfer_server.services import background, background_runs
from deepinfer_server.services.background import BackgroundRun
from deepinfer_server.services.background_runs import BackgroundRuns, cancel, resume
from deepinfer_server.store.location import open_store
from deepinfer_server.store.records import NewResponse
from tests.http.harness import MODEL, Harness, Script, listening
from tests.http.test_stored_responses import KEY_A, KEY_B, run_stored

TEXT = "The answer, in several words, comes back in pieces"


@asynccontextmanager
async def live(h: Harness) -> AsyncIterator[openai.AsyncOpenAI]:
    """The official client on real uvicorn over loopback: a stream arrives as it is written
    (the in-process transport hands a body over only once it is complete)."""
    async with listening(h, HTTP_PROTOCOL) as port:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0
        )
        async with client:
            yield client


def _held(h: Harness) -> RequestHandle:
    (handle,) = h.coordinator.handles.values()
    return handle


def _run(h: Harness, response_id: str) -> BackgroundRun:
    runs = h.state.background_runs
    assert runs is not None
    return runs.runs[response_id]


def _deliver(h: Harness, handle: RequestHandle, text: str, finish: Finish | None) -> None:
    """The engine's next step for `handle`: `text`'s tokens, then `finish` (None: more to come)."""
    if handle.cached_tokens is None:
        handle.started(0)
    ids = list(h.state.recipe.tokenizer.encode(text))
    handle.deliver(GeneratedTokens(ids), finish, time.perf_counter(), 0.001)
    handle.flush()


def _answer(h: Harness, handle: RequestHandle, text: str = TEXT) -> None:
    """The whole answer (after `</think>`: the default thinking mode), in two steps."""
    _deliver(h, handle, "Thinking.</think>" + text[:10], None)
    _deliver(h, handle, text[10:], Finish.STOP)


def _events(frames: list[str]) -> list[dict[str, Any]]:
    return [orjson.loads(frame.split("data: ", 1)[1]) for frame in frames]


def test_a_background_response_is_queued_then_polled_to_completion(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        async with h.openai() as client:
            created = await client.responses.create(model=MODEL, input="Hi", background=True)
            assert created.status == "queued" and created.background is True
            assert created.store is True and created.output == []
            polled = await client.responses.retrieve(created.id)
            assert polled.status == "queued"
            handle = _held(h)
            # Work that waits for nothing goes after every other request of its key.
            assert h.coordinator.placement[handle.request_id][1] == PRIORITY_MAX
            _deliver(h, handle, "Thinking.</think>Partial", None)
            await _run(h, created.id).wait_written()
            assert (await client.responses.retrieve(created.id)).status == "in_progress"
            _deliver(h, handle, " answer", Finish.STOP)
            await _run(h, created.id).wait()
            done = await client.responses.retrieve(created.id)
            assert done.status == "completed" and done.background is True
            assert done.output_text == "Partial answer"
            # Its output items are stored like any response's (a next turn continues it).
            h.coordinator.script = Script()
            follow = await client.responses.create(
                model=MODEL, input="And?", previous_response_id=created.id
            )
            assert follow.status == "completed"

    run_stored(tmp_path, test, script=Script(hold=True))


def test_a_background_stream_survives_its_client_and_resumes_without_gap(
    tmp_path: Path,
) -> None:
    async def test(h: Harness) -> None:
        async with live(h) as client:
            stream = await client.responses.create(
                model=MODEL, input="Hi", background=True, stream=True
            )
            handle = await _first_handle(h)
            _deliver(h, handle, "Thinking.</think>" + TEXT[:10], None)
            seen = []
            async for event in stream:
                seen.append(event)
                if event.type == "response.output_text.delta":
                    break
            await stream.close()  # the client leaves mid-answer
            response_id = seen[0].response.id  # type: ignore[union-attr]
            assert seen[0].type == "response.created"
            assert seen[0].response.status == "queued"  # type: ignore[union-attr]
            assert seen[0].response.background is True  # type: ignore[union-attr]
            assert seen[1].response.status == "in_progress"  # type: ignore[union-attr]
            assert not h.coordinator.closed  # the generation goes on
            _deliver(h, handle, TEXT[10:], Finish.STOP)
            await _run(h, response_id).wait()
            after = seen[-1].sequence_number
            resumed = await client.responses.retrieve(
                response_id, stream=True, starting_after=after
            )
            rest = [event async for event in resumed]
        numbers = [event.sequence_number for event in seen + rest]
        assert numbers == list(range(len(numbers)))  # no gap, no duplicate
        assert rest[-1].type == "response.completed"
        deltas = [e.delta for e in seen + rest if e.type == "response.output_text.delta"]
        assert "".join(deltas) == TEXT

    run_stored(tmp_path, test, script=Script(hold=True))


async def _first_handle(h: Harness) -> RequestHandle:
    await h.coordinator.wait_admitted()
    return _held(h)


def test_another_process_follows_a_running_stream_from_the_store(tmp_path: Path) -> None:
    """Another API server process (a second connection to the store, no run of its own)
    replays the stored events and follows the rest until the terminal event."""

    async def test(h: Harness) -> None:
        other_store = open_store(
            f"sqlite://{tmp_path / 'responses.sqlite3'}", ttl=3600, max_bytes=2**30
        )
        await other_store.open()
        try:
            async with live(h) as client:
                stream = await client.responses.create(
                    model=MODEL, input="Hi", background=True, stream=True
                )
                await stream.close()
                handle = await _first_handle(h)
                response_id = next(iter(h.state.background_runs.runs))  # type: ignore[union-attr]
                run = _run(h, response_id)
                _deliver(h, handle, "Thinking.</think>" + TEXT[:10], None)
                await run.wait_written()
                other = BackgroundRuns(other_store, ServerMetrics(MODEL))
                scope = run.scope
                frames = resume(other, scope, response_id, 1)
                first = [await anext(frames)]  # from the store, while the run goes on
                _deliver(h, handle, TEXT[10:], Finish.STOP)
                rest = [frame async for frame in frames]
        finally:
            await other_store.close()
        events = _events(first + rest)
        assert [e["sequence_number"] for e in events] == list(range(2, 2 + len(events)))
        assert events[-1]["type"] == "response.completed"
        assert events[-1]["response"]["output"][-1]["content"][0]["text"] == TEXT

    run_stored(tmp_path, test, script=Script(hold=True))


def test_cancel_stops_the_generation_and_frees_its_slot(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        async with h.openai() as client:
            created = await client.responses.create(model=MODEL, input="Hi", background=True)
            request_id = _held(h).request_id
            cancelled = await client.responses.cancel(created.id)
            assert cancelled.status == "cancelled"
            assert h.coordinator.num_in_flight == 0  # the slot is free
            assert [c[0] for c in h.coordinator.closed] == [request_id]
            assert (await client.responses.retrieve(created.id)).status == "cancelled"
            again = await client.responses.cancel(created.id)  # idempotent
            assert again.model_dump() == cancelled.model_dump()
            metrics = h.metrics.exposition().decode()
            assert 'background_responses_finished_total{model_name="' in metrics
            assert 'status="cancelled"} 1.0' in metrics

    run_stored(tmp_path, test, script=Script(hold=True))


def test_cancel_of_a_finished_or_foreground_response(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        async with h.openai() as client:
            created = await client.responses.create(model=MODEL, input="Hi", background=True)
            await _run(h, created.id).wait()
            done = await client.responses.retrieve(created.id)
            assert done.status == "completed"
            unchanged = await client.responses.cancel(created.id)
            assert unchanged.model_dump() == done.model_dump()
            with pytest.raises(openai.BadRequestError, match="not created with `stream: true`"):
                await client.responses.retrieve(created.id, stream=True)
            foreground = await client.responses.create(model=MODEL, input="Hi")
            with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous"):
                await client.responses.cancel(foreground.id)
            with pytest.raises(openai.BadRequestError, match="only a background response"):
                await client.responses.retrieve(foreground.id, stream=True)

    run_stored(tmp_path, test)


def test_another_keys_get_and_cancel_are_404(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        async with h.openai(KEY_A) as mine, h.openai(KEY_B) as theirs:
            created = await mine.responses.create(model=MODEL, input="Hi", background=True)
            for call in (
                theirs.responses.retrieve(created.id),
                theirs.responses.cancel(created.id),
            ):
                with pytest.raises(openai.NotFoundError):
                    await call
            with pytest.raises(openai.NotFoundError):
                await theirs.responses.retrieve(created.id, stream=True, starting_after=0)
            assert h.coordinator.num_in_flight == 1  # still running
            await mine.responses.cancel(created.id)

    run_stored(tmp_path, test, "--api-key", KEY_A, "--api-key", KEY_B, script=Script(hold=True))


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"store": False}, "store"), ({"priority": 5}, "priority")],
)
def test_background_refusals(tmp_path: Path, extra: dict[str, Any], param: str) -> None:
    async def test(h: Harness) -> None:
        body = {"model": MODEL, "input": "Hi", "background": True, **extra}
        reply = await h.client.post("/v1/responses", json=body)
        assert reply.status_code == 400
        assert reply.json()["error"]["param"] == param
        assert h.coordinator.num_in_flight == 0

    run_stored(tmp_path, test)


def test_a_run_whose_process_died_is_marked_failed(tmp_path: Path) -> None:
    """A run its process stopped renewing (kill -9) is marked failed by the first process
    that reads it once the lease has passed, and a resumed stream ends with the failure."""

    async def test(h: Harness) -> None:
        store = h.state.store
        assert store is not None
        body = {
            "id": "resp_dead",
            "object": "response",
            "created_at": 1,
            "model": MODEL,
            "status": "in_progress",
            "background": True,
            "output": [],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
        }
        await store.start_background(
            NewResponse("resp_dead", "none", time.time(), body, []), "a-killed-process"
        )
        created = {**body, "status": "in_progress"}
        event = {"type": "response.created", "response": created, "sequence_number": 0}
        frame = f"event: response.created\ndata: {orjson.dumps(event).decode()}\n\n"
        await store.record_progress("resp_dead", None, [(0, frame)])
        async with h.openai() as client:
            # Renewed recently: still running as far as anyone can tell.
            assert (await client.responses.retrieve("resp_dead")).status == "in_progress"
            with sqlite3.connect(tmp_path / "responses.sqlite3") as db:
                db.execute(
                    "UPDATE background_runs SET heartbeat_at = ?",
                    (time.time() - background_runs.LEASE - 1,),
                )
            failed = await client.responses.retrieve("resp_dead")
            assert failed.status == "failed" and failed.error is not None
            assert failed.error.code == "server_error"
            assert "stopped" in failed.error.message
            events = [
                e
                async for e in await client.responses.retrieve(
                    "resp_dead", stream=True, starting_after=-1
                )
            ]
        assert [(e.type, e.sequence_number) for e in events] == [
            ("response.created", 0),
            ("response.failed", 1),
        ]

    run_stored(tmp_path, test)


def test_runs_left_at_shutdown_are_marked_failed(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        runs = h.state.background_runs
        assert runs is not None
        async with h.openai() as client:
            created = await client.responses.create(model=MODEL, input="Hi", background=True)
            assert runs.counts() == {"queued": 1, "in_progress": 0}
            assert 'status="queued"} 1.0' in h.metrics.exposition().decode()
            await runs.stop()
            assert h.coordinator.num_in_flight == 0
            failed = await client.responses.retrieve(created.id)
        assert failed.status == "failed" and failed.error is not None
        assert failed.error.message == background.SHUTDOWN_MESSAGE
        assert runs.counts() == {"queued": 0, "in_progress": 0}

    run_stored(tmp_path, test, script=Script(hold=True))


def test_a_cancel_reaches_the_process_that_runs_the_response(tmp_path: Path) -> None:
    """Another API server process (its own store connection and runs) asks through the store;
    the running process cancels at its next heartbeat, and the answer waits for that."""

    async def test(h: Harness) -> None:
        other_store = open_store(
            f"sqlite://{tmp_path / 'responses.sqlite3'}", ttl=3600, max_bytes=2**30
        )
        await other_store.open()
        try:
            async with h.openai() as client:
                created = await client.responses.create(model=MODEL, input="Hi", background=True)
                other = BackgroundRuns(other_store, ServerMetrics(MODEL))
                body = await cancel(other, _run(h, created.id).scope, created.id)
        finally:
            await other_store.close()
        assert body is not None and body["status"] == "cancelled"
        assert h.coordinator.num_in_flight == 0

    run_stored(tmp_path, test, script=Script(hold=True))


def test_a_failure_of_the_generation_is_the_responses(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        async with h.openai() as client:
            created = await client.responses.create(model=MODEL, input="Hi", background=True)
            await _run(h, created.id).wait()
            failed = await client.responses.retrieve(created.id)
        assert failed.status == "failed" and failed.error is not None
        assert failed.error.code == "server_error"
        assert "rank 0 died" in failed.error.message
        metrics = h.metrics.exposition().decode()
        assert (
            'background_responses_finished_total{model_name="' + MODEL + '",status="failed"} 1.0'
            in metrics
        )

    run_stored(tmp_path, test, script=Script(error=ServiceFailedError("rank 0 died")))


def test_deleting_a_running_response_stops_its_generation(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        runs = h.state.background_runs
        assert runs is not None
        async with h.openai() as client:
            created = await client.responses.create(model=MODEL, input="Hi", background=True)
            run = _run(h, created.id)
            await client.responses.delete(created.id)
            await runs.renew()  # the heartbeat: its run is gone from the store
            await run.wait()
            assert h.coordinator.num_in_flight == 0
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(created.id)

    run_stored(tmp_path, test, script=Script(hold=True))


def test_reasoning_blobs_are_not_stored_but_sealed_on_reading(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        store = h.state.store
        assert store is not None
        async with h.openai() as client:
            created = await client.responses.create(
                model=MODEL,
                input="Hi",
                background=True,
                include=["reasoning.encrypted_content"],
            )
            await _run(h, created.id).wait()
            stored = await store.response("none", created.id)
            read = await client.responses.retrieve(
                created.id, include=["reasoning.encrypted_content"]
            )
        assert stored is not None
        (reasoning,) = [i for i in stored.body["output"] if i["type"] == "reasoning"]
        assert reasoning["encrypted_content"] is None
        (sealed,) = [i for i in read.output if i.type == "reasoning"]
        assert sealed.encrypted_content  # type: ignore[union-attr]

    run_stored(tmp_path, test)


@pytest.mark.parametrize("after", [str(2**63), "99999999999999999999999", "-2", "1.5", "x"])
def test_a_starting_after_out_of_range_is_a_400_naming_it(tmp_path: Path, after: str) -> None:
    async def test(h: Harness) -> None:
        body = {"model": MODEL, "input": "Hi", "background": True, "stream": True}
        created = await h.client.post("/v1/responses", json=body)
        assert created.status_code == 200
        response_id = _events(created.text.split("\n\n")[:1])[0]["response"]["id"]
        reply = await h.client.get(
            f"/v1/responses/{response_id}", params={"stream": "true", "starting_after": after}
        )
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert error["param"] == "starting_after"
        assert error["type"] == "invalid_request_error"
        last = await h.client.get(
            f"/v1/responses/{response_id}",
            params={"stream": "true", "starting_after": str(2**63 - 1)},
        )
        assert last.status_code == 200

    run_stored(tmp_path, test)
