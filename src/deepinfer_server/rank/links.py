"""ApiLinks: a rank's connections to the API server processes (one each, in `client` order).

The API processes listen on Unix stream sockets (`coordinator.channels`); the rank connects to
every one at start-up, says which rank it is (`LinkHello`), and then exchanges length-prefixed
msgpack messages (`ipc.framing`) with each: requests and aborts in, step outputs and reports
out. The rank's loop thread owns the links; reads never block beyond the wait it asks for,
writes block only while a socket's buffer is full (the API process reads continuously). A link
whose API process has gone is dropped, and what is sent to it is discarded: the service has
failed by then, and the other processes' requests must go on meanwhile.
"""

from __future__ import annotations

import contextlib
import select
import socket
from collections.abc import Sequence

from deepinfer_server.ipc.framing import FrameReader, frame
from deepinfer_server.ipc.messages import FromRank, LinkHello, from_rank_encoder

_READ_SIZE = 1 << 16


def _connect(address: str, rank: int, main: bool) -> socket.socket:
    link = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    link.connect(address)
    link.sendall(frame(from_rank_encoder.encode(LinkHello(rank, main))))
    return link


class ApiLinks:
    """Connections to every API server process, for the rank loop's thread."""

    def __init__(self, addresses: Sequence[str], rank: int) -> None:
        self._links: list[socket.socket | None] = [
            _connect(address, rank, main=True) for address in addresses
        ]
        self._readers = [FrameReader() for _ in addresses]
        self._poller = select.poll()
        self._by_fd: dict[int, int] = {}
        for client, link in enumerate(self._links):
            assert link is not None
            link.setblocking(False)
            self._poller.register(link.fileno(), select.POLLIN)
            self._by_fd[link.fileno()] = client

    @property
    def count(self) -> int:
        """How many API server processes there are (live or not)."""
        return len(self._links)

    def wait(self, timeout_ms: int) -> bool:
        """Wait at most `timeout_ms` for something to read; True if there is."""
        return bool(self._poller.poll(timeout_ms))

    def receive(self) -> list[bytes]:
        """Every whole message that has arrived from any API process (never waits)."""
        payloads: list[bytes] = []
        for fd, _ in self._poller.poll(0):
            client = self._by_fd[fd]
            link = self._links[client]
            if link is None:
                continue
            while True:
                try:
                    data = link.recv(_READ_SIZE)
                except BlockingIOError:
                    break
                except OSError:
                    data = b""
                if not data:  # the API process has gone
                    self._drop(client)
                    break
                payloads.extend(self._readers[client].feed(data))
        return payloads

    def send(self, client: int, message: FromRank) -> None:
        """Send one message to API server process `client`."""
        self.send_payload(client, frame(from_rank_encoder.encode(message)))

    def send_all(self, message: FromRank) -> None:
        """Send one message to every API server process."""
        payload = frame(from_rank_encoder.encode(message))
        for client in range(len(self._links)):
            self.send_payload(client, payload)

    def send_payload(self, client: int, framed: bytes) -> None:
        """Send an already framed message to API server process `client`."""
        link = self._links[client]
        if link is None:
            return
        try:
            _send_blocking(link, framed)
        except OSError:
            self._drop(client)

    def close(self) -> None:
        for client in range(len(self._links)):
            self._drop(client)

    def _drop(self, client: int) -> None:
        link = self._links[client]
        if link is None:
            return
        self._links[client] = None
        with contextlib.suppress(KeyError, ValueError):
            self._poller.unregister(link.fileno())
        link.close()


def _send_blocking(link: socket.socket, data: bytes) -> None:
    """`sendall` on a non-blocking socket: wait for room while the reader catches up."""
    view = memoryview(data)
    writable: select.poll | None = None
    while view:
        try:
            sent = link.send(view)
        except BlockingIOError:
            if writable is None:  # poll, not select: the rank's descriptors may pass 1024
                writable = select.poll()
                writable.register(link.fileno(), select.POLLOUT)
            writable.poll()
            continue
        view = view[sent:]


def report(addresses: Sequence[str], rank: int, message: FromRank) -> None:
    """Send one message to every API process on connections of its own (for a thread other
    than the loop's, which owns the links); returns once the bytes are with the kernel."""
    payload = frame(from_rank_encoder.encode(message))
    for address in addresses:
        with contextlib.suppress(OSError):
            link = _connect(address, rank, main=False)
            with link:
                link.sendall(payload)
