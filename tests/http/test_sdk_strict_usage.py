"""Every body the server answers validates against the official SDKs' own types, strictly
(`model_validate`, as openai-python's batch readers and inspect-ai do, not the lenient
`construct` the SDKs' own calls use): Responses non-streamed, streamed (`response.completed`),
stored (one stored by an earlier release without the field too) and polled (background), and a
batch's output lines; Chat Completions and Anthropic Messages too, and every streamed event of
the three. openai-python 3.63's
`ResponseUsage` requires `input_tokens_details.cache_write_tokens`."""

from __future__ import annotations

import asyncio
import copy
import io
import time
from pathlib import Path
from typing import Any

import orjson
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from deepinfer_server.store.records import NewResponse
from tests.http.harness import MODEL, Harness, Script, run, serve
from tests.http.test_stored_responses import run_stored

CACHED = 3
SCRIPT = Script(text="Hi.", cached_tokens=CACHED)
RESPONSES: Any = {"model": MODEL, "input": "hello"}


def _valid_response(body: Any) -> Response:
    response = Response.model_validate(body, strict=True)
    assert response.usage is not None
    assert response.usage.input_tokens_details.cached_tokens == CACHED
    assert response.usage.input_tokens_details.cache_write_tokens == 0
    return response


def test_responses_bodies_validate_non_streamed_and_streamed() -> None:
    async def body() -> None:
        async with serve(script=SCRIPT) as h:
            answer = await h.client.post("/v1/responses", json=RESPONSES)
            assert answer.status_code == 200
            assert _valid_response(answer.json()).output_text == "Hi."
            async with h.client.stream(
                "POST", "/v1/responses", json={**RESPONSES, "stream": True}
            ) as stream:
                events = [event async for event in _events(stream)]
            (completed,) = [e for e in events if e["type"] == "response.completed"]
            _valid_response(completed["response"])

    run(body)


async def _events(stream: Any) -> Any:
    """Each event's data, but Chat's `[DONE]` and Anthropic's `ping` (which the SDKs drop)."""
    async for line in stream.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = orjson.loads(line[6:])
            if event.get("type") != "ping":
                yield event


def test_stored_background_and_batch_responses_validate(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        created = (await h.client.post("/v1/responses", json=RESPONSES)).json()
        stored = await h.client.get(f"/v1/responses/{created['id']}")
        _valid_response(stored.json())
        queued = await h.client.post("/v1/responses", json={**RESPONSES, "background": True})
        Response.model_validate(queued.json(), strict=True)
        runs = h.state.background_runs
        assert runs is not None
        await runs.runs[queued.json()["id"]].wait()
        polled = await h.client.get(f"/v1/responses/{queued.json()['id']}")
        assert polled.json()["status"] == "completed"
        _valid_response(polled.json())
        for line in await _batch_output(h):
            _valid_response(line["response"]["body"])
        # One stored by an earlier release, without cache_write_tokens, reads back complete.
        older = copy.deepcopy(stored.json())
        del older["usage"]["input_tokens_details"]["cache_write_tokens"]
        older["id"] = "resp_older"
        assert h.state.store is not None
        await h.state.store.save(NewResponse("resp_older", "none", time.time(), older, []))
        _valid_response((await h.client.get("/v1/responses/resp_older")).json())

    run_stored(tmp_path, test, script=SCRIPT)


async def _batch_output(h: Harness) -> list[Any]:
    """The output lines of a batch of two Responses requests, run to its end."""
    async with h.openai() as client:
        lines = [
            {"custom_id": f"r{n}", "method": "POST", "url": "/v1/responses", "body": RESPONSES}
            for n in range(2)
        ]
        content = b"".join(orjson.dumps(line) + b"\n" for line in lines)
        file = await client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
        batch = await client.batches.create(
            input_file_id=file.id, endpoint="/v1/responses", completion_window="24h"
        )
        while batch.status != "completed":
            assert batch.status in ("validating", "in_progress", "finalizing")
            await asyncio.sleep(0.02)
            batch = await client.batches.retrieve(batch.id)
        assert batch.output_file_id is not None
        output = await client.files.content(batch.output_file_id)
    found = [orjson.loads(line) for line in output.text.splitlines()]
    assert len(found) == 2
    return found


def test_chat_and_messages_bodies_validate() -> None:
    async def body() -> None:
        async with serve(script=SCRIPT) as h:
            chat = await h.client.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hello"}]},
            )
            completion = ChatCompletion.model_validate(chat.json(), strict=True)
            assert completion.usage is not None and completion.usage.prompt_tokens_details
            assert completion.usage.prompt_tokens_details.cached_tokens == CACHED
            messages = await h.client.post(
                "/v1/messages",
                json={
                    "model": MODEL,
                    "max_tokens": 64,
                    "messages": [{"role": "user", "content": "hello"}],
                },
            )
            message = Message.model_validate(messages.json(), strict=True)
            assert message.usage.cache_read_input_tokens == CACHED
            assert message.usage.cache_creation_input_tokens == 0

    run(body)


STREAMS: list[tuple[str, Any, Any]] = [
    ("/v1/responses", {"input": "hello"}, ResponseStreamEvent),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hello"}],
            "stream_options": {"include_usage": True},
        },
        ChatCompletionChunk,
    ),
    (
        "/v1/messages",
        {"max_tokens": 64, "messages": [{"role": "user", "content": "hello"}]},
        RawMessageStreamEvent,
    ),
]


def test_every_streamed_event_validates() -> None:
    async def body() -> None:
        async with serve(script=SCRIPT) as h:
            for path, fields, event_type in STREAMS:
                adapter: Any = TypeAdapter(event_type)
                async with h.client.stream(
                    "POST", path, json={"model": MODEL, "stream": True, **fields}
                ) as stream:
                    events = [event async for event in _events(stream)]
                assert len(events) > 3
                for event in events:
                    adapter.validate_python(event, strict=True)

    run(body)
