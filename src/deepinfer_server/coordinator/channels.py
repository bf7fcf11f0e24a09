"""RankChannels: the sockets between this API process and the rank processes.

The API process listens on one Unix stream socket; every rank connects to it once, says which
rank it is (`LinkHello`), and the connection carries length-prefixed msgpack messages
(`ipc.framing`) both ways: requests, aborts and wake-ups to the rank, step outputs and reports
from it. Each side writes to the socket and reads from it directly: a message costs one write
and one wake-up of its reader, with no thread in between (the latency of every token's trip).
Sends never block the event loop: the transport buffers what the socket cannot take yet, and
messages for a rank that has not connected yet wait for it. Every message that arrives is
decoded and handed to one callback as it arrives (what arrived together, together); it never
waits for a consumer. With several
API server processes each listens on a socket of its own (`client` is its number) and every
rank connects to all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable

from deepinfer_server.disaggregation.handoff.params import KVTransferParams
from deepinfer_server.ipc.framing import FrameReader, frame
from deepinfer_server.ipc.messages import (
    AbortRequests,
    AddRequest,
    FromRank,
    Images,
    LinkHello,
    SamplingOptions,
    Shutdown,
    Wake,
    from_rank_decoder,
    to_rank_encoder,
)

logger = logging.getLogger(__name__)

_WAKE = frame(to_rank_encoder.encode(Wake()))
_SHUTDOWN = frame(to_rank_encoder.encode(Shutdown()))


def bind_rank_listener(path: str) -> socket.socket:
    """The listening socket the ranks connect to (bind it before the ranks start)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(128)
    listener.setblocking(False)
    return listener


class _RankLink:
    """The connection of one rank, or the messages waiting for it to connect."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiting: list[bytes] = []

    def send(self, framed: bytes) -> None:
        if self.transport is not None:
            if not self.transport.is_closing():
                self.transport.write(framed)
        else:
            self.waiting.append(framed)

    def connected(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        for framed in self.waiting:
            transport.write(framed)
        self.waiting.clear()


class _Connection(asyncio.Protocol):
    """One connection from a rank: its hello first, then messages."""

    def __init__(self, channels: RankChannels) -> None:
        self._channels = channels
        self._reader = FrameReader()
        self._transport: asyncio.Transport | None = None
        self._greeted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        payloads = self._reader.feed(data)
        if not payloads:
            return
        decode = from_rank_decoder.decode
        if not self._greeted:
            self._greeted = True
            hello = decode(payloads.pop(0))
            if isinstance(hello, LinkHello) and hello.main and self._transport is not None:
                self._channels.link(hello.rank).connected(self._transport)
        on_messages = self._channels.on_messages
        if payloads and on_messages is not None:
            try:
                on_messages([decode(payload) for payload in payloads])
            except Exception:
                # Raised out of data_received, it would close the rank's link for good; the
                # rank's other messages must still arrive.
                logger.exception("a message from a DP rank could not be handled")


class RankChannels:
    """This API process's connections to every rank; use from the event-loop thread only."""

    def __init__(self, listener: socket.socket, ranks: int, client: int = 0) -> None:
        self._listener = listener
        self._client = client
        self._links = [_RankLink() for _ in range(ranks)]
        self._server: asyncio.AbstractServer | None = None
        self.on_messages: Callable[[list[FromRank]], None] | None = None

    def link(self, rank: int) -> _RankLink:
        return self._links[rank]

    def frame_add(
        self,
        request_id: str,
        packed_prompt: bytes,
        sampling: SamplingOptions,
        images: Images | None = None,
        cache_salt: bytes | None = None,
        kv_transfer_params: KVTransferParams | None = None,
    ) -> bytes:
        """The framed `AddRequest` for `send_framed_add` (sends nothing); the prompt is packed
        by `ipc.codec.pack_token_ids`."""
        message = AddRequest(
            request_id,
            packed_prompt,
            sampling,
            images,
            self._client,
            cache_salt,
            kv_transfer_params,
        )
        return frame(to_rank_encoder.encode(message))

    def send_framed_add(self, rank: int, framed: bytes) -> None:
        """Send a `frame_add` request to `rank` and wake the other ranks into the same round."""
        self._links[rank].send(framed)
        for other, link in enumerate(self._links):
            if other != rank:
                link.send(_WAKE)

    def send_abort(self, rank: int, request_ids: list[str]) -> None:
        self._links[rank].send(frame(to_rank_encoder.encode(AbortRequests(request_ids))))

    def send_shutdown(self) -> None:
        """End every idle rank's wait, so it reaches the agreed stop promptly."""
        for link in self._links:
            if link.transport is not None:  # a rank not connected yet gets nothing to wait on
                link.send(_SHUTDOWN)

    async def read(self, on_messages: Callable[[list[FromRank]], None]) -> None:
        """Accept the ranks' connections and deliver the messages from them to `on_messages`
        as they arrive (those that arrived together in one call), until cancelled."""
        self.on_messages = on_messages
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Connection(self), sock=self._listener)
        try:
            await loop.create_future()
        finally:
            self._server.close()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in self._links:
            if link.transport is not None:
                link.transport.close()
        self._listener.close()
