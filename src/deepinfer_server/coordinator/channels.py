"""RankChannels: the ZeroMQ sockets between the API process and the rank processes.

One PUSH socket per rank inbox (never blocking the event loop: no high-water mark) and one PULL
socket that every rank pushes its outputs to. With several API server processes each binds
sockets of its own (`client` is its number) and every rank connects to all of them. The reader
task decodes each message and hands it to one callback; it never blocks on a consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import zmq
import zmq.asyncio

from deepinfer_server.ipc.codec import pack_token_ids
from deepinfer_server.ipc.messages import (
    AbortRequests,
    AddRequest,
    FromRank,
    Images,
    SamplingOptions,
    Shutdown,
    Wake,
    from_rank_decoder,
    to_rank_encoder,
)

_DRAIN_BATCH = 32
_WAKE = to_rank_encoder.encode(Wake())
_SHUTDOWN = to_rank_encoder.encode(Shutdown())


class RankChannels:
    """Sockets to every rank; use from the event-loop thread only."""

    def __init__(self, inbox_addresses: list[str], outbox_address: str, client: int = 0) -> None:
        self._client = client
        self._context = zmq.Context()
        self._inboxes: list[zmq.Socket[bytes]] = []
        for address in inbox_addresses:
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a send
            socket.setsockopt(zmq.LINGER, 0)
            socket.bind(address)
            self._inboxes.append(socket)
        self._outbox = zmq.asyncio.Context.shadow(self._context).socket(zmq.PULL)
        self._outbox.setsockopt(zmq.LINGER, 0)
        self._outbox.bind(outbox_address)

    def send_add(
        self,
        rank: int,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        images: Images | None = None,
    ) -> None:
        """Start a request on `rank`, and wake the other ranks into the same lockstep round."""
        message = AddRequest(
            request_id, pack_token_ids(prompt_token_ids), sampling, images, self._client
        )
        self._inboxes[rank].send(to_rank_encoder.encode(message), copy=False)
        for other, socket in enumerate(self._inboxes):
            if other != rank:
                socket.send(_WAKE, copy=False)

    def send_abort(self, rank: int, request_ids: list[str]) -> None:
        message = to_rank_encoder.encode(AbortRequests(request_ids))
        with contextlib.suppress(zmq.ZMQError):
            self._inboxes[rank].send(message, copy=False)

    def send_shutdown(self) -> None:
        """End every idle rank's wait, so it reaches the agreed stop promptly."""
        for socket in self._inboxes:
            with contextlib.suppress(zmq.ZMQError):
                socket.send(_SHUTDOWN, zmq.NOBLOCK)

    async def read(self, on_message: Callable[[FromRank], None]) -> None:
        """Deliver every message from the ranks to `on_message`, until cancelled."""
        # Await one message, then take what else is already queued without a future per message
        # (at high step rates that is most of them), but few enough to keep the loop fair.
        drain: zmq.Socket[bytes] = zmq.Socket.shadow(self._outbox.underlying)
        while True:
            frame = await self._outbox.recv(copy=False)
            on_message(from_rank_decoder.decode(frame.buffer))
            for _ in range(_DRAIN_BATCH):
                try:
                    frame = drain.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                on_message(from_rank_decoder.decode(frame.buffer))
            await asyncio.sleep(0)

    def close(self) -> None:
        for socket in self._inboxes:
            socket.close()
        self._outbox.close()
        self._context.term()
