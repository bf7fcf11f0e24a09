"""Anthropic's Message Batches in-process with the official anthropic client: created, polled
to `ended`, results in Anthropic's shape (succeeded and errored), cancel, delete, list and
API-key scopes, on the runner and tables of OpenAI's Batches."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import anthropic
import pytest

from deepinfer_server.protocol.core.validation import PRIORITY_MAX
from tests.http.harness import MODEL, Harness, Script, client_http
from tests.http.test_stored_responses import KEY_A, KEY_B, run_stored
from tests.loop_lag import LoopLag

KEYS = ("--api-key", KEY_A, "--api-key", KEY_B)


def _client(h: Harness, key: str) -> anthropic.AsyncAnthropic:
    http = client_http.AsyncClient(transport=client_http.ASGITransport(app=h.app))
    return anthropic.AsyncAnthropic(
        base_url="http://test", api_key=key, http_client=http, max_retries=0
    )


def _params(text: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 64,
        "messages": [{"role": "user", "content": text}],
        **extra,
    }


async def _ended(client: anthropic.AsyncAnthropic, batch_id: str) -> Any:
    """Poll the batch (as a client does) until it has ended."""
    while True:
        batch = await client.messages.batches.retrieve(batch_id)
        if batch.processing_status == "ended":
            return batch
        await asyncio.sleep(0.02)


def test_a_message_batch_is_answered_and_its_results_read_with_the_sdk(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        async with _client(h, KEY_A) as client:
            created = await client.messages.batches.create(
                requests=[
                    {"custom_id": "hello", "params": _params("Hello")},  # type: ignore[list-item, typeddict-item]
                    {"custom_id": "bad", "params": _params("Hi", max_tokens=0)},  # type: ignore[list-item, typeddict-item]
                    {"custom_id": "streamed", "params": _params("Hi", stream=True)},  # type: ignore[list-item, typeddict-item]
                ]
            )
            assert created.id.startswith("msgbatch_") and created.type == "message_batch"
            assert created.processing_status == "in_progress"
            batch = await _ended(client, created.id)
            counts = batch.request_counts
            assert (counts.succeeded, counts.errored, counts.processing) == (1, 2, 0)
            assert batch.ended_at is not None and batch.results_url is not None
            results = {
                r.custom_id: r.result
                async for r in await client.messages.batches.results(created.id)
            }
            assert [r.model_dump()["type"] for r in results.values()] == [
                "succeeded",
                "errored",
                "errored",
            ]
            message = results["hello"].message  # type: ignore[union-attr]
            assert message.content[0].text == "Batched answer"  # type: ignore[union-attr]
            error = results["bad"].error  # type: ignore[union-attr]
            assert error.type == "error" and error.error.type == "invalid_request_error"
            assert "stream" in results["streamed"].error.error.message  # type: ignore[union-attr]
            listed = [b.id async for b in client.messages.batches.list()]
            assert listed == [created.id]
            deleted = await client.messages.batches.delete(created.id)
            assert deleted.id == created.id and deleted.type == "message_batch_deleted"
            with pytest.raises(anthropic.NotFoundError):
                await client.messages.batches.retrieve(created.id)
        placements = list(h.coordinator.placement.values())
        assert len(placements) == 1 and placements[0][1] == PRIORITY_MAX

    run_stored(tmp_path, test, *KEYS, script=Script("Batched answer"))


def test_a_cancelled_message_batch_ends_with_its_requests_canceled(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        async with _client(h, KEY_A) as client, _client(h, KEY_B) as other:
            created = await client.messages.batches.create(
                requests=[
                    {"custom_id": f"n{i}", "params": _params(str(i))}  # type: ignore[typeddict-item]
                    for i in range(3)
                ]
            )
            await h.coordinator.wait_admitted(1)  # --batch-concurrency 1
            with pytest.raises(anthropic.NotFoundError):
                await other.messages.batches.cancel(created.id)
            with pytest.raises(anthropic.BadRequestError):  # still processing
                await client.messages.batches.delete(created.id)
            canceling = await client.messages.batches.cancel(created.id)
            assert canceling.processing_status in ("canceling", "ended")
            assert canceling.cancel_initiated_at is not None
            batch = await _ended(client, created.id)
            assert batch.request_counts.canceled == 3
            results = [r async for r in await client.messages.batches.results(created.id)]
            assert [r.result.type for r in results] == ["canceled"] * 3
        assert h.coordinator.handles == {}  # the running request's slot freed

    run_stored(tmp_path, test, *KEYS, "--batch-concurrency", "1", script=Script(hold=True))


def test_a_message_batch_request_is_refused_whole_when_it_cannot_be_told_apart(
    tmp_path: Path,
) -> None:
    async def test(h: Harness) -> None:
        async with _client(h, KEY_A) as client:
            for requests in (
                [],
                [{"custom_id": "same", "params": _params("a")}] * 2,
                [{"custom_id": "has space", "params": _params("a")}],
                [{"custom_id": "no-params"}],
            ):
                with pytest.raises(anthropic.BadRequestError):
                    await client.messages.batches.create(requests=requests)  # type: ignore[arg-type]
            assert [b.id async for b in client.messages.batches.list()] == []

    run_stored(tmp_path, test, *KEYS)


def test_a_request_of_too_many_requests_is_refused_without_holding_the_event_loop(
    tmp_path: Path,
) -> None:
    """Over a hundred thousand requests: read one at a time off the loop, refused at the first
    past --batch-max-lines, while the loop keeps serving (another key's models)."""
    one = b'{"custom_id":"r%06d","params":{}}'
    raw = b'{"requests":[' + b",".join(one % i for i in range(110_000)) + b"]}"

    async def test(h: Harness) -> None:
        async with LoopLag() as lag:
            answer = await h.client.post(
                "/v1/messages/batches",
                content=raw,
                headers={"x-api-key": KEY_A, "content-type": "application/json"},
            )
            models = await h.client.get("/v1/models", headers={"x-api-key": KEY_B})
        lag.check()
        assert answer.status_code == 400, answer.text
        assert answer.json() == {
            "type": "error",
            "error": {
                "type": "invalid_request_error",
                "message": "more than 1000 requests; a batch has at most 1000 (--batch-max-lines)",
            },
        }
        assert models.status_code == 200
        async with _client(h, KEY_A) as client:
            assert [b.id async for b in client.messages.batches.list()] == []

    run_stored(tmp_path, test, *KEYS, "--batch-max-file-mb", "8", "--batch-max-lines", "1000")
