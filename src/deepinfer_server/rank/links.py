"""ApiLinks: a rank's connections to the API server processes (one each, in `client` order).

The API processes listen on Unix stream sockets (`coordinator.channels`); the rank connects to
every one at start-up, says which rank it is (`LinkHello`), and then exchanges length-prefixed
msgpack messages (`ipc.framing`) with each: requests and aborts in, step outputs and reports
out. The rank's loop thread owns the links and never blocks on them: reads never wait beyond
the wait it asks for, and what a socket cannot take yet waits in that link's outbox, sent as the
API process reads. With several API processes, one that stops reading (stopped, hung) must
not stall the rank and so every other process's streams: its outbox is bounded in bytes and in
time without progress, and past either bound its link is declared dead and dropped (the
supervisor, which watches every API process, fails the service and names it). A dropped link's
messages are discarded; the other processes' requests go on meanwhile. With one API process
there is nobody else to serve: past the byte bound the rank waits for it, as a blocking write
would, and a link is never dropped for being slow.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import time
from collections.abc import Sequence

from deepinfer_server.ipc.framing import FrameReader, frame
from deepinfer_server.ipc.messages import FromRank, LinkHello, from_rank_encoder

logger = logging.getLogger(__name__)

_READ_SIZE = 1 << 16
#: Bytes a link may hold for an API process that does not read, beyond the kernel's buffer.
LINK_BACKLOG_BYTES = 64 << 20
#: Seconds an API process may go without reading anything a rank has waiting for it. Longer
#: than the supervisor's own watch (`supervisor.API_SERVER_TIMEOUT`), which names the process.
LINK_STALL_SECONDS = 30.0
#: Seconds without progress after which a backed-up link is logged (once per backlog).
_WARN_SECONDS = 1.0
#: Seconds a report on a connection of its own (`report`) may take per API process.
_REPORT_TIMEOUT = 2.0

_READABLE = select.POLLIN | select.POLLHUP | select.POLLERR


def _connect(address: str, rank: int, main: bool) -> socket.socket:
    link = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    link.connect(address)
    link.sendall(frame(from_rank_encoder.encode(LinkHello(rank, main))))
    return link


class _Outbox:
    """What one link's socket could not take yet, and since when it has taken nothing."""

    def __init__(self) -> None:
        self.pending = bytearray()
        #: time.monotonic() of the last write the socket accepted while bytes were waiting.
        self.progress_at = 0.0
        self.warned = False


class ApiLinks:
    """Connections to every API server process, for the rank loop's thread."""

    def __init__(
        self,
        addresses: Sequence[str],
        rank: int,
        *,
        backlog_bytes: int = LINK_BACKLOG_BYTES,
        stall_seconds: float = LINK_STALL_SECONDS,
    ) -> None:
        self._rank = rank
        #: Whether a slow API process may be cut off so that the others are served.
        self._isolate = len(addresses) > 1
        self._backlog_bytes = backlog_bytes
        self._stall_seconds = stall_seconds
        self._links: list[socket.socket | None] = [
            _connect(address, rank, main=True) for address in addresses
        ]
        self._readers = [FrameReader() for _ in addresses]
        self._outboxes = [_Outbox() for _ in addresses]
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

    def is_live(self, client: int) -> bool:
        """Whether the link to API server process `client` is still up."""
        return self._links[client] is not None

    def wait(self, timeout_ms: int) -> bool:
        """Wait at most `timeout_ms` for something to read; True if there is. Outboxes whose
        sockets have room meanwhile are sent on without ending the wait."""
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            events = self._poller.poll(timeout_ms)
            if self._on_writable(events):
                return True
            timeout_ms = int((deadline - time.monotonic()) * 1000)
            if not events or timeout_ms <= 0:
                return False

    def receive(self) -> list[bytes]:
        """Every whole message that has arrived from any API process (never waits)."""
        payloads: list[bytes] = []
        events = self._poller.poll(0)
        self._on_writable(events)
        for fd, event in events:
            client = self._by_fd.get(fd)
            link = self._links[client] if client is not None else None
            if link is None or client is None or not event & _READABLE:
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
        """Send an already framed message to API server process `client` (never waits)."""
        link = self._links[client]
        if link is None:
            return
        outbox = self._outboxes[client]
        if outbox.pending:  # behind already: keep the order
            outbox.pending += framed
            self._flush(client)
            return
        try:
            sent = link.send(framed)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._drop(client)
            return
        if sent < len(framed):
            outbox.pending += memoryview(framed)[sent:]
            outbox.progress_at = time.monotonic()
            self._poller.modify(link.fileno(), select.POLLIN | select.POLLOUT)

    def close(self) -> None:
        for client in range(len(self._links)):
            self._drop(client)

    def _on_writable(self, events: list[tuple[int, int]]) -> bool:
        """Send on the outboxes whose sockets have room; True if any event is for reading."""
        readable = False
        for fd, event in events:
            if event & select.POLLOUT:
                client = self._by_fd.get(fd)
                if client is not None:
                    self._flush(client)
            readable = readable or bool(event & _READABLE)
        return readable

    def _flush(self, client: int) -> None:
        """Send what the socket takes of the outbox; drop the link past the outbox's bounds."""
        link = self._links[client]
        outbox = self._outboxes[client]
        if link is None:
            return
        now = time.monotonic()
        try:
            while outbox.pending:
                sent = link.send(outbox.pending)
                del outbox.pending[:sent]
                outbox.progress_at = now
        except BlockingIOError:
            pass
        except OSError:
            self._drop(client)
            return
        if not outbox.pending:
            self._poller.modify(link.fileno(), select.POLLIN)
            if outbox.warned:
                logger.info("DP rank %d: API server process %d reads again", self._rank, client)
            outbox.warned = False
        elif len(outbox.pending) > self._backlog_bytes:
            if self._isolate:
                self._declare_dead(client, f"more than {self._backlog_bytes >> 20} MiB waiting")
            else:
                self._wait_until_sent(client)
        elif self._isolate and now - outbox.progress_at > self._stall_seconds:
            self._declare_dead(client, f"nothing read for {self._stall_seconds:g}s")
        elif not outbox.warned and now - outbox.progress_at > _WARN_SECONDS:
            outbox.warned = True
            mib = self._backlog_bytes >> 20
            then = (
                f"the rank goes on; the link is dropped past {mib} MiB or {self._stall_seconds:g}s"
                if self._isolate
                else f"past {mib} MiB the rank waits for it"
            )
            logger.warning(
                "DP rank %d: API server process %d has read nothing for %gs; its messages wait "
                "(%s)",
                self._rank,
                client,
                _WARN_SECONDS,
                then,
            )

    def _wait_until_sent(self, client: int) -> None:
        """Block until the outbox is sent (one API process: nobody else waits meanwhile)."""
        link = self._links[client]
        outbox = self._outboxes[client]
        assert link is not None
        writable = select.poll()  # poll, not select: the rank's descriptors may pass 1024
        writable.register(link.fileno(), select.POLLOUT)
        try:
            while outbox.pending:
                writable.poll()
                with contextlib.suppress(BlockingIOError):
                    del outbox.pending[: link.send(outbox.pending)]
        except OSError:
            self._drop(client)
            return
        self._poller.modify(link.fileno(), select.POLLIN)
        outbox.warned = False

    def _declare_dead(self, client: int, why: str) -> None:
        logger.error(
            "DP rank %d: API server process %d stopped reading (%s); its link is dropped "
            "and the other API server processes are served on",
            self._rank,
            client,
            why,
        )
        self._drop(client)

    def _drop(self, client: int) -> None:
        link = self._links[client]
        if link is None:
            return
        self._links[client] = None
        self._outboxes[client] = _Outbox()
        with contextlib.suppress(KeyError, ValueError):
            self._poller.unregister(link.fileno())
        link.close()


def report(addresses: Sequence[str], rank: int, message: FromRank) -> None:
    """Send one message to every API process on connections of its own (for a thread other
    than the loop's, which owns the links); returns once the bytes are with the kernel, or
    after a few seconds for an API process that takes nothing."""
    payload = frame(from_rank_encoder.encode(message))
    for address in addresses:
        with contextlib.suppress(OSError):
            link = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            with link:
                link.settimeout(_REPORT_TIMEOUT)
                link.connect(address)
                link.sendall(frame(from_rank_encoder.encode(LinkHello(rank, False))) + payload)
