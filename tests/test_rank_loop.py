"""RankLoop with several API server processes: each gets its own requests' outputs, and every
one gets every step report (its liveness watch needs them)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from deepinfer_server.errors import ErrorKind
from deepinfer_server.ipc.messages import (
    AbortRequests,
    AddRequest,
    Finish,
    FromRank,
    GeneratedTokens,
    RequestDelta,
    RequestRejected,
    SamplingOptions,
    StepOutputs,
    from_rank_decoder,
    to_rank_encoder,
)
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

    def close(self) -> None:
        pass


class _StopAfter:
    def __init__(self, iterations: int) -> None:
        self.iterations = iterations

    def should_stop(self, iteration: int) -> bool:
        return iteration >= self.iterations


class _Sockets:
    """inproc sockets of one test, all closed at its end."""

    def __init__(self) -> None:
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sockets: list[zmq.Socket[bytes]] = []

    def pair(self, address: str) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        """(PUSH, PULL) connected over `address`."""
        pull = self.context.socket(zmq.PULL)
        pull.bind(address)
        push = self.context.socket(zmq.PUSH)
        push.connect(address)
        self.sockets += [push, pull]
        return push, pull


@pytest.fixture
def sockets() -> Iterator[_Sockets]:
    made = _Sockets()
    yield made
    for socket in made.sockets:
        socket.close(linger=0)
    made.context.term()


def _received(socket: zmq.Socket[bytes]) -> list[FromRank]:
    messages = []
    while socket.poll(0):
        messages.append(from_rank_decoder.decode(socket.recv()))
    return messages


def test_outputs_go_back_to_the_api_process_that_sent_the_request(sockets: _Sockets) -> None:
    inbox_sender, inbox = sockets.pair("inproc://inbox")
    pairs = [sockets.pair(f"inproc://api{client}") for client in range(2)]
    outboxes, readers = [push for push, _ in pairs], [pull for _, pull in pairs]
    sampling = SamplingOptions(max_tokens=4)
    for request_id, client in (("a", 0), ("b", 1), ("gone", 1), ("bad", 1)):
        inbox_sender.send(
            to_rank_encoder.encode(AddRequest(request_id, b"", sampling, None, client))
        )
    inbox_sender.send(to_rank_encoder.encode(AbortRequests(["gone"])))
    core = _Core()
    loop = RankLoop(0, core, inbox, outboxes, _StopAfter(2), idle_wait=0.01)  # type: ignore[arg-type]
    loop.run()
    first, second = _received(readers[0]), _received(readers[1])
    assert [type(m) for m in first] == [StepOutputs, StepOutputs]
    assert [[d.request_id for d in m.deltas] for m in first if isinstance(m, StepOutputs)] == [
        ["a"],
        ["a"],
    ]
    assert isinstance(second[0], RequestRejected) and second[0].request_id == "bad"
    steps = [m for m in second if isinstance(m, StepOutputs)]
    # "b" ended at the first step, "gone" was aborted; the second step is still reported.
    assert [[d.request_id for d in m.deltas] for m in steps] == [["b"], []]
