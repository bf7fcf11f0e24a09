"""OpenAI's Files and Batches in-process with the official openai client: a batch's lines
answered through the live endpoints at the lowest priority, its output and error files in
OpenAI's line format, malformed lines in the error file, API-key scopes, cancel freeing the
slots, the limits, and a batch resumed by another process without a line answered twice."""

from __future__ import annotations

import asyncio
import io
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anthropic
import openai
import orjson
import pytest

from deepinfer_server.coordinator.handle import RequestHandle
from deepinfer_server.ipc.messages import Finish, GeneratedTokens
from deepinfer_server.metrics import ServerMetrics
from deepinfer_server.protocol.core.validation import PRIORITY_MAX
from deepinfer_server.services.batch_runner import BatchRunner
from deepinfer_server.store.batches import BatchStore
from tests.http.harness import MODEL, Harness, Script, client_http
from tests.http.test_stored_responses import KEY_A, KEY_B, run_stored
from tests.loop_lag import LoopLag

CHAT = "/v1/chat/completions"
KEYS = ("--api-key", KEY_A, "--api-key", KEY_B)


def _line(custom_id: str, body: dict[str, Any], url: str = CHAT) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _chat(text: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": [_user(text)]}


def _jsonl(lines: list[Any]) -> bytes:
    return b"".join(
        (line if isinstance(line, bytes) else orjson.dumps(line)) + b"\n" for line in lines
    )


async def _upload(client: openai.AsyncOpenAI, lines: list[Any]) -> str:
    file = await client.files.create(
        file=("input.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch"
    )
    return file.id


async def _until(
    client: openai.AsyncOpenAI, batch_id: str, statuses: tuple[str, ...]
) -> openai.types.Batch:
    """Poll the batch (as a client does) until it reaches one of `statuses`."""
    while True:
        batch = await client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        await asyncio.sleep(0.02)


async def _content(client: openai.AsyncOpenAI, file_id: str) -> list[dict[str, Any]]:
    content = await client.files.content(file_id)
    return [orjson.loads(line) for line in content.text.splitlines()]


def _answer(h: Harness, handle: RequestHandle, text: str) -> None:
    """The engine's whole answer for a held request: `text`, then a stop."""
    handle.started(0)
    ids = list(h.state.recipe.tokenizer.encode("Thinking.</think>" + text))
    handle.deliver(GeneratedTokens(ids), Finish.STOP, time.perf_counter(), 0.001)
    handle.flush()


def _samples(metrics: ServerMetrics, name: str) -> dict[str, float]:
    """A counter's samples by their one label besides the model's."""
    found = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name == name:
                (label,) = (v for k, v in sample.labels.items() if k != "model_name")
                found[label] = sample.value
    return found


def test_a_batch_runs_every_line_through_the_endpoint_at_the_lowest_priority(
    tmp_path: Path,
) -> None:
    async def test(h: Harness) -> None:
        async with h.openai(KEY_A) as client:
            file_id = await _upload(
                client,
                [
                    _line("first", _chat("one")),
                    b"{not json",
                    _line("second", _chat("two")),
                    _line("too-long", {**_chat("three"), "max_tokens": 0}),
                    _line("elsewhere", _chat("four"), url="/v1/completions"),
                ],
            )
            created = await client.batches.create(
                input_file_id=file_id,
                endpoint=CHAT,
                completion_window="24h",
                metadata={"run": "nightly"},
            )
            assert created.status in ("validating", "in_progress")
            done = await _until(client, created.id, ("completed",))
        assert done.request_counts is not None
        assert done.request_counts.model_dump() == {"total": 5, "completed": 2, "failed": 3}
        assert done.metadata == {"run": "nightly"}
        assert done.completed_at is not None and done.output_file_id and done.error_file_id
        async with h.openai(KEY_A) as client:
            output = await _content(client, done.output_file_id)
            errors = await _content(client, done.error_file_id)
        assert [line["custom_id"] for line in output] == ["first", "second"]
        for line in output:
            assert line["error"] is None and line["id"].startswith("batch_req_")
            response = line["response"]
            assert response["status_code"] == 200
            assert response["body"]["object"] == "chat.completion"
            assert response["body"]["choices"][0]["message"]["content"] == "Batched answer"
            assert response["request_id"] == f"{done.id}-{0 if line['custom_id'] == 'first' else 2}"
        by_id = {line["custom_id"]: line for line in errors}
        assert by_id["line-2"]["response"] is None
        assert "not valid JSON" in by_id["line-2"]["error"]["message"]
        assert by_id["too-long"]["response"]["status_code"] == 400
        assert "max_tokens" in by_id["too-long"]["response"]["body"]["error"]["message"]
        assert "endpoint" in by_id["elsewhere"]["error"]["message"]
        assert _samples(h.metrics, "deepinfer:batch_lines_finished_total") == {
            "succeeded": 2.0,
            "errored": 1.0,  # a 400 of the endpoint's; malformed lines never ran
            "retried": 0.0,
        }
        assert _samples(h.metrics, "deepinfer:batches_finished_total")["completed"] == 1.0
        # Every line that reached the engine went at the lowest priority.
        placements = list(h.coordinator.placement.values())
        assert len(placements) == 2
        assert all(priority == PRIORITY_MAX for _, priority in placements)

    run_stored(tmp_path, test, *KEYS, script=Script("Batched answer"))


def test_files_and_batches_are_scoped_by_api_key_and_listed(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        async with h.openai(KEY_A) as a, h.openai(KEY_B) as b:
            file_id = await _upload(a, [_line("only", _chat("hi"))])
            batch = await a.batches.create(
                input_file_id=file_id, endpoint=CHAT, completion_window="24h"
            )
            for call in (
                b.files.retrieve(file_id),
                b.files.content(file_id),
                b.batches.retrieve(batch.id),
                b.batches.cancel(batch.id),
                b.files.delete(file_id),
            ):
                with pytest.raises(openai.NotFoundError):
                    await call
            with pytest.raises(openai.BadRequestError):  # not B's file to batch
                await b.batches.create(
                    input_file_id=file_id, endpoint=CHAT, completion_window="24h"
                )
            assert [f.id async for f in b.files.list()] == []
            assert [x.id async for x in b.batches.list()] == []
            assert [x.id async for x in a.batches.list()] == [batch.id]
            listed = [f.id async for f in a.files.list(purpose="batch")]
            assert listed == [file_id]
            done = await _until(a, batch.id, ("completed",))
            assert done.output_file_id is not None
            output = await a.files.retrieve(done.output_file_id)
            assert output.purpose == "batch_output"
            assert (await a.files.delete(file_id)).deleted
            with pytest.raises(openai.NotFoundError):
                await a.files.retrieve(file_id)

    run_stored(tmp_path, test, *KEYS)


def test_cancelling_a_batch_frees_its_slots_and_ends_cancelled(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        async with h.openai(KEY_A) as client:
            file_id = await _upload(client, [_line(f"n{i}", _chat(str(i))) for i in range(3)])
            batch = await client.batches.create(
                input_file_id=file_id, endpoint=CHAT, completion_window="24h"
            )
            await h.coordinator.wait_admitted(2)  # --batch-concurrency 2
            cancelling = await client.batches.cancel(batch.id)
            assert cancelling.status in ("cancelling", "cancelled")
            done = await _until(client, batch.id, ("cancelled",))
        assert done.cancelled_at is not None and done.output_file_id is None
        assert done.request_counts is not None and done.request_counts.completed == 0
        assert h.coordinator.handles == {}
        assert _samples(h.metrics, "deepinfer:batch_lines_finished_total")["retried"] == 2.0
        assert _samples(h.metrics, "deepinfer:batches_finished_total")["cancelled"] == 1.0
        assert len(h.coordinator.closed) == 2 and all(
            aborted for _, aborted, _ in h.coordinator.closed
        )

    run_stored(tmp_path, test, *KEYS, "--batch-concurrency", "2", script=Script(hold=True))


def test_the_limits_per_api_key(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        async with h.openai(KEY_A) as client:
            with pytest.raises(openai.BadRequestError, match="purpose"):
                await client.files.create(
                    file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune"
                )
            with pytest.raises(openai.APIStatusError) as large:
                await client.files.create(
                    file=("x.jsonl", io.BytesIO(b"x" * (1024 * 1024 + 1))), purpose="batch"
                )
            assert large.value.status_code == 413
            three = await _upload(client, [_line(f"n{i}", _chat("hi")) for i in range(3)])
            with pytest.raises(openai.BadRequestError, match="batch-max-lines"):
                await client.batches.create(
                    input_file_id=three, endpoint=CHAT, completion_window="24h"
                )
            one = await _upload(client, [_line("n", _chat("hi"))])
            with pytest.raises(openai.BadRequestError, match="completion_window"):
                await client.batches.create(
                    input_file_id=one,
                    endpoint=CHAT,
                    completion_window="1h",  # type: ignore[arg-type]
                )
            for window in ({}, [None]):  # not a string: a 400, never a server error
                answer = await h.client.post(
                    "/v1/batches",
                    json={"input_file_id": one, "endpoint": CHAT, "completion_window": window},
                    headers={"Authorization": f"Bearer {KEY_A}"},
                )
                assert answer.status_code == 400, answer.text
            await client.batches.create(input_file_id=one, endpoint=CHAT, completion_window="24h")
            with pytest.raises(openai.RateLimitError, match="batch-max-active"):
                await client.batches.create(
                    input_file_id=one, endpoint=CHAT, completion_window="24h"
                )
        async with h.openai(KEY_B) as other:  # another key's batches do not count
            mine = await _upload(other, [_line("n", _chat("hi"))])
            await other.batches.create(input_file_id=mine, endpoint=CHAT, completion_window="24h")

    run_stored(
        tmp_path,
        test,
        *KEYS,
        "--batch-max-file-mb",
        "1",
        "--batch-max-lines",
        "2",
        "--batch-max-active",
        "1",
        script=Script(hold=True),
    )


def test_anthropics_files_api_is_refused_in_its_envelope(tmp_path: Path) -> None:
    """Anthropic's clients send their Files API to /v1/files: a 400 they can read, never
    OpenAI's file object; OpenAI's clients are unaffected."""

    async def test(h: Harness) -> None:
        http = client_http.AsyncClient(transport=client_http.ASGITransport(app=h.app))
        async with anthropic.AsyncAnthropic(
            base_url="http://test", api_key=KEY_A, http_client=http, max_retries=0
        ) as client:
            calls = (
                client.beta.files.upload(file=("notes.txt", b"hello", "text/plain")),
                client.beta.files.list(),
                client.beta.files.retrieve_metadata("file_1"),
                client.beta.files.download("file_1"),
                client.beta.files.delete("file_1"),
            )
            for call in calls:
                with pytest.raises(anthropic.BadRequestError) as refused:
                    await call
                body = refused.value.body
                assert isinstance(body, dict) and body["type"] == "error"
                assert body["error"]["type"] == "invalid_request_error"
                assert "Anthropic's Files API" in body["error"]["message"]
        beta_only = await h.client.post(
            "/v1/files",
            files={"file": ("x.jsonl", b"{}\n")},
            data={"purpose": "batch"},
            headers={"Authorization": f"Bearer {KEY_A}", "anthropic-beta": "files-api-2025-04-14"},
        )
        assert beta_only.status_code == 400
        assert "Anthropic's Files API" in beta_only.json()["error"]["message"]
        async with h.openai(KEY_A) as openai_client:
            assert [f.id async for f in openai_client.files.list()] == []
            await _upload(openai_client, [_line("n", _chat("hi"))])

    run_stored(tmp_path, test, *KEYS)


def test_an_upload_is_parsed_and_decoded_off_the_loop_and_refused_when_it_is_not_utf8(
    tmp_path: Path,
) -> None:
    async def test(h: Harness) -> None:
        # A two-byte character across the first MiB's end, and a four-byte one after it.
        content = b"a" * (1024 * 1024 - 1) + "é🙂\n".encode()
        async with h.openai(KEY_A) as client:
            file = await client.files.create(file=("x.jsonl", io.BytesIO(content)), purpose="batch")
            assert file.bytes == len(content)
            assert (await client.files.content(file.id)).content == content
            for bad in (b"\xff\n", b"a" * (1024 * 1024 - 1) + b"\xc3"):
                with pytest.raises(openai.BadRequestError, match="UTF-8 JSONL"):
                    await client.files.create(file=("x.jsonl", io.BytesIO(bad)), purpose="batch")
        # The form is parsed in a worker thread: its parser's refusals are still 400s.
        two = await h.client.post(
            "/v1/files",
            files=[("file", ("a.jsonl", b"{}\n")), ("file", ("b.jsonl", b"{}\n"))],
            data={"purpose": "batch"},
            headers={"Authorization": f"Bearer {KEY_A}"},
        )
        assert two.status_code == 400
        assert two.json()["error"]["message"] == "Too many files. Maximum number of files is 1."

    run_stored(tmp_path, test, *KEYS, "--batch-max-file-mb", "2")


def test_a_file_of_many_short_lines_is_refused_without_holding_the_event_loop(
    tmp_path: Path,
) -> None:
    """Half a million one-character lines: split a part at a time off the loop, and refused
    once past --batch-max-lines, while the loop keeps serving (another key's models)."""

    async def test(h: Harness) -> None:
        async with h.openai(KEY_A) as client:
            file = await client.files.create(
                file=("many.jsonl", io.BytesIO(b"x\n" * 512 * 1024)), purpose="batch"
            )
            async with LoopLag() as lag:
                answer = await h.client.post(
                    "/v1/batches",
                    json={"input_file_id": file.id, "endpoint": CHAT, "completion_window": "24h"},
                    headers={"Authorization": f"Bearer {KEY_A}"},
                )
                models = await h.client.get(
                    "/v1/models", headers={"Authorization": f"Bearer {KEY_B}"}
                )
        lag.check()
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == "input_file_id"
        assert error["message"] == (
            "the input file has more than 1000 requests; a batch has at most 1000 "
            "(--batch-max-lines)"
        )
        assert models.status_code == 200

    run_stored(tmp_path, test, *KEYS, "--batch-max-file-mb", "2", "--batch-max-lines", "1000")


def test_a_batch_stopped_midway_is_finished_by_another_process_each_line_once(
    tmp_path: Path,
) -> None:
    """A runner stopping gives its lines back; another (a restart, or a replica) claims only
    the lines nobody answered, and a claim that lost its lease writes nothing."""

    async def test(h: Harness) -> None:
        runner = h.state.batches
        assert runner is not None and h.state.store is not None
        async with h.openai(KEY_A) as client:
            file_id = await _upload(client, [_line(f"n{i}", _chat(str(i))) for i in range(4)])
            batch = await client.batches.create(
                input_file_id=file_id, endpoint=CHAT, completion_window="24h"
            )
            await h.coordinator.wait_admitted(2)
            first, _ = sorted(h.coordinator.handles)
            # One line answered, one still running when the process stops.
            _answer(h, h.coordinator.handles[first], "Answered once")
            while (await client.batches.retrieve(batch.id)).request_counts.completed < 1:  # type: ignore[union-attr]
                await asyncio.sleep(0.01)
            await runner.stop()
            assert h.coordinator.handles == {}  # the running line's slot freed
            h.coordinator.script = Script("Answered once")
            store = BatchStore(h.state.store)
            # A process that claims lines then dies holds them until its lease ends.
            dead = await store.claim(batch.id, "dead", 1, lease=-1.0)
            assert [line.line for line in dead] == [1]
            successor = BatchRunner(
                store, h.state.config.api_keys, concurrency=4, metrics=ServerMetrics(MODEL)
            )
            successor.bind(h.app)
            successor.wake()
            try:
                done = await _until(client, batch.id, ("completed",))
            finally:
                await successor.stop()
            assert not await store.record(dead[0], "succeeded", {"late": True})
            assert done.output_file_id is not None
            output = await _content(client, done.output_file_id)
        assert [line["custom_id"] for line in output] == ["n0", "n1", "n2", "n3"]
        assert all(
            line["response"]["body"]["choices"][0]["message"]["content"] == "Answered once"
            for line in output
        )
        # Request IDs end in `-<line>-<attempt>`. Line 0 once; line 1 twice (stopped, then
        # resumed); line 3 once. Line 2 once, or twice when the first runner took it into line
        # 0's freed slot before its stop (given back unanswered, then run by the successor).
        runs = Counter(
            int(request_id.split("-")[-2]) for request_id, _, _ in h.coordinator.submitted
        )
        assert runs[0] == 1 and runs[1] == 2 and runs[3] == 1 and runs[2] in (1, 2), runs
        assert set(runs) == {0, 1, 2, 3}

    run_stored(tmp_path, test, *KEYS, "--batch-concurrency", "2", script=Script(hold=True))


def test_a_batch_takes_only_idle_running_slots_and_leaves_one_for_interactive_requests(
    tmp_path: Path,
) -> None:
    async def test(h: Harness) -> None:
        runner = h.state.batches
        assert runner is not None
        async with h.openai(KEY_A) as client:
            file_id = await _upload(client, [_line(f"n{i}", _chat(str(i))) for i in range(5)])
            await client.batches.create(
                input_file_id=file_id, endpoint=CHAT, completion_window="24h"
            )
            await h.coordinator.wait_admitted(2)  # 3 slots: one kept free
            await runner.work()  # another look: nothing more to take
            assert len(h.coordinator.handles) == 2
            # An interactive request takes the slot kept free, at its own priority...
            interactive = asyncio.ensure_future(
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}]
                )
            )
            await h.coordinator.wait_admitted(3)
            await runner.work()  # ...and the batch waits while no slot is idle
            assert len(h.coordinator.handles) == 3
            priorities = sorted(p for _, p in h.coordinator.placement.values())
            assert priorities == [0, PRIORITY_MAX, PRIORITY_MAX]
            interactive.cancel()

    run_stored(tmp_path, test, *KEYS, "--max-num-seqs", "3", script=Script(hold=True))


def test_a_batch_line_counts_each_engine_request_it_makes_against_the_idle_slots(
    tmp_path: Path,
) -> None:
    """6 running slots, one kept for interactive requests: lines of `n: 3` run one at a time
    (two would make 6 engine requests), and an interactive request still starts at once."""

    async def test(h: Harness) -> None:
        runner = h.state.batches
        assert runner is not None
        async with h.openai(KEY_A) as client:
            lines = [_line(f"n{i}", {**_chat(str(i)), "n": 3}) for i in range(4)]
            file_id = await _upload(client, lines)
            await client.batches.create(
                input_file_id=file_id, endpoint=CHAT, completion_window="24h"
            )
            await h.coordinator.wait_admitted(3)
            await runner.work()  # another look, with the line's 3 requests admitted
            assert len(h.coordinator.handles) == 3
            assert runner.lines_running == 1
            interactive = asyncio.ensure_future(
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}]
                )
            )
            await h.coordinator.wait_admitted(4)
            await runner.work()
            priorities = sorted(p for _, p in h.coordinator.placement.values())
            assert priorities == [0, PRIORITY_MAX, PRIORITY_MAX, PRIORITY_MAX]
            interactive.cancel()

    run_stored(tmp_path, test, *KEYS, "--max-num-seqs", "6", script=Script(hold=True))


def test_a_line_wider_than_the_idle_slots_runs_alone_on_an_idle_server(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        runner = h.state.batches
        assert runner is not None
        async with h.openai(KEY_A) as client:
            prompts = [f"prompt {i}" for i in range(4)]
            wide = {"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 4}
            narrow = {"model": MODEL, "prompt": "one", "max_tokens": 4}
            lines = [_line("wide", wide, "/v1/completions"), _line("n", narrow, "/v1/completions")]
            file_id = await _upload(client, lines)
            await client.batches.create(
                input_file_id=file_id, endpoint="/v1/completions", completion_window="24h"
            )
            await h.coordinator.wait_admitted(8)  # 4 prompts x 2 choices, past the 3 slots
            await runner.work()
            assert len(h.coordinator.handles) == 8  # the narrow line waits for it
            assert runner.lines_running == 1

    run_stored(tmp_path, test, *KEYS, "--max-num-seqs", "4", script=Script(hold=True))
