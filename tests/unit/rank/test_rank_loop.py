"""RankLoop with several API server processes: each gets its own requests' outputs, and every
one gets every step report (its liveness watch needs them), the prefix-cache counters included.
Real Unix sockets, as in a server."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

from deepinfer_server.errors import ErrorKind
from deepinfer_server.ipc.framing import FrameReader, frame
from deepinfer_server.ipc.messages import (
    AbortRequests,
    AddRequest,
    Finish,
    FromRank,
    GeneratedTokens,
    LinkHello,
    PrefixCacheStats,
    RankAlive,
    RequestDelta,
    RequestRejected,
    SamplingOptions,
    StepOutputs,
    from_rank_decoder,
    to_rank_encoder,
)
from deepinfer_server.rank.links import ApiLinks
from deepinfer_server.rank.loop import RankLoop


class _Core:
    """An engine that gives every live request one token per step, ends "b" at its first step
    and rejects "bad"."""

    def __init__(self) -> None:
        self.live: list[str] = []

    def add(self, request: AddRequest) -> RequestRejected | None:
        if request.request_id == "bad":
            return RequestRejected("bad", ErrorKind.BAD_REQUEST, "no")
        self.live.append(request.request_id)
        return None

    def abort(self, request_ids: list[str]) -> None:
        self.live = [r for r in self.live if r not in request_ids]

    def iterate(self) -> tuple[bool, list[RequestDelta]]:
        deltas = [
            RequestDelta(r, GeneratedTokens([1]), Finish.STOP if r == "b" else None)
            for r in self.live
        ]
        self.live = [r for r in self.live if r != "b"]
        return bool(self.live), deltas

    def kv_cache_usage(self) -> float | None:
        return 0.5

    def counters(self) -> None:
        return None

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        return None

    def close(self) -> None:
        pass


class _StopAfter:
    def __init__(self, iterations: int) -> None:
        self.iterations = iterations

    def should_stop(self, iteration: int) -> bool:
        return iteration >= self.iterations


def _received(connection: socket.socket) -> list[FromRank]:
    """Every message waiting on an API process's end of a link."""
    connection.setblocking(False)
    reader = FrameReader()
    payloads: list[bytes] = []
    while True:
        try:
            data = connection.recv(1 << 16)
        except BlockingIOError:
            break
        if not data:
            break
        payloads.extend(reader.feed(data))
    return [from_rank_decoder.decode(payload) for payload in payloads]


@contextlib.contextmanager
def _two_api_processes(tmp_path: Path) -> Iterator[tuple[ApiLinks, list[socket.socket]]]:
    """A rank's links to two API processes, and those processes' ends of them."""
    with contextlib.ExitStack() as stack:
        listeners = []
        for client in range(2):
            listener = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            listener.bind(str(tmp_path / f"api{client}.sock"))
            listener.listen()
            listeners.append(listener)
        links = ApiLinks([str(tmp_path / f"api{client}.sock") for client in range(2)], rank=0)
        stack.callback(links.close)
        api_ends = [stack.enter_context(listener.accept()[0]) for listener in listeners]
        yield links, api_ends


def test_outputs_go_back_to_the_api_process_that_sent_the_request(tmp_path: Path) -> None:
    with _two_api_processes(tmp_path) as (links, api_ends):
        sampling = SamplingOptions(max_tokens=4)
        for request_id, client in (("a", 0), ("b", 1), ("gone", 1), ("bad", 1)):
            message = AddRequest(request_id, b"", sampling, None, client)
            api_ends[client].sendall(frame(to_rank_encoder.encode(message)))
        api_ends[1].sendall(frame(to_rank_encoder.encode(AbortRequests(["gone"]))))
        core = _Core()
        RankLoop(0, core, links, _StopAfter(2), idle_wait=0.5).run()  # type: ignore[arg-type]
        first, second = _received(api_ends[0]), _received(api_ends[1])
        assert first[0] == LinkHello(0) and second[0] == LinkHello(0)
        steps = [m for m in first if isinstance(m, StepOutputs)]
        assert [[d.request_id for d in m.deltas] for m in steps] == [["a"], ["a"]]
        rejected = [m for m in second if isinstance(m, RequestRejected)]
        assert [m.request_id for m in rejected] == ["bad"]
        steps = [m for m in second if isinstance(m, StepOutputs)]
        # "b" ended at the first step, "gone" was aborted; the second step is still reported.
        assert [[d.request_id for d in m.deltas] for m in steps] == [["b"], []]


def test_an_api_process_that_goes_away_does_not_stop_the_others(tmp_path: Path) -> None:
    with _two_api_processes(tmp_path) as (links, api_ends):
        sampling = SamplingOptions(max_tokens=4)
        api_ends[0].sendall(frame(to_rank_encoder.encode(AddRequest("a", b"", sampling))))
        api_ends[1].close()  # process 1 died
        RankLoop(0, _Core(), links, _StopAfter(3), idle_wait=0.5).run()  # type: ignore[arg-type]
        steps = [m for m in _received(api_ends[0]) if isinstance(m, StepOutputs)]
        assert [[d.request_id for d in m.deltas] for m in steps] == [["a"], ["a"], ["a"]]


class _IdleCore(_Core):
    """An engine with nothing to do and a KV usage that never changes."""

    def iterate(self) -> tuple[bool, list[RequestDelta]]:
        return False, []


def test_an_idle_loop_says_it_came_back_every_heartbeat(tmp_path: Path) -> None:
    with _two_api_processes(tmp_path) as (links, api_ends):
        loop = RankLoop(0, _IdleCore(), links, _StopAfter(30), idle_wait=0.01, heartbeat=0.0)
        loop.run()  # type: ignore[arg-type]
        for api_end in api_ends:
            received = _received(api_end)
            # The first iteration reports the KV usage; every later one, with nothing to
            # report, is a heartbeat (the interval is 0 here).
            assert sum(isinstance(m, StepOutputs) for m in received) == 1
            assert sum(isinstance(m, RankAlive) for m in received) == 29


class _CachingCore(_IdleCore):
    """An idle engine whose prefix cache changes once, at its third iteration (a flush)."""

    def __init__(self) -> None:
        super().__init__()
        self.iterations = 0

    def iterate(self) -> tuple[bool, list[RequestDelta]]:
        self.iterations += 1
        return False, []

    def counters(self) -> None:
        return None

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        return PrefixCacheStats(100, 90, 1 if self.iterations >= 3 else 0)


def test_prefix_cache_counters_reach_every_api_process_when_they_change(tmp_path: Path) -> None:
    with _two_api_processes(tmp_path) as (links, api_ends):
        loop = RankLoop(0, _CachingCore(), links, _StopAfter(6), idle_wait=0.01, heartbeat=60)
        loop.run()  # type: ignore[arg-type]
        for api_end in api_ends:
            steps = [m for m in _received(api_end) if isinstance(m, StepOutputs)]
            # The first report, then the change seen while idle; nothing when nothing changed.
            assert [m.prefix_cache for m in steps] == [
                PrefixCacheStats(100, 90, 0),
                PrefixCacheStats(100, 90, 1),
            ]
