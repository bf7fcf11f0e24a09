"""Admission's arithmetic: the shares of the running slots and of the queue one API key may
hold, each key's queue limit (and the words its 429 names it with), and where each count lives
in the flat array of counts that `admission.py` keeps (shared memory with several API server
processes)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from deepinfer_server.config import ResolvedConfig
from deepinfer_server.config.tenants import Tenant


@dataclass(frozen=True)
class Shares:
    """The shares of the running slots and of the queue one key may hold (with several keys)."""

    running: float
    queued: float


@dataclass(frozen=True)
class QueueLimit:
    """A key's queue limit and where it comes from (for its 429's message)."""

    requests: int
    source: str


def running_limit(tenant: Tenant, running: int, tenants: int, share: float) -> int:
    """`tenant`'s limit on its requests running in `running` slots shared by `tenants` keys."""
    if tenant.max_running:
        return tenant.max_running
    return running if tenants == 1 else max(1, math.floor(running * share))


def most_admitted(config: ResolvedConfig, tenant: int) -> int:
    """The most engine requests one request of key number `tenant` can have admitted, on an
    otherwise idle server: its running limit and its queue limit, within the server's
    capacity (one that needs more would be refused every time it is sent)."""
    key = config.tenants[tenant]
    capacity = config.admission_capacity
    running = config.data_parallel_size * (config.admission_running_limit or capacity)
    tenants = len(config.tenants)
    queued = queue_limit(key, max(0, capacity - running), tenants, config.admission_queued_share)
    if queued is None:
        return capacity
    held = running_limit(key, running, tenants, config.admission_running_share)
    return min(capacity, held + queued.requests)


def queue_limit(tenant: Tenant, queue: int, tenants: int, share: float) -> QueueLimit | None:
    """`tenant`'s limit on its requests waiting in a queue of `queue` places shared by
    `tenants` keys (None: the server's capacity only)."""
    if tenant.max_queued is not None:
        return QueueLimit(tenant.max_queued, "its max_queued in --api-key-file")
    if tenants == 1 or share >= 1:
        return None
    return QueueLimit(
        max(min(queue, 1), math.floor(queue * share)),
        f"its share of the server's queue (--key-queued-share {share:g} of "
        f"--max-queued-requests {queue})",
    )


class Layout:
    """Where each count lives in the flat array of counts (shared memory or a list)."""

    def __init__(self, ranks: int, tenants: int, processes: int) -> None:
        self.ranks, self.tenants, self.processes = ranks, tenants, processes
        self.started = 0  # [rank]: requests sent to the rank and not yet ended
        self.running = ranks  # [tenant]: the tenant's started requests
        self.waiting = ranks + tenants  # [tenant]: its queued requests, every process's
        self.served = ranks + 2 * tenants  # [tenant]: when it last started one (a clock tick)
        self.clock = ranks + 3 * tenants
        self.queued_in = self.clock + 1  # [process * tenants + tenant]
        self.size = self.queued_in + processes * tenants
