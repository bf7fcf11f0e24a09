"""The store quota over HTTP: a key's files and batches past its store cap are refused with a
413 in each protocol's shape (OpenAI's on /v1/files and /v1/batches, Anthropic's on
/v1/messages/batches), with nothing stored or evicted, other keys unaffected, and a key's files
past --files-key-max-count refused the same way."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import openai
import pytest

from deepinfer_server.store.location import open_store
from tests.http.harness import MODEL, Harness, Script, run, serve
from tests.http.test_batches import CHAT, KEYS, _chat, _line, _upload, _user
from tests.http.test_stored_responses import KEY_A, KEY_B


def test_one_keys_files_past_its_store_cap_are_refused_and_other_keys_are_unaffected(
    tmp_path: Path,
) -> None:
    async def test(h: Harness) -> None:
        async with h.openai(KEY_A) as a, h.openai(KEY_B) as b:
            kept = await a.files.create(
                file=("a.jsonl", io.BytesIO(b"a" * 600_000)), purpose="batch"
            )
            for size, told in ((600_000, "the file"), (500_000, "the file of 500000 bytes")):
                with pytest.raises(openai.APIStatusError) as full:
                    await a.files.create(file=("x.jsonl", io.BytesIO(b"x" * size)), purpose="batch")
                assert full.value.status_code == 413
                error = full.value.body
                assert isinstance(error, dict) and error["code"] == "file_storage_full"
                assert error["param"] == "file"
                assert error["message"].startswith(f"{told} does not fit in this API key's file")
                assert "--response-store-key-max-mb" in error["message"]
            assert [f.id async for f in a.files.list()] == [kept.id]  # nothing evicted
            assert (await a.files.content(kept.id)).content == b"a" * 600_000
            other = await b.files.create(
                file=("b.jsonl", io.BytesIO(b"b" * 600_000)), purpose="batch"
            )
            assert other.bytes == 600_000
            stored = await b.responses.create(model=MODEL, input="still stored")
            assert (await b.responses.retrieve(stored.id)).id == stored.id
            await a.files.delete(kept.id)  # room again once the key deletes its files
            await a.files.create(file=("c.jsonl", io.BytesIO(b"c" * 600_000)), purpose="batch")

    _run_capped(tmp_path, test)


def test_a_batch_or_a_file_past_the_keys_store_quota_is_refused_in_each_protocols_shape(
    tmp_path: Path,
) -> None:
    async def test(h: Harness) -> None:
        async with h.openai(KEY_A) as a:
            await a.files.create(file=("a.jsonl", io.BytesIO(b"a" * 600_000)), purpose="batch")
            big = _line("n", _chat("x" * 300_000))
            source = await _upload(a, [big])  # fits: 900 KB of files
            with pytest.raises(openai.APIStatusError) as full:
                await a.batches.create(input_file_id=source, endpoint=CHAT, completion_window="24h")
            assert full.value.status_code == 413
            error = full.value.body
            assert isinstance(error, dict) and error["code"] == "batch_storage_full"
            assert error["param"] == "input_file_id"
            assert error["message"].startswith("the batch does not fit in this API key's")
            assert [b async for b in a.batches.list()] == []  # nothing of it stored
            # A third file is past --files-key-max-count 2, however small.
            with pytest.raises(openai.APIStatusError) as many:
                await a.files.create(file=("c.jsonl", io.BytesIO(b"{}")), purpose="batch")
            assert many.value.status_code == 413
            assert isinstance(many.value.body, dict)
            assert many.value.body["code"] == "file_storage_full"
            assert "--files-key-max-count" in many.value.body["message"]
        params = {"model": MODEL, "max_tokens": 8, "messages": [_user("y" * 300_000)]}
        answer = await h.client.post(  # Anthropic's Message Batches: the same quota
            "/v1/messages/batches",
            json={"requests": [{"custom_id": "n", "params": params}]},
            headers={"x-api-key": KEY_A, "anthropic-version": "2023-06-01"},
        )
        assert answer.status_code == 413, answer.text
        body = answer.json()
        assert body["type"] == "error" and body["error"]["type"] == "request_too_large"
        assert body["error"]["message"].startswith("the batch does not fit in this API key's")
        listed = await h.client.get("/v1/messages/batches", headers={"x-api-key": KEY_A})
        assert listed.json()["data"] == []

    _run_capped(tmp_path, test, scope_max_files=2)


def _run_capped(
    tmp_path: Path, test: Callable[[Harness], Awaitable[None]], scope_max_files: int = 10_000
) -> None:
    async def body() -> None:
        # The harness's store, with the caps --response-store-key-max-mb 1 and
        # --response-store-max-mb 4 give it.
        store = open_store(
            f"sqlite://{tmp_path / 'responses.sqlite3'}",
            ttl=3600,
            max_bytes=4 * 1024 * 1024,
            scope_max_bytes=1024 * 1024,
            scope_max_files=scope_max_files,
        )
        await store.open()
        try:
            async with serve(*KEYS, script=Script("Stored answer"), store=store) as harness:
                await test(harness)
        finally:
            await store.close()

    run(body)


def test_a_message_batch_of_a_key_at_its_store_cap_is_refused_before_its_body_is_read(
    tmp_path: Path,
) -> None:
    """A key whose files fill its cap: its next Message Batch is refused at once, without
    the server reading (and holding) a body of up to --batch-max-file-mb first."""
    chunks_read = 0

    async def body_chunks() -> AsyncIterator[bytes]:
        nonlocal chunks_read
        params = {"model": MODEL, "max_tokens": 8, "messages": [_user("hi")]}
        chunks_read += 1
        yield b'{"requests": [' + json.dumps({"custom_id": "0", "params": params}).encode()
        for index in range(1, 200):
            chunks_read += 1
            yield b", " + json.dumps({"custom_id": str(index), "params": params}).encode()
        yield b"]}"

    async def test(h: Harness) -> None:
        async with h.openai(KEY_A) as a:
            await a.files.create(file=("a.jsonl", io.BytesIO(b"a" * 1024 * 1024)), purpose="batch")
        answer = await h.client.post(
            "/v1/messages/batches",
            content=body_chunks(),
            headers={
                "x-api-key": KEY_A,
                "anthropic-version": "2023-06-01",
                "content-type": "application/json",
            },
        )
        assert answer.status_code == 413, answer.text
        assert answer.json()["error"]["type"] == "request_too_large"
        assert answer.json()["error"]["message"].startswith("the batch does not fit")
        assert chunks_read <= 1  # the transport may hand over the first chunk; no more

    _run_capped(tmp_path, test)
