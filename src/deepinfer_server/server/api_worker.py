"""One API server process of `--api-server-count N` (N > 1), spawned by the supervisor.

It runs what the single-process server runs, over the listening socket the supervisor bound: its
own event loop, a socket every rank connects to (`RankChannels`, with its number as `client`),
Coordinator and uvicorn. What must stay global goes through the supervisor: admission counts
live in shared memory (`SharedAdmission`), failures travel over the control channel both ways,
and /metrics and /get_load ask the other processes for their snapshots. Ctrl-C reaches the whole
process group, so SIGINT is ignored here: the supervisor forwards every stop signal as SIGTERM,
once to drain, again to stop draining.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import signal
import socket
import sys
from dataclasses import dataclass, field

from deepinfer_server.api.warmup import GrammarWarmup
from deepinfer_server.config import ResolvedConfig
from deepinfer_server.config.logs import configure_logging
from deepinfer_server.coordinator.admission import SharedAdmission, SharedState
from deepinfer_server.coordinator.channels import RankChannels
from deepinfer_server.coordinator.coordinator import Coordinator
from deepinfer_server.ipc import control
from deepinfer_server.ipc.control import ControlChannel
from deepinfer_server.metrics import ServerMetrics
from deepinfer_server.metrics.aggregate import Snapshot, take_snapshot
from deepinfer_server.model.tokenizer import load_tokenizer_json
from deepinfer_server.rank.proc import die_with_parent
from deepinfer_server.server.http import (
    WRITES_AT_SHUTDOWN,
    build_server,
    create_recipe,
    response_store,
    run_loop,
    wait_for_ranks,
)

logger = logging.getLogger("deepinfer_server")

#: Seconds a scrape waits for the other processes' snapshots (then it answers without them).
SNAPSHOT_TIMEOUT = 2.0


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one API server process needs, picklable for spawn (sockets included)."""

    config: ResolvedConfig
    index: int
    #: The local checkpoint (None: the embedded tokenizer); each process loads the tokenizer
    #: itself, which keeps the spec small and the processes' start-ups parallel.
    checkpoint: str | None
    #: The socket the ranks connect to (bound by the supervisor before they start).
    rank_listener: socket.socket
    listener: socket.socket
    control: socket.socket
    #: The shared admission counts and wake sockets (`admission.shared_state`).
    slots: SharedState
    #: The reasoning seal's key (`reasoning_seal.seal_key`), made once by the supervisor: a
    #: blob sealed by one process must open in every other. Spawn arguments, never the
    #: environment, so the rank processes never hold it.
    reasoning_key: bytes = field(repr=False, default=b"")


class ControlPeers:
    """The other API server processes, reached through the supervisor (`api.state.Peers`)."""

    def __init__(
        self,
        index: int,
        count: int,
        channel: ControlChannel,
        coordinator: Coordinator,
        metrics: ServerMetrics,
    ) -> None:
        self.index = index
        self.all_serving = False
        self.all_warm = False
        self._others = count - 1
        self._channel = channel
        self._coordinator = coordinator
        self._metrics = metrics
        self._tokens = itertools.count()
        self._pending: dict[int, tuple[list[Snapshot], asyncio.Future[None]]] = {}
        self._warm_told: asyncio.Future[None] | None = None
        self.exit_requested = asyncio.Event()

    async def snapshots(self, metrics: bool = True) -> list[Snapshot]:
        token = next(self._tokens)
        replies: list[Snapshot] = []
        complete = asyncio.get_running_loop().create_future()
        self._pending[token] = (replies, complete)
        self._channel.send(control.SnapshotRequest(self.index, token, metrics))
        try:
            async with asyncio.timeout(SNAPSHOT_TIMEOUT):
                await complete
        except TimeoutError:
            logger.warning(
                "metrics: %d of %d API server processes did not answer within %gs",
                self._others - len(replies),
                self._others,
                SNAPSHOT_TIMEOUT,
            )
        finally:
            del self._pending[token]
        return list(replies)

    def started(self, warmup: GrammarWarmup) -> None:
        """This process accepts requests: tell the supervisor now, and again once its warm-up
        is over (the supervisor answers AllWarm when every process's is)."""
        self._channel.send(control.Serving())
        self._warm_told = asyncio.ensure_future(self._tell_warm(warmup))

    async def _tell_warm(self, warmup: GrammarWarmup) -> None:
        await warmup.over()
        self._channel.send(control.Warm())

    async def listen(self) -> None:
        """Handle the supervisor's messages until it says exit (or is gone)."""
        while (message := await self._channel.receive()) is not None:
            if isinstance(message, control.Ping):
                self._channel.send(control.Pong())
            elif isinstance(message, control.AllServing):
                self.all_serving = True
            elif isinstance(message, control.AllWarm):
                self.all_warm = True
            elif isinstance(message, control.Failed):
                self._coordinator.fail_service(message.reason)
            elif isinstance(message, control.SnapshotRequest):
                loads = self._coordinator.rank_loads()
                snapshot = (
                    take_snapshot(self._metrics, loads)
                    if message.metrics
                    else Snapshot(rank_loads=loads)
                )
                self._channel.send(
                    control.SnapshotReply(message.requester, message.token, snapshot)
                )
            elif isinstance(message, control.SnapshotReply):
                self._on_reply(message)
            elif isinstance(message, control.Exit):
                break
        self.exit_requested.set()

    def _on_reply(self, reply: control.SnapshotReply) -> None:
        pending = self._pending.get(reply.token)
        if pending is None:  # answered after the scrape gave up on it
            return
        replies, complete = pending
        assert isinstance(reply.snapshot, Snapshot)
        replies.append(reply.snapshot)
        if len(replies) >= self._others and not complete.done():
            complete.set_result(None)


async def _serve(spec: WorkerSpec) -> int:
    config = spec.config
    channel = await ControlChannel.open(spec.control)
    metrics = ServerMetrics(config.served_model_name)
    channels = RankChannels(spec.rank_listener, config.data_parallel_size, client=spec.index)
    coordinator = Coordinator(
        config,
        channels,
        metrics,
        admission=SharedAdmission.for_process(config, spec.slots, spec.index),
        on_failure=lambda reason: channel.send(control.Failed(reason)),
        on_rank_report=lambda rank, reason: channel.send(control.RankReport(rank, reason)),
    )
    peers = ControlPeers(spec.index, config.api_server_count, channel, coordinator, metrics)
    listener = asyncio.ensure_future(peers.listen())
    try:
        tokenizer_json = load_tokenizer_json(spec.checkpoint)
        # Checked by the supervisor; one seal key for every process, so blobs open anywhere.
        recipe = create_recipe(config, tokenizer_json, spec.checkpoint, spec.reasoning_key)
        coordinator.start()
        failed = await wait_for_ranks(coordinator, config.startup_timeout, [signal.SIGTERM])
        if failed is not None:
            return failed
        async with response_store(config, evicts=spec.index == 0) as store:
            server = build_server(
                config,
                recipe,
                tokenizer_json,
                coordinator,
                metrics,
                peers=peers,
                signals=[signal.SIGTERM],
                on_started=lambda: peers.started(server.state.warmup),
                store=store,
            )
            await server.serve(sockets=[spec.listener])
            await server.state.wait_background(WRITES_AT_SHUTDOWN)
        if not server.started:
            return 1
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the supervisor says when to exit
        coordinator.stop_watching()  # the supervisor stops the ranks next
        channel.send(control.Drained())
        await peers.exit_requested.wait()  # the supervisor stops the ranks meanwhile
        return 0
    finally:
        listener.cancel()
        await coordinator.release()
        channel.close()


def run_api_worker(spec: WorkerSpec) -> None:
    """Spawn target of API server process `spec.index`."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(spec.config.log_level, f"api {spec.index}")
    sys.exit(run_loop(_serve(spec)))
