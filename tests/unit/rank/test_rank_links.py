"""The sockets between the API process and the ranks: framing, and `RankChannels` with
`ApiLinks` over real Unix sockets in one process (the rank's end on a thread)."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from deepinfer_server.coordinator.channels import RankChannels, bind_rank_listener
from deepinfer_server.ipc.codec import pack_token_ids
from deepinfer_server.ipc.framing import FrameReader, frame
from deepinfer_server.ipc.messages import (
    AddRequest,
    FromRank,
    RankFailed,
    RankReady,
    SamplingOptions,
    Shutdown,
    Wake,
    from_rank_decoder,
    to_rank_decoder,
)
from deepinfer_server.rank.links import ApiLinks, report


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_frames_survive_any_split_of_the_stream(piece: int) -> None:
    payloads = [b"", b"a", b"xyz" * 100, bytes(range(256))]
    stream = b"".join(frame(p) for p in payloads)
    reader = FrameReader()
    got: list[bytes] = []
    for start in range(0, len(stream), piece):
        got.extend(reader.feed(stream[start : start + piece]))
    assert got == payloads


def _receive_all(links: ApiLinks, count: int) -> list[object]:
    messages: list[object] = []
    while len(messages) < count:
        assert links.wait(5000), "nothing arrived"
        messages.extend(to_rank_decoder.decode(p) for p in links.receive())
    return messages


def test_messages_travel_both_ways_and_wait_for_a_rank_to_connect(tmp_path: Path) -> None:
    path = str(tmp_path / "api0.sock")

    async def body() -> None:
        channels = RankChannels(bind_rank_listener(path), ranks=2)
        arrived: list[FromRank] = []
        got_all = asyncio.Event()

        def on_messages(messages: list[FromRank]) -> None:
            arrived.extend(messages)
            if len(arrived) >= 3:
                got_all.set()

        reading = asyncio.ensure_future(channels.read(on_messages))
        big_prompt = list(range(300_000))  # 1.2 MB: many socket writes
        # Rank 1 is not connected yet: the request and the wake-up for rank 0 wait for it.
        packed = pack_token_ids(big_prompt)
        framed = channels.frame_add("r-1", packed, SamplingOptions(max_tokens=3))
        channels.send_framed_add(1, framed)
        rank_side: dict[str, object] = {}

        def rank(number: int) -> None:
            links = ApiLinks([path], number)
            links.send_all(RankReady(number, 1000 + number))
            rank_side[f"rank{number}"] = _receive_all(links, 1)
            links.close()

        threads = [threading.Thread(target=rank, args=(n,)) for n in (0, 1)]
        for thread in threads:
            thread.start()
        # A report on a connection of its own (another thread) arrives without taking the link.
        await asyncio.to_thread(report, [path], 0, RankFailed(0, "boom", ""))
        await asyncio.wait_for(got_all.wait(), 10)
        for thread in threads:
            await asyncio.to_thread(thread.join, 10)
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
        channels.close()
        assert sorted(m.rank for m in arrived if isinstance(m, RankReady)) == [0, 1]
        assert [m.message for m in arrived if isinstance(m, RankFailed)] == ["boom"]
        assert rank_side["rank0"] == [Wake()]
        (add,) = rank_side["rank1"]  # type: ignore[misc]
        assert isinstance(add, AddRequest) and add.request_id == "r-1"
        assert len(add.prompt_token_ids) == 4 * len(big_prompt)

    asyncio.run(body())


def test_shutdown_reaches_connected_ranks_only(tmp_path: Path) -> None:
    path = str(tmp_path / "api0.sock")

    async def body() -> None:
        channels = RankChannels(bind_rank_listener(path), ranks=1)
        ready = asyncio.Event()
        reading = asyncio.ensure_future(channels.read(lambda messages: ready.set()))
        channels.send_shutdown()  # nobody connected: dropped, not queued
        links = await asyncio.to_thread(ApiLinks, [path], 0)
        links.send_all(RankReady(0, 1))
        await asyncio.wait_for(ready.wait(), 10)
        channels.send_shutdown()
        assert await asyncio.to_thread(_receive_all, links, 1) == [Shutdown()]
        links.close()
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
        channels.close()

    asyncio.run(body())


def test_a_message_that_cannot_be_handled_does_not_cut_the_link(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(tmp_path / "api0.sock")

    async def body() -> None:
        channels = RankChannels(bind_rank_listener(path), ranks=1)
        handled: list[FromRank] = []
        first, second = asyncio.Event(), asyncio.Event()

        def on_messages(messages: list[FromRank]) -> None:
            handled.extend(messages)
            if len(handled) == 1:
                first.set()
                raise RuntimeError("a bug in the handler")
            second.set()

        reading = asyncio.ensure_future(channels.read(on_messages))
        links = await asyncio.to_thread(ApiLinks, [path], 0)
        links.send_all(RankReady(0, 1))
        await asyncio.wait_for(first.wait(), 10)  # handled (and failed) before the next is sent
        links.send_all(RankReady(0, 2))
        await asyncio.wait_for(second.wait(), 10)
        links.close()
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
        channels.close()
        assert [m.pid for m in handled if isinstance(m, RankReady)] == [1, 2]

    asyncio.run(body())
    assert "could not be handled" in caplog.text


class _Peer:
    """An API process's end of a rank link: reads every message on a thread, or (stuck, as
    under SIGSTOP) never even accepts the connection, whose bytes then wait in the kernel."""

    def __init__(self, path: str, reads: bool) -> None:
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(1)
        self.failures: list[RankFailed] = []
        self.got = threading.Condition()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        if reads:
            self._thread.start()

    def start_reading(self) -> None:
        self._thread.start()

    def _serve(self) -> None:
        connection, _ = self._listener.accept()
        reader = FrameReader()
        with connection:
            while data := connection.recv(1 << 16):
                for payload in reader.feed(data):
                    message = from_rank_decoder.decode(payload)
                    if isinstance(message, RankFailed):
                        with self.got:
                            self.failures.append(message)
                            self.got.notify_all()

    def close(self) -> None:
        self._listener.close()
        if self._thread.is_alive():
            self._thread.join(10)


@pytest.fixture
def healthy_and_stuck(tmp_path: Path) -> Iterator[tuple[list[str], _Peer]]:
    """Two API processes' sockets: process 0 reads everything, process 1 reads nothing."""
    paths = [str(tmp_path / "api0.sock"), str(tmp_path / "api1.sock")]
    healthy, stuck = _Peer(paths[0], reads=True), _Peer(paths[1], reads=False)
    yield paths, healthy
    healthy.close()
    stuck.close()


_MESSAGES = 100
_BIG = RankFailed(0, "x" * 100_000, "")  # 100 KB each: 10 MB to each process


def _send_paced(links: ApiLinks, healthy: _Peer) -> bool:
    """Send every message to both processes, each once the healthy one has the one before
    (the rank's waits send what waits for it meanwhile), on a thread; True if that ended,
    False if a send was still blocked after 30 s (the rank's loop would be stuck)."""

    def send() -> None:
        for sent in range(1, _MESSAGES + 1):
            links.send_all(_BIG)
            while links.is_live(0):
                with healthy.got:
                    if len(healthy.failures) == sent:
                        break
                links.wait(1)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    sender.join(30)
    return not sender.is_alive()


def test_a_process_that_reads_nothing_never_blocks_the_rank(
    healthy_and_stuck: tuple[list[str], _Peer],
) -> None:
    paths, healthy = healthy_and_stuck
    links = ApiLinks(paths, 0)
    try:
        assert _send_paced(links, healthy), "a send to a process that reads nothing blocked"
        assert len(healthy.failures) == _MESSAGES
        assert links.is_live(0) and links.is_live(1)  # 10 MB: within the default backlog
    finally:
        links.close()


@pytest.mark.parametrize(
    ("bounds", "why"),
    [({"backlog_bytes": 1 << 20}, "MiB waiting"), ({"stall_seconds": 0.0}, "nothing read")],
)
def test_a_link_past_its_bounds_is_dropped_and_the_others_go_on(
    healthy_and_stuck: tuple[list[str], _Peer],
    bounds: dict[str, float],
    why: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    paths, healthy = healthy_and_stuck
    links = ApiLinks(paths, 3, **bounds)  # type: ignore[arg-type]
    try:
        assert _send_paced(links, healthy)
        assert len(healthy.failures) == _MESSAGES
        assert links.is_live(0) and not links.is_live(1)
    finally:
        links.close()
    assert "DP rank 3: API server process 1 stopped reading" in caplog.text
    assert why in caplog.text


def test_with_one_process_the_rank_waits_for_it_rather_than_drop_it(tmp_path: Path) -> None:
    path = str(tmp_path / "api0.sock")
    only = _Peer(path, reads=False)
    links = ApiLinks([path], 0, backlog_bytes=1 << 20, stall_seconds=0.0)
    try:
        sender = threading.Thread(
            target=lambda: [links.send_all(_BIG) for _ in range(_MESSAGES)], daemon=True
        )
        sender.start()
        only.start_reading()  # it reads again (SIGCONT): nothing was lost meanwhile
        sender.join(30)
        assert not sender.is_alive()
        while True:
            with only.got:
                if len(only.failures) == _MESSAGES:
                    break
            assert links.is_live(0), "the only API process's link was dropped"
            links.wait(1)
    finally:
        links.close()
        only.close()
