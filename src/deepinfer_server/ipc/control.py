"""The control channel between the supervisor and one API server process (`--api-server-count`).

One stream socket pair per API server process carries a few small messages both ways: start-up
and shutdown steps, failures (a failure seen anywhere fails the service everywhere), the
supervisor's liveness pings (an API process that stops answering them is declared stuck), and
the metrics snapshots that make /metrics and /get_load one view. The supervisor relays snapshot
requests and replies between the API server processes. Messages are pickled (both ends are
this package) in the rank links' frames (`framing`), and sending never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
from dataclasses import dataclass

from deepinfer_server.ipc.framing import frame, read_frame


@dataclass(frozen=True)
class Serving:
    """API server process -> supervisor: it has every rank's RankReady and accepts requests."""


@dataclass(frozen=True)
class AllServing:
    """Supervisor -> API server process: every API server process serves; until then /health
    says the server is still starting (a readiness probe must not route to half a server)."""


@dataclass(frozen=True)
class Warm:
    """API server process -> supervisor: its start-up warm-up is over (`api.warmup`: warm,
    given up on, or nothing to warm)."""


@dataclass(frozen=True)
class AllWarm:
    """Supervisor -> API server process: every API server process is warm; until then /health
    says the server is still starting (the first structured request must not land on a process
    whose grammar compile workers are still starting)."""


@dataclass(frozen=True)
class Failed:
    """Both ways: the service has failed for `reason` (the first reason wins everywhere)."""

    reason: str


@dataclass(frozen=True)
class RankReport:
    """API server process -> supervisor: a rank said why it failed (the supervisor, which sees
    the rank processes exit, decides which failure is the cause: `FailureCause`)."""

    rank: int
    reason: str


@dataclass(frozen=True)
class Drained:
    """API server process -> supervisor: its drain is over; no request of it is left."""


@dataclass(frozen=True)
class Exit:
    """Supervisor -> API server process: the ranks are stopped; close the sockets and exit."""


@dataclass(frozen=True)
class _SnapshotExchange:
    """A snapshot request or reply: the requesting process and the request's token."""

    requester: int
    token: int


@dataclass(frozen=True)
class SnapshotRequest(_SnapshotExchange):
    """Process `requester` asks every other API server process for its metrics snapshot."""

    #: False: rank loads only (what /get_load needs, polled often by routers).
    metrics: bool = True


@dataclass(frozen=True)
class SnapshotReply(_SnapshotExchange):
    """One process's answer to `SnapshotRequest` `token` (a `metrics.aggregate.Snapshot`)."""

    snapshot: object


@dataclass(frozen=True)
class Ping:
    """Supervisor -> API server process: answer with `Pong` (its event loop is alive)."""


@dataclass(frozen=True)
class Pong:
    """API server process -> supervisor: the answer to `Ping`."""


ControlMessage = (
    Serving
    | AllServing
    | Warm
    | AllWarm
    | Failed
    | RankReport
    | Drained
    | Exit
    | SnapshotRequest
    | SnapshotReply
    | Ping
    | Pong
)


class ControlChannel:
    """One end of a control socket pair; use from the event-loop thread only."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, sock: socket.socket) -> ControlChannel:
        """Wrap a connected stream socket (one end of `socket.socketpair()`)."""
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        return cls(reader, writer)

    def send(self, message: ControlMessage) -> None:
        """Queue `message` (never blocks); dropped once the other end is gone."""
        if self._writer.is_closing():
            return
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._writer.write(frame(payload))

    async def receive(self) -> ControlMessage | None:
        """The next message, or None once the other end has closed (or died)."""
        try:
            payload = await read_frame(self._reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        message: ControlMessage = pickle.loads(payload)
        return message

    def close(self) -> None:
        self._writer.close()
