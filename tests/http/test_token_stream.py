"""TokenStream's sink path in-process: writes from the reader's pass, a send that has to wait,
errors raised in the sink, failures and cancellation while attached, the stream interval, and
the opening, which waits for the engine to take the request (its first delta carries the
prompt tokens the prefix cache reused)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from deepinfer_server.api.sse import send_now
from deepinfer_server.coordinator.handle import RequestHandle
from deepinfer_server.errors import ClientDisconnected, ServiceFailedError
from deepinfer_server.ipc.messages import AbortReason, Finish, GeneratedTokens
from deepinfer_server.metrics import RequestRecord, ServerMetrics
from deepinfer_server.services.token_stream import TokenStream


class _Output:
    """A protocol output that renders each token ID as one payload."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.finished = False
        self.closed = False
        self.client_finish_reason: str | None = None
        self._fail_on = fail_on
        self.cached_tokens: int | None = None
        self.pushed: list[list[int]] = []

    def start(self, cached_tokens: int = 0, written_tokens: int = 0) -> list[str]:
        assert self.cached_tokens is None, "started twice"
        self.cached_tokens = cached_tokens
        return ["start"]

    def push(self, tokens: GeneratedTokens) -> list[str]:
        self.pushed.append(list(tokens.token_ids))
        if self._fail_on in tokens.token_ids:
            raise RuntimeError("parser failure")
        return [str(token) for token in tokens.token_ids]

    def finish(self, finish: Finish) -> list[str]:
        return [f"end:{finish.name}"]

    def close(self) -> None:
        self.closed = True

    def response_json(self) -> bytes:
        return b"{}"


class _Harness:
    def __init__(self, fail_on: int | None = None, stream_interval: int = 1) -> None:
        self.closes: list[tuple[bool, AbortReason]] = []
        self.handle = RequestHandle("r-1", 0, self._closed, None, stream_interval)
        self.output = _Output(fail_on)
        self.record = RequestRecord(arrival=time.perf_counter())
        self.stream = TokenStream(self.handle, self.output, self.record, ServerMetrics("m"))
        self.written: list[list[str]] = []
        self.gate: asyncio.Event | None = None  # while set to an unset Event, sends wait

    def _closed(self, handle: RequestHandle, aborted: bool, reason: AbortReason) -> None:
        self.closes.append((aborted, reason))

    async def _send(self, message: dict[str, Any]) -> None:
        if self.gate is not None:
            await self.gate.wait()
        self.written.append(message["payloads"])

    def write(self, payloads: list[str]) -> Any:
        return send_now(self._send, {"payloads": payloads})  # type: ignore[arg-type]

    def started(self, cached_tokens: int = 0) -> None:
        """The engine's first delta: it took the request, reusing `cached_tokens` (no token)."""
        self.handle.started(cached_tokens)
        if self.handle.deliver(GeneratedTokens(), None, time.perf_counter(), 0.01):
            self.handle.flush()

    async def begin(self, cached_tokens: int = 0) -> None:
        """Once the stream is attached, the engine's first delta; the opening is written."""
        await _until(lambda: self.handle._sink is not None)
        assert self.written == []  # nothing before the engine took the request
        self.started(cached_tokens)
        assert self.written == [["start"]]  # written during the flush, before any task ran

    def deliver(self, *token_ids: int, finish: Finish | None = None) -> None:
        """One step arriving alone, as the reader task hands it over: deliver, then flush."""
        tokens = GeneratedTokens(list(token_ids))
        if self.handle.deliver(tokens, finish, time.perf_counter(), 0.01):
            self.handle.flush()


async def _until(condition: Any) -> None:
    """Let the other tasks run (a yield, no time passes) until `condition` holds."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


def test_steps_are_written_from_the_reader_pass() -> None:
    async def body() -> None:
        h = _Harness()
        task = asyncio.ensure_future(h.stream.run(h.write))
        await h.begin()
        h.deliver(1)
        assert h.written[-1] == ["1"]  # written during the flush, before any task ran
        h.deliver(2, finish=Finish.LENGTH)
        assert h.written[-1] == ["2", "end:LENGTH"]
        await task
        assert h.closes == [(False, AbortReason.STOP)]
        assert h.record.finish_reason == "length" and h.record.generation_tokens == 2

    asyncio.run(body())


def test_a_send_that_waits_hands_over_to_the_task_and_nothing_is_lost() -> None:
    async def body() -> None:
        h = _Harness()
        task = asyncio.ensure_future(h.stream.run(h.write))
        await h.begin()
        h.gate = asyncio.Event()
        h.deliver(1)  # its send waits: the sink detaches
        h.deliver(2)  # buffered in the handle
        h.deliver(3)
        assert h.written == [["start"]]
        h.gate.set()
        await _until(lambda: len(h.written) == 3)
        assert h.written == [["start"], ["1"], ["2", "3"]]  # the waiting steps in one write
        h.gate = None
        h.deliver(4)
        assert h.written[-1] == ["4"]  # attached again
        h.deliver(finish=Finish.STOP)
        await task
        assert h.written[-1] == ["end:STOP"]

    asyncio.run(body())


def test_an_error_in_the_sink_is_raised_in_the_request_task() -> None:
    async def body() -> None:
        h = _Harness(fail_on=7)
        task = asyncio.ensure_future(h.stream.run(h.write))
        await h.begin()
        h.deliver(7)  # must not raise in the reader
        with pytest.raises(RuntimeError, match="parser failure"):
            await task
        assert h.closes == [(True, AbortReason.ERROR)] and h.output.closed

    asyncio.run(body())


def test_a_failure_while_attached_ends_the_stream_with_it() -> None:
    async def body() -> None:
        h = _Harness()
        task = asyncio.ensure_future(h.stream.run(h.write))
        await h.begin()
        h.deliver(1)
        h.handle.fail(ServiceFailedError("rank 0 died"), engine_finished=True)
        with pytest.raises(ServiceFailedError):
            await task
        assert h.closes == [(False, AbortReason.RANK_FAILURE)]
        assert h.record.error_kind == "service_failed"

    asyncio.run(body())


def test_steps_that_arrive_together_make_one_write() -> None:
    async def body() -> None:
        h = _Harness()
        task = asyncio.ensure_future(h.stream.run(h.write))
        await h.begin()
        now = time.perf_counter()
        assert h.handle.deliver(GeneratedTokens([1]), None, now, 0.01)
        assert not h.handle.deliver(GeneratedTokens([2]), None, now, 0.01)  # one flush due
        assert h.written == [["start"]]
        h.handle.flush()
        assert h.written[-1] == ["1", "2"]
        h.deliver(finish=Finish.STOP)
        await task

    asyncio.run(body())


def test_a_stream_whose_handle_is_released_under_it_ends() -> None:
    async def body() -> None:
        h = _Harness()
        task = asyncio.ensure_future(h.stream.run(h.write))
        await _until(lambda: h.handle._sink is not None)
        h.handle.close(AbortReason.DISCONNECT)  # the response gave up on its body
        with pytest.raises(ClientDisconnected):
            await asyncio.wait_for(task, 5)
        assert h.closes == [(True, AbortReason.DISCONNECT)]

    asyncio.run(body())


def test_cancelling_a_stream_with_a_waiting_write_aborts_it() -> None:
    async def body() -> None:
        h = _Harness()
        task = asyncio.ensure_future(h.stream.run(h.write))
        await h.begin()
        h.gate = asyncio.Event()
        h.deliver(1)
        await _until(lambda: h.handle._sink is None)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert h.closes == [(True, AbortReason.DISCONNECT)] and h.output.closed
        h.deliver(2)  # after the close: dropped, never written
        assert h.written == [["start"]]

    asyncio.run(body())


def test_a_stream_interval_sends_the_first_token_then_every_n_then_the_rest() -> None:
    async def body() -> None:
        h = _Harness(stream_interval=3)
        task = asyncio.ensure_future(h.stream.run(h.write))
        await h.begin()
        h.deliver(1)
        assert h.written[-1] == ["1"]  # the first token at once
        h.deliver(2)
        h.deliver(3)
        assert h.written[-1] == ["1"]  # two waiting: held
        h.deliver(4)
        assert h.written[-1] == ["2", "3", "4"]
        h.deliver(5, 6, 7, 8)  # a step with more than N tokens goes at once
        assert h.written[-1] == ["5", "6", "7", "8"]
        h.deliver(9)
        h.deliver(finish=Finish.LENGTH)  # the end takes what is waiting
        await asyncio.wait_for(task, 5)
        assert h.written[-1] == ["9", "end:LENGTH"]
        assert h.record.generation_tokens == 9

    asyncio.run(body())


def test_a_failure_hands_over_the_tokens_a_stream_interval_held() -> None:
    async def body() -> None:
        h = _Harness(stream_interval=4)
        task = asyncio.ensure_future(h.stream.run(h.write))
        await h.begin()
        h.deliver(1)
        h.deliver(2)
        assert h.written == [["start"], ["1"]]  # 2 is held
        h.handle.fail(ServiceFailedError("rank 0 died"), engine_finished=True)
        with pytest.raises(ServiceFailedError):
            await asyncio.wait_for(task, 5)
        assert h.written == [["start"], ["1"], ["2"]]

    asyncio.run(body())


def _deliver(handle: RequestHandle, token_id: int) -> None:
    handle.deliver(GeneratedTokens([token_id]), None, time.perf_counter(), 0.01)


async def _pulled_past_the_first_token(stream_interval: int) -> RequestHandle:
    """A handle without a sink whose first token (1) was delivered and pulled."""
    handle = RequestHandle("r-1", 0, lambda *_: None, None, stream_interval)
    _deliver(handle, 1)
    assert (await handle.next_batch()).tokens.token_ids == [1]
    return handle


def test_a_pulling_consumer_waits_for_the_stream_interval() -> None:
    async def body() -> None:
        handle = await _pulled_past_the_first_token(stream_interval=2)
        _deliver(handle, 2)
        pulling = asyncio.ensure_future(handle.next_batch())
        await asyncio.sleep(0)  # one yield: the pull runs up to its wait
        assert not pulling.done()  # one token waiting, the interval is two
        _deliver(handle, 3)
        assert (await asyncio.wait_for(pulling, 5)).tokens.token_ids == [2, 3]

    asyncio.run(body())


def test_closing_a_handle_hands_over_the_tokens_a_stream_interval_held() -> None:
    async def body() -> None:
        handle = await _pulled_past_the_first_token(stream_interval=3)
        _deliver(handle, 2)
        handle.close(AbortReason.DISCONNECT)
        assert (await asyncio.wait_for(handle.next_batch(), 5)).tokens.token_ids == [2]
        with pytest.raises(ClientDisconnected):
            await asyncio.wait_for(handle.next_batch(), 5)

    asyncio.run(body())


def test_a_sink_attaches_over_tokens_the_stream_interval_holds() -> None:
    async def body() -> None:
        h = _Harness(stream_interval=3)
        task = asyncio.ensure_future(h.stream.run(h.write))
        await h.begin()
        h.gate = asyncio.Event()
        h.deliver(1)  # its send waits: the sink detaches
        h.deliver(2)  # held while the write waits
        h.gate.set()
        await _until(lambda: h.handle._sink is not None)  # attached again over the held token
        h.gate = None
        assert h.written == [["start"], ["1"]]
        h.deliver(3)
        h.deliver(4)
        assert h.written[-1] == ["2", "3", "4"]  # one chunk when three are waiting
        h.deliver(finish=Finish.STOP)
        await asyncio.wait_for(task, 5)

    asyncio.run(body())


def test_the_opening_waits_for_the_engine_and_carries_its_cached_tokens() -> None:
    async def body() -> None:
        h = _Harness(stream_interval=4)  # the opening is due even though no token waits
        task = asyncio.ensure_future(h.stream.run(h.write))
        await h.begin(cached_tokens=1408)
        assert h.output.cached_tokens == 1408
        # Nothing is pushed for the engine's first delta (a completions echo waits for the
        # prompt logprobs that come with the first token).
        assert h.output.pushed == []
        h.deliver(1, finish=Finish.STOP)
        await asyncio.wait_for(task, 5)
        assert h.written == [["start"], ["1", "end:STOP"]]

    asyncio.run(body())


def test_a_request_the_engine_took_before_the_stream_attached_opens_at_once() -> None:
    async def body() -> None:
        h = _Harness()
        h.started(cached_tokens=256)  # no sink yet: the handle keeps it
        task = asyncio.ensure_future(h.stream.run(h.write))
        await _until(lambda: h.written == [["start"]])
        assert h.output.cached_tokens == 256
        h.deliver(1, finish=Finish.STOP)
        await asyncio.wait_for(task, 5)
        assert h.written == [["start"], ["1", "end:STOP"]]

    asyncio.run(body())


def test_a_first_delta_with_tokens_opens_and_pushes_in_one_write() -> None:
    async def body() -> None:
        h = _Harness()
        task = asyncio.ensure_future(h.stream.run(h.write))
        await _until(lambda: h.handle._sink is not None)
        h.handle.started(0)
        h.deliver(1, 2)
        assert h.written == [["start", "1", "2"]] and h.output.cached_tokens == 0
        h.deliver(finish=Finish.STOP)
        await asyncio.wait_for(task, 5)

    asyncio.run(body())


def test_a_request_that_fails_before_the_engine_took_it_still_opens_before_the_error() -> None:
    async def body() -> None:
        h = _Harness()
        task = asyncio.ensure_future(h.stream.run(h.write))
        await _until(lambda: h.handle._sink is not None)
        h.handle.fail(ServiceFailedError("rank 0 died"), engine_finished=True)
        with pytest.raises(ServiceFailedError):
            await asyncio.wait_for(task, 5)
        assert h.written == [["start"]] and h.output.cached_tokens == 0

    asyncio.run(body())
