"""The seam between the HTTP layer and uvicorn: every use of uvicorn's internals is here.

Three things reach past ASGI into uvicorn, for speed, for bounds ASGI cannot express, and for
the server's lifecycle:

- the streaming fast path: a response channel (`response_channel`) that writes a body chunk
  straight to the connection's transport, with the chunk framing uvicorn's httptools protocol
  would write, without a coroutine per chunk;
- the connection guards (`api/connection.py`), a mixin over uvicorn's HTTP protocol, which
  read the request the protocol is on through `request_cycle`, `receiving_body`, `responding`,
  and swap its app with `wrap_app`;
- `HookedServer`, uvicorn's `Server` with the overrides of its methods the server's drain and
  signals need, as hooks (`on_stop_signal`, `on_started`, `before_shutdown`,
  `after_shutdown`).

uvicorn is pinned in pyproject.toml to the minor versions these internals were tested with. Where
they are not there (another ASGI server, uvicorn's h11 protocol, a uvicorn that changed them),
the response channel is the portable one, whose writes all go through the ASGI `send`.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Callable, Generator, Sequence
from types import FrameType
from typing import Any, Protocol

import uvicorn
from starlette.types import ASGIApp, Send
from uvicorn.protocols.http.auto import AutoHTTPProtocol

_HttptoolsCycle: type[Any] | None
try:
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle
except ImportError:  # no httptools (or a uvicorn without this module): the portable path only
    _HttptoolsCycle = None
else:
    _HttptoolsCycle = RequestResponseCycle

#: uvicorn's HTTP protocol: httptools' when installed, else h11's.
HTTP_PROTOCOL: type[asyncio.Protocol] = AutoHTTPProtocol
#: What the fast path reads on uvicorn's httptools request cycle.
_CYCLE_FIELDS = (
    "transport",
    "flow",
    "disconnected",
    "response_started",
    "response_complete",
    "chunked_encoding",
)


class ResponseChannel(Protocol):
    """Where a streamed response's body chunks go."""

    @property
    def write_paused(self) -> bool:
        """The client is not reading fast enough (the transport's buffer is over its mark)."""
        ...

    @property
    def disconnected(self) -> bool:
        """The client has gone."""
        ...

    def write_chunk(self, chunk: bytes) -> bool:
        """Write one body chunk (more to come) now; False, writing nothing, where it cannot be
        written here: then it goes through the ASGI `send`."""
        ...


class PortableChannel:
    """The channel of any ASGI server: nothing is known, every chunk goes through `send`."""

    write_paused = False
    disconnected = False

    def write_chunk(self, chunk: bytes) -> bool:
        return False


class UvicornChannel:
    """The fast path on uvicorn's httptools protocol: a chunk written to the transport exactly
    as that protocol's `send` writes a chunked body message with more to come, whenever `send`
    would do just that (a chunked response under way, the client there and reading)."""

    __slots__ = ("_cycle", "_flow", "_transport")

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle
        self._flow = cycle.flow
        self._transport = cycle.transport

    @property
    def write_paused(self) -> bool:
        return bool(self._flow.write_paused)

    @property
    def disconnected(self) -> bool:
        return bool(self._cycle.disconnected)

    def write_chunk(self, chunk: bytes) -> bool:
        cycle = self._cycle
        if (
            self._flow.write_paused
            or cycle.disconnected
            or not cycle.response_started
            or cycle.response_complete
            or not cycle.chunked_encoding
        ):
            return False
        self._transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        return True


_PORTABLE = PortableChannel()


def response_channel(send: Send) -> ResponseChannel:
    """The channel for a response sent through `send`, the ASGI server's own (not a
    middleware's wrapper): the fast one when `send` is uvicorn's httptools `send` with the
    fields it reads, else the portable one."""
    cycle = getattr(send, "__self__", None)
    if (
        _HttptoolsCycle is None
        or not isinstance(cycle, _HttptoolsCycle)
        or not all(hasattr(cycle, name) for name in _CYCLE_FIELDS)
    ):
        return _PORTABLE
    return UvicornChannel(cycle)


def request_cycle(protocol: asyncio.Protocol) -> object | None:
    """The request a uvicorn HTTP protocol is on (compare by identity), None before its first."""
    return getattr(protocol, "cycle", None)


def receiving_body(protocol: asyncio.Protocol) -> bool:
    """The protocol's request has more body to come (its head is complete)."""
    cycle: Any = request_cycle(protocol)
    return cycle is not None and bool(cycle.more_body)


def responding(protocol: asyncio.Protocol) -> bool:
    """The protocol is on a request whose response is not complete."""
    cycle: Any = request_cycle(protocol)
    return cycle is not None and not cycle.response_complete


def wrap_app(protocol: asyncio.Protocol, wrapper: Callable[[ASGIApp], ASGIApp]) -> None:
    """Serve this connection's requests with `wrapper` around the app uvicorn gave it."""
    instance: Any = protocol
    instance.app = wrapper(instance.app)


def client_address(protocol: asyncio.Protocol) -> tuple[str, int] | None:
    """The connection's peer as uvicorn read it (None where the transport does not say)."""
    client: tuple[str, int] | None = getattr(protocol, "client", None)
    return client


class HookedServer(uvicorn.Server):
    """uvicorn's `Server` with hooks for a drain before its shutdown, and stop signals that stay
    handled: `signals` are recorded, not re-raised after serving as uvicorn does (which would
    kill the process before its ranks are stopped). A second signal sets `stop_now`; with only
    SIGTERM among `signals` (a process whose supervisor forwards signals), a second SIGTERM
    does, as a second SIGINT does otherwise."""

    def __init__(self, config: uvicorn.Config, signals: Sequence[signal.Signals]) -> None:
        super().__init__(config)
        self._signals = tuple(signals)
        #: Set by a second stop signal: stop draining now.
        self.stop_now = asyncio.Event()

    def on_stop_signal(self) -> None:
        """Called at each stop signal, before uvicorn sees it."""

    def on_started(self) -> None:
        """Called once uvicorn listens."""

    async def before_shutdown(self) -> None:
        """Awaited when serving ends, before uvicorn closes the connections."""

    async def after_shutdown(self) -> None:
        """Awaited once uvicorn has closed the connections."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        original = {s: signal.signal(s, self.handle_exit) for s in self._signals}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.on_stop_signal()
        repeated = self.should_exit
        super().handle_exit(sig, frame)
        if repeated and signal.SIGINT not in self._signals:
            self.force_exit = True
        if self.force_exit:
            asyncio.get_event_loop().call_soon_threadsafe(self.stop_now.set)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_started()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self.before_shutdown()
        await super().shutdown(sockets)
        await self.after_shutdown()
