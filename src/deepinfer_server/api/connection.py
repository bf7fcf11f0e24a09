"""Connection guards: header bounds, write deadline and a connection cap, per TCP connection.

uvicorn bounds only idle keep-alive connections (`timeout_keep_alive`); a client that sends
half a request line, or a header every few seconds, or that stops reading a response, would
hold its socket (and a slot) for as long as it likes. `guarded_protocol()` subclasses uvicorn's
HTTP protocol with three bounds, enforced on the transport so that they cover every response
path (SSE streams, JSON bodies, uvicorn's own errors):

- header timeout: a request's headers must be complete within `header_timeout` seconds of its
  first byte (or of the connection opening); otherwise the connection is dropped.
- header size: a request's head is counted as it arrives (`request_head`), before the parser
  keeps any of it; past `--max-header-line-bytes` for one line or `--max-header-bytes` for the
  whole head, or when its bytes do not fit in the process's receive budget, the client gets a
  431 (414 for the request line; 503 for the budget) in the envelope of the path's protocol,
  and the connection is closed once the client stops sending (its bytes are read and dropped
  meanwhile, for at most `LINGER_SECONDS`: closing on unread bytes would reset the connection
  and could discard the answer before the client reads it).
- write timeout: a client that takes no data for `write_timeout` seconds while a response
  waits for it loses the connection. uvicorn then reports the disconnect to the app, which
  aborts the engine request and frees its slot, as for any client that leaves. Two clocks:
  the transport's write buffer over its high-water mark (the kernel refuses more), and, on
  TCP, the bytes the client acknowledged (`TCP_INFO`), sampled a few times per timeout while
  data is queued: the kernel's send buffer grows to megabytes, which at streaming rates took
  minutes to fill before the first clock could start.
- connection cap: beyond `max_connections` open connections, a connection may still ask for
  a probe (`/health`, `/metrics`) and is closed after it; anything else gets a 503 in the
  OpenAI envelope. Beyond the cap plus `PROBE_RESERVE`, the connection that has waited longest
  for request headers is dropped to make room (a probe sends its request at once, so idle
  sockets cannot crowd it out), or the new one if every connection is busy with a request.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import resource
import socket
import struct
import termios
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deepinfer_server.api.path_errors import error_response, raw_error_response
from deepinfer_server.api.receive_budget import ReceiveBudget, ReceiveBufferFullError
from deepinfer_server.api.request_head import HeadLimits, HeadScanner, HeadTooLarge
from deepinfer_server.api.transport import (
    HTTP_PROTOCOL,
    client_address,
    receiving_body,
    request_cycle,
    responding,
    wrap_app,
)
from deepinfer_server.errors import ApiError, ErrorKind, ServiceUnavailableError

logger = logging.getLogger(__name__)

#: Connections over the cap that may still be opened, for probes only.
PROBE_RESERVE = 32
#: File descriptors kept for everything but connections (ranks' sockets, logs, the tokenizer).
OTHER_DESCRIPTORS = 128
PROBE_PATHS = frozenset({"/health", "/metrics"})
#: Seconds a refused request's connection still reads (and drops) what its client sends.
LINGER_SECONDS = 5.0
#: `tcpi_bytes_acked` in Linux's `struct tcp_info` (since 4.1; the layout only grows).
_BYTES_ACKED = struct.Struct("=Q")
_BYTES_ACKED_OFFSET = 120
#: The `int` TIOCOUTQ (SIOCOUTQ) fills in: bytes not yet acknowledged, sent or not.
_QUEUED = struct.Struct("@i")
_TCP_INFO_LENGTH = 256
#: Samples of a connection's progress per write timeout, and the longest wait between two.
_PROGRESS_SAMPLES = 4
_MAX_PROGRESS_INTERVAL = 5.0


def delivery_progress(sock: Any) -> tuple[int, int] | None:
    """(bytes the peer acknowledged, bytes in the kernel's send queue) of a TCP socket; None
    where the kernel does not tell (not TCP, not Linux)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LENGTH)
        queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (OSError, AttributeError, ValueError):
        return None
    if len(info) < _BYTES_ACKED_OFFSET + _BYTES_ACKED.size:
        return None
    return _BYTES_ACKED.unpack_from(info, _BYTES_ACKED_OFFSET)[0], _QUEUED.unpack(queued)[0]


def _ignore(status: int) -> None:
    pass


@dataclass
class ConnectionLimits:
    """The per-connection bounds of one server, and its count of open connections."""

    header_timeout: float
    write_timeout: float
    max_connections: int
    heads: HeadLimits
    #: What requests still being received hold, shared with the body reader.
    receiving: ReceiveBudget
    #: Told the status of each request refused here, before the app saw it.
    on_refused: Callable[[int], None] = _ignore
    open_connections: int = field(default=0, init=False)
    #: Connections waiting for request headers, oldest first (the ones dropped when full).
    waiting: dict[Any, None] = field(default_factory=dict, init=False)


def probes_only(app: ASGIApp) -> ASGIApp:
    """`app` for probe paths only (and the connection closes after them); 503 for the rest."""

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        async def send_closing(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"connection", b"close")]
            await send(message)

        if scope["type"] == "http" and scope["path"] in PROBE_PATHS:
            await app(scope, receive, send_closing)
            return
        error = ServiceUnavailableError(
            "the server has too many open connections (--max-connections); retry later",
            kind=ErrorKind.TOO_MANY_CONNECTIONS,
        )
        await error_response(error, scope)(scope, receive, send_closing)

    return guarded


class _Guards(asyncio.Protocol):
    """The guards, mixed in before one of uvicorn's HTTP protocols (httptools or h11)."""

    limits: ConnectionLimits

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._loop = asyncio.get_running_loop()
        self._transport = transport
        self._head: HeadScanner | None = None
        self._head_held = 0
        self._refused = False
        self._linger_timer: asyncio.TimerHandle | None = None
        self._header_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._progress_timer: asyncio.TimerHandle | None = None
        limits = self.limits
        self._socket = transport.get_extra_info("socket")
        if limits.write_timeout > 0 and delivery_progress(self._socket) is not None:
            self._acked = 0
            self._progress_at = self._loop.time()
            self._progress_interval = min(
                limits.write_timeout / _PROGRESS_SAMPLES, _MAX_PROGRESS_INTERVAL
            )
            self._arm_progress_timer()
        limits.open_connections += 1
        self._counted = True
        self._arm_header_timer()
        if limits.open_connections > limits.max_connections + PROBE_RESERVE:
            oldest = next(iter(limits.waiting), self)
            oldest._cancel_header_timer()  # not picked twice while its abort is under way
            oldest._transport.abort()
            if oldest is self:
                return
        if limits.open_connections > limits.max_connections:
            wrap_app(self, probes_only)

    def connection_lost(self, exc: Exception | None) -> None:
        if getattr(self, "_counted", False):
            self._counted = False
            self.limits.open_connections -= 1
        self._cancel_timers()
        self._release_head()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:  # what a refused client still sends: read and dropped
            return
        if not self._count_head(data):
            return
        cycle = request_cycle(self)
        super().data_received(data)
        if request_cycle(self) is not cycle:  # a request's headers are complete
            self._cancel_header_timer()
        elif not responding(self):  # the next request began
            self._arm_header_timer()

    def _count_head(self, data: bytes) -> bool:
        """Count `data` into the request head being received, if one is (the bytes of a body
        are the app's to bound); False when the request is refused for it."""
        head = self._head
        if head is None:
            if receiving_body(self):
                return True
            head = self._head = HeadScanner(self.limits.heads)
        try:
            end = head.feed(data)
        except HeadTooLarge as exc:
            self._refuse(exc.error, head)
            return False
        grown = head.size - self._head_held
        if grown:
            if not self.limits.receiving.take(grown, force=head.path in PROBE_PATHS):
                self._refuse(ReceiveBufferFullError(), head)
                return False
            self._head_held = head.size
        if end is not None:  # the parser holds the head from here, as the request's
            self._release_head()
        return True

    def _release_head(self) -> None:
        self._head = None
        if getattr(self, "_head_held", 0):
            self.limits.receiving.give(self._head_held)
            self._head_held = 0

    def _refuse(self, error: ApiError, head: HeadScanner) -> None:
        """Answer `error` instead of parsing the rest of the head, then close."""
        self._release_head()
        self._refused = True
        self._cancel_header_timer()
        self.limits.on_refused(error.status_code)
        logger.info("refused a request from %s: %s", _peer(client_address(self)), error.message)
        if responding(self):
            self._transport.abort()  # a response is under way: no room for another
            return
        versioned = [(b"anthropic-version", b"")] if head.anthropic_version else []
        self._transport.write(raw_error_response(error, {"path": head.path, "headers": versioned}))
        if self._transport.can_write_eof():
            self._transport.write_eof()
            self._linger_timer = self._loop.call_later(LINGER_SECONDS, self._transport.abort)
        else:
            self._transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self._loop.call_later(
                self.limits.write_timeout, self._write_expired
            )

    def resume_writing(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().resume_writing()

    def _arm_progress_timer(self) -> None:
        self._progress_timer = self._loop.call_later(self._progress_interval, self._check_progress)

    def _check_progress(self) -> None:
        """Drop the connection when data has waited for the client, and the client has
        acknowledged none of it, for the write timeout."""
        self._progress_timer = None
        if self._transport.is_closing():
            return
        progress = delivery_progress(self._socket)
        if progress is None:
            return
        acked, queued = progress
        now = self._loop.time()
        if acked != self._acked or queued + self._transport.get_write_buffer_size() == 0:
            self._acked = acked
            self._progress_at = now
        elif now - self._progress_at >= self.limits.write_timeout:
            self._write_expired()
            return
        self._arm_progress_timer()

    def _arm_header_timer(self) -> None:
        if self._header_timer is None and not self._transport.is_closing():
            self._header_timer = self._loop.call_later(
                self.limits.header_timeout, self._headers_expired
            )
            self.limits.waiting[self] = None

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
            self.limits.waiting.pop(self, None)

    def _cancel_timers(self) -> None:
        self._cancel_header_timer()
        if getattr(self, "_linger_timer", None) is not None:
            self._linger_timer.cancel()  # type: ignore[union-attr]
            self._linger_timer = None
        if getattr(self, "_write_timer", None) is not None:
            self._write_timer.cancel()  # type: ignore[union-attr]
            self._write_timer = None
        if getattr(self, "_progress_timer", None) is not None:
            self._progress_timer.cancel()  # type: ignore[union-attr]
            self._progress_timer = None

    def _headers_expired(self) -> None:
        self._header_timer = None
        self.limits.waiting.pop(self, None)
        logger.info(
            "closing a connection from %s: no complete request headers within %gs "
            "(--header-timeout)",
            _peer(client_address(self)),
            self.limits.header_timeout,
        )
        self._transport.abort()

    def _write_expired(self) -> None:
        self._write_timer = None
        logger.info(
            "closing a connection from %s: the client read nothing for %gs (--write-timeout)",
            _peer(client_address(self)),
            self.limits.write_timeout,
        )
        self._transport.abort()


def fit_to_file_limit(max_connections: int) -> int:
    """The connection cap this process can honour with its open-file limit.

    Raises the soft RLIMIT_NOFILE towards the hard limit if the cap needs it; if that is not
    enough, lowers the cap (with a warning) so that the probe reserve and the server's other
    descriptors always fit, and /health keeps answering however many sockets are open.
    """
    needed = max_connections + PROBE_RESERVE + OTHER_DESCRIPTORS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        raised = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return max_connections
    fitted = max(1, soft - PROBE_RESERVE - OTHER_DESCRIPTORS)
    logger.warning(
        "--max-connections %d lowered to %d: the open-file limit is %d (raise it with ulimit -n)",
        max_connections,
        fitted,
        soft,
    )
    return fitted


def _peer(client: tuple[str, int] | None) -> str:
    return "-" if client is None else f"{client[0]}:{client[1]}"


def guarded_protocol(
    limits: ConnectionLimits, base: type[asyncio.Protocol] = HTTP_PROTOCOL
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (`base`: httptools' when installed, else h11's) bound to
    `limits`; pass it as `uvicorn.Config(http=...)`."""
    return type("GuardedHTTPProtocol", (_Guards, base), {"limits": limits})
