"""Admission: how many requests may be in flight, which one starts next, and on which rank.

A request is admitted (429 beyond `dp * max_num_seqs + max_queued_requests` in flight, or beyond
its key's queue limit) into the server's queue, and starts, i.e. is sent to a rank, only while
that rank runs fewer than `--max-num-seqs`: the engine's own queue is first come, first served,
so whatever waits for a running slot waits here, where the order is fair between API keys.

A key's queue limit is its `max_queued`, else, with several keys, `--key-queued-share` of
`--max-queued-requests`: one key's flood (background responses hold no connection, a batch
line fans out to `n` requests) fills its own share and is refused with a 429 that names it,
while the rest of the queue stays open to the other keys.

Which request starts when a slot frees:
- between keys, the one whose key runs the fewest requests for its weight (ties: the key served
  least recently), among keys under their running limit: a key's `max_running`, else, with
  several keys, `--key-running-share` of the running slots, so that one key's flood leaves a
  slot for another key's next request;
- within a key, the lowest `priority` first, then the earliest.

It goes to the least-loaded rank with a free slot, or, with a hint, to the rank holding its session
or its prompt's longest cached prefix unless that one is much more loaded (`rank_router.py`).

With several API server processes (`--api-server-count`) the counts live in shared memory under
one lock (`SharedAdmission`); each process queues its own requests, and when the request due next
waits in another process, that process is woken through its wake socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import multiprocessing
import socket
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from deepinfer_server.config import ResolvedConfig
from deepinfer_server.config.tenants import Tenant
from deepinfer_server.coordinator.admission_limits import (
    Layout,
    Shares,
    queue_limit,
    running_limit,
)
from deepinfer_server.coordinator.prefix_routing import RankHint
from deepinfer_server.errors import OverloadedError, ServiceFailedError


def choose_rank(in_flight: Sequence[int], hint: RankHint | None = None) -> int:
    """The least-loaded rank (ties go to the lowest rank number), or the hint's choice."""
    least = min(range(len(in_flight)), key=in_flight.__getitem__)
    return least if hint is None else hint.choose(in_flight, least)


@dataclass(eq=False)
class Ticket:
    """One admitted request: queued until `rank` is set, then running there."""

    tenant: int
    priority: int
    order: int
    hint: RankHint | None = None
    rank: int | None = None
    #: The caller's name for the request.
    request_id: str = ""
    #: The engine has ended it: its running slot is free, its stream may still be open.
    finished: bool = field(default=False, repr=False)
    released: bool = field(default=False, repr=False)

    def __lt__(self, other: Ticket) -> bool:
        return (self.priority, self.order) < (other.priority, other.order)


class Admission:
    """Admission in one API server process (see the module's docstring)."""

    def __init__(
        self,
        data_parallel_size: int,
        capacity: int,
        *,
        max_num_seqs: int | None = None,
        tenants: Sequence[Tenant] = (Tenant("default"),),
        running_share: float = 1.0,
        queued_share: float = 1.0,
    ) -> None:
        layout = Layout(data_parallel_size, len(tenants), 1)
        shares = Shares(running_share, queued_share)
        self._setup(layout, capacity, max_num_seqs, tenants, shares, [0] * layout.size, 0)

    @classmethod
    def for_config(cls, config: ResolvedConfig) -> Admission:
        """One process's admission of `config`'s ranks, capacity, tenants and shares."""
        return cls(
            config.data_parallel_size,
            config.admission_capacity,
            max_num_seqs=config.admission_running_limit,
            tenants=config.tenants,
            running_share=config.admission_running_share,
            queued_share=config.admission_queued_share,
        )

    def _setup(
        self,
        layout: Layout,
        capacity: int,
        max_num_seqs: int | None,
        tenants: Sequence[Tenant],
        shares: Shares,
        counts: Any,
        process: int,
    ) -> None:
        self.capacity = capacity
        self._layout = layout
        self._counts = counts
        self._process = process
        #: None: no running limit per rank (every admitted request starts at once).
        self._per_rank = max_num_seqs
        self._tenants = tuple(tenants)
        running = layout.ranks * (max_num_seqs or capacity)
        self._limits = [running_limit(t, running, len(tenants), shares.running) for t in tenants]
        self._queue_limits = [
            queue_limit(t, max(0, capacity - running), len(tenants), shares.queued) for t in tenants
        ]
        self._queues: list[list[Ticket]] = [[] for _ in tenants]
        self._order = itertools.count()
        #: This process's admitted requests by priority (the batch runner finds its own by it).
        self._priorities: Counter[int] = Counter()

    # Counts

    @contextlib.contextmanager
    def _locked(self) -> Iterator[Any]:
        yield self._counts

    @property
    def in_flight(self) -> list[int]:
        """Requests started on each rank."""
        with self._locked() as counts:
            return list(counts[: self._layout.ranks])

    @property
    def total(self) -> int:
        """Requests admitted, running or queued, by every API server process (not those the
        engine has ended whose responses are still being written)."""
        layout = self._layout
        with self._locked() as counts:
            return int(
                sum(counts[: layout.ranks])
                + sum(counts[layout.waiting : layout.waiting + layout.tenants])
            )

    def tenant_name(self, tenant: int) -> str:
        """The name of tenant number `tenant`."""
        return self._tenants[tenant].name

    def tenant_counts(self) -> list[tuple[str, int, int]]:
        """(tenant name, running, queued) of every tenant, over every API server process."""
        layout = self._layout
        with self._locked() as counts:
            return [
                (tenant.name, counts[layout.running + t], counts[layout.waiting + t])
                for t, tenant in enumerate(self._tenants)
            ]

    def admitted_at(self, priority: int) -> int:
        """This process's requests of `priority` admitted now (queued, or running until the
        engine ends them, as `total` counts them)."""
        return self._priorities[priority]

    # Requests

    def admit(self, tenant: int = 0, priority: int = 0, hint: RankHint | None = None) -> Ticket:
        """Queue a request of `tenant` (429 when the server or the tenant's queue is full);
        `ready()` says when it starts."""
        layout = self._layout
        with self._locked() as counts:
            # The key's own limit first: a flood is refused naming it, not the server's capacity.
            limit = self._queue_limits[tenant]
            if limit is not None and counts[layout.waiting + tenant] >= limit.requests + self._free(
                counts, tenant
            ):
                raise OverloadedError(
                    f"this API key has {limit.requests} requests waiting, {limit.source}; "
                    "retry later"
                )
            admitted = sum(counts[: layout.ranks]) + sum(
                counts[layout.waiting : layout.waiting + layout.tenants]
            )
            if admitted >= self.capacity:
                raise OverloadedError(
                    f"the server is at capacity ({self.capacity} requests in flight); retry later"
                )
            ticket = Ticket(tenant, priority, next(self._order), hint)
            counts[layout.waiting + tenant] += 1
            counts[layout.queued_in + self._process * layout.tenants + tenant] += 1
        heapq.heappush(self._queues[tenant], ticket)
        self._priorities[priority] += 1
        return ticket

    def ready(self) -> list[Ticket]:
        """The queued requests of this process that start now, each with its rank set (the
        caller sends them); wakes another process whose request is due."""
        layout = self._layout
        started: list[Ticket] = []
        with self._locked() as counts:
            while True:
                loads = list(counts[: layout.ranks])
                if self._per_rank is not None and min(loads) >= self._per_rank:
                    break
                tenant = self._due(counts)
                if tenant is None:
                    break
                ticket = self._pop(tenant)
                if ticket is None:  # its next request waits in another process
                    self._wake_holders(counts, tenant)
                    break
                if self._per_rank is not None:
                    loads = [n if n < self._per_rank else 2**62 for n in loads]
                rank = choose_rank(loads, ticket.hint)
                ticket.rank = rank
                counts[rank] += 1
                counts[layout.running + tenant] += 1
                counts[layout.waiting + tenant] -= 1
                counts[layout.queued_in + self._process * layout.tenants + tenant] -= 1
                counts[layout.clock] += 1
                counts[layout.served + tenant] = counts[layout.clock]
                started.append(ticket)
        return started

    def finished(self, ticket: Ticket) -> None:
        """The engine ended a started request: its running slot is free while its response is
        still being written; call `ready()` after."""
        if ticket.rank is None or ticket.finished or ticket.released:
            return
        ticket.finished = True
        self._priorities[ticket.priority] -= 1
        layout = self._layout
        with self._locked() as counts:
            counts[ticket.rank] -= 1
            counts[layout.running + ticket.tenant] -= 1

    def release(self, ticket: Ticket) -> None:
        """The request ended, or left the queue (once per ticket); call `ready()` after."""
        if ticket.released:
            return
        ticket.released = True
        if ticket.finished:
            return
        self._priorities[ticket.priority] -= 1
        layout = self._layout
        with self._locked() as counts:
            if ticket.rank is None:
                counts[layout.waiting + ticket.tenant] -= 1
                counts[layout.queued_in + self._process * layout.tenants + ticket.tenant] -= 1
            else:
                counts[ticket.rank] -= 1
                counts[layout.running + ticket.tenant] -= 1

    def _free(self, counts: Any, tenant: int) -> int:
        """1 if a request of `tenant` would start at once (nothing of its own queued, a slot
        free and the tenant under its running limit), else 0: that one does not queue."""
        layout = self._layout
        room = self._per_rank is None or min(counts[: layout.ranks]) < self._per_rank
        below = counts[layout.running + tenant] < self._limits[tenant]
        return int(room and below and counts[layout.waiting + tenant] == 0)

    def _due(self, counts: Any) -> int | None:
        """The tenant whose request starts next: the fewest running for its weight."""
        layout = self._layout
        best: tuple[float, int] | None = None
        due = None
        for t, tenant in enumerate(self._tenants):
            running = counts[layout.running + t]
            if counts[layout.waiting + t] <= 0 or running >= self._limits[t]:
                continue
            key = (running / tenant.weight, counts[layout.served + t])
            if best is None or key < best:
                best, due = key, t
        return due

    def _pop(self, tenant: int) -> Ticket | None:
        queue = self._queues[tenant]
        while queue:
            ticket = heapq.heappop(queue)
            if not ticket.released:
                return ticket
        return None

    def _wake_holders(self, counts: Any, tenant: int) -> None:
        """Another process holds `tenant`'s next request (none in one process)."""


#: Seconds to wait for the shared counts' lock; only an API process killed while holding it
#: (for microseconds) makes anyone wait that long.
_LOCK_TIMEOUT = 1.0


@dataclass
class SharedState:
    """What `SharedAdmission` shares between API server processes (picklable for spawn)."""

    counts: Any
    #: Per process: the end it reads its wake-ups from, and the end the others write to.
    wake_readers: list[socket.socket]
    wake_writers: list[socket.socket]


def shared_state(data_parallel_size: int, tenants: int, processes: int) -> SharedState:
    """The shared counts and wake sockets, for `SharedAdmission` (create them before spawning
    the API server processes and hand them to each)."""
    layout = Layout(data_parallel_size, tenants, processes)
    counts = multiprocessing.get_context("spawn").Array("q", layout.size)
    pairs = [socket.socketpair() for _ in range(processes)]
    for reader, writer in pairs:
        reader.setblocking(False)
        writer.setblocking(False)
    return SharedState(counts, [r for r, _ in pairs], [w for _, w in pairs])


class SharedAdmission(Admission):
    """`Admission` across every API server process (`--api-server-count`): the counts live in
    shared memory, so capacity, fairness and the rank choice see every process's requests."""

    def __init__(
        self,
        data_parallel_size: int,
        capacity: int,
        state: SharedState,
        process: int,
        *,
        max_num_seqs: int | None = None,
        tenants: Sequence[Tenant] = (Tenant("default"),),
        running_share: float = 1.0,
        queued_share: float = 1.0,
    ) -> None:
        layout = Layout(data_parallel_size, len(tenants), len(state.wake_writers))
        self._state = state
        shares = Shares(running_share, queued_share)
        self._setup(layout, capacity, max_num_seqs, tenants, shares, state.counts, process)

    @classmethod
    def for_process(
        cls, config: ResolvedConfig, state: SharedState, process: int
    ) -> SharedAdmission:
        """API server process `process`'s admission of `config`'s ranks, capacity, tenants and
        shares, over the processes' shared `state`."""
        return cls(
            config.data_parallel_size,
            config.admission_capacity,
            state,
            process,
            max_num_seqs=config.admission_running_limit,
            tenants=config.tenants,
            running_share=config.admission_running_share,
            queued_share=config.admission_queued_share,
        )

    def watch_wakes(self, on_wake: Callable[[], None]) -> Callable[[], None]:
        """Call `on_wake` on the event loop whenever another process wakes this one; returns
        the function that stops watching."""
        reader = self._state.wake_readers[self._process]
        loop = asyncio.get_running_loop()

        def readable() -> None:
            with contextlib.suppress(BlockingIOError, InterruptedError):
                while reader.recv(4096):
                    pass
            on_wake()

        loop.add_reader(reader.fileno(), readable)

        def stop() -> None:
            loop.remove_reader(reader.fileno())

        return stop

    @contextlib.contextmanager
    def _locked(self) -> Iterator[Any]:
        lock = self._counts.get_lock()
        if not lock.acquire(timeout=_LOCK_TIMEOUT):
            raise ServiceFailedError("the admission counts are held by a dead API server process")
        try:
            yield self._counts.get_obj()
        finally:
            lock.release()

    def _wake_holders(self, counts: Any, tenant: int) -> None:
        layout = self._layout
        for process in range(layout.processes):
            if process == self._process:
                continue
            if counts[layout.queued_in + process * layout.tenants + tenant] > 0:
                # A full socket already holds a wake-up: nothing is lost by dropping this one.
                with contextlib.suppress(BlockingIOError, InterruptedError):
                    self._state.wake_writers[process].send(b"w")
