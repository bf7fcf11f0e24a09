"""KVConnector: the one interface between an engine's prefill/decode role and the engine driver.

Each engine plays its role on its own hooks (`engines/simulated/disaggregation.py`,
`engines/deepinfer/prompt_role.py` and `completion_role.py`); each role is a connector here, and
the engine driver reads a rank's role only through it (`engines.abilities`). A NORMAL engine's
connector is `KVConnector` itself: every answer is "nothing".

- `PrefillConnector` (a PROMPT engine): the bootstrap port (`--disaggregation-bootstrap-port`
  + rank, or with 0 a port the rank binds of its own choosing), the holds of prefilled prompts
  and the handoffs waiting for the driver.
- `DecodeConnector` (a COMPLETION engine): the pulls off the lockstep loop, their statistics,
  and the requests the role ended outside the engine's scheduler.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable

from deepinfer_server.disaggregation.handoff.params import KVTransferParams
from deepinfer_server.disaggregation.handoff.signing import release_verified
from deepinfer_server.disaggregation.layout import KVLayout
from deepinfer_server.disaggregation.transfer.agent import TransferAgent
from deepinfer_server.disaggregation.transfer.bootstrap import BootstrapServer
from deepinfer_server.disaggregation.transfer.held import HeldKV
from deepinfer_server.disaggregation.transfer.pulls import Pulls
from deepinfer_server.disaggregation.transfer.stats import TransferStats

logger = logging.getLogger(__name__)

#: The finish string of a request whose KV transfer failed, before ":<reason>" (the reason is
#: the `deepinfer:kv_transfer_failures_total` label); the engine driver reads it back.
KV_TRANSFER_FAILED = "kv_transfer_failed"


def transfer_failed(reason: str) -> str:
    """The finish string of a request whose KV transfer failed for `reason`."""
    return f"{KV_TRANSFER_FAILED}:{reason}"


class KVConnector:
    """What a rank's role reports to the engine driver; these defaults are a NORMAL engine's."""

    _layout: KVLayout | None = None

    @property
    def layout(self) -> KVLayout | None:
        """The rank's KV layout, as its role described it (None: the role moves no KV)."""
        return self._layout

    def publish(self, layout: KVLayout) -> None:
        """The role's KV layout, reported with the rank's readiness."""
        self._layout = layout

    @property
    def busy(self) -> bool:
        """Whether the role has work the engine's scheduler does not know of."""
        return False

    def pop_handoff(self, request_id: str) -> KVTransferParams | None:
        """The handoff of a request that ended after its prompt step, if any."""
        del request_id
        return None

    def take_ended(self) -> list[tuple[str, str]]:
        """(request ID, finish string) of requests ended outside the engine's scheduler since
        the last call."""
        return []

    def transfer_stats(self) -> TransferStats | None:
        """What the role's pulls did (None: the role pulls nothing)."""
        return None

    def held_count(self) -> int:
        """Prompts held for decode servers now."""
        return 0

    def computed_prompt_tokens(self) -> int | None:
        """Prompt tokens the role counts as computed (None: the role does not count them)."""
        return None

    @property
    def bootstrap_port(self) -> int | None:
        """The port the rank's bootstrap server listens on (None: the rank has none)."""
        return None

    def close(self) -> None:
        """Stop the role's threads and free what it holds."""


class PrefillConnector(KVConnector):
    """A PROMPT engine's side: holds prefilled prompts for decode servers and keeps each
    request's handoff until the driver takes it."""

    def __init__(
        self, bootstrap_port: int, rank: int, hold_timeout: float, release_key: bytes | None
    ) -> None:
        self.engine_id = secrets.token_hex(8)
        # Without the pair's release key no release can be proven: holds end on their timeout.
        self._release_key = release_key
        # Port 0: every rank binds a port of its own choosing, reported once bound.
        port = bootstrap_port + rank if bootstrap_port else 0
        self.bootstrap = BootstrapServer("0.0.0.0", port, self.engine_id, self._release_verified)
        logger.info(
            "[startup] DP rank %d: disaggregation bootstrap port %d", rank, self.bootstrap.port
        )
        self.held = HeldKV(hold_timeout)
        #: Handoffs of sequences that ended since the driver last asked, by request ID.
        self.handoffs: dict[str, KVTransferParams] = {}

    @property
    def bootstrap_port(self) -> int:
        """The port this rank's bootstrap server listens on (the one its handoffs name)."""
        return self.bootstrap.port

    def publish(self, layout: KVLayout) -> None:
        """The role's KV layout, reported with the rank's readiness and answered to pings."""
        super().publish(layout)
        self.bootstrap.publish(layout)

    def keep(self, transfer_id: str, free: Callable[[], None]) -> None:
        """Keep a prompt's KV for a decode server; `free` runs on release or timeout."""
        self.held.hold(transfer_id, free, time.monotonic())

    def collect(self) -> None:
        """Free the holds decode servers released and those past the hold timeout."""
        self.held.collect(self.bootstrap.take_released(), time.monotonic())

    def pop_handoff(self, request_id: str) -> KVTransferParams | None:
        """The handoff of a request that ended after its prompt step, if any."""
        return self.handoffs.pop(request_id, None)

    def held_count(self) -> int:
        """Prompts held for decode servers now."""
        return len(self.held)

    def transfer_stats(self) -> TransferStats:
        """The releases ignored for want of a valid proof, as the failure reason
        `release_unverified` (a prefill rank moves no bytes itself)."""
        stats = TransferStats()
        if self.bootstrap.refused_releases:
            stats.failures["release_unverified"] = self.bootstrap.refused_releases
        return stats

    def _release_verified(self, transfer_id: str, proof: object) -> bool:
        key = self._release_key
        return key is not None and release_verified(key, transfer_id, proof)

    def close(self) -> None:
        """Stop the bootstrap port and free every hold."""
        self.bootstrap.close()
        self.held.free_all()


class DecodeConnector(KVConnector):
    """A COMPLETION engine's side: pulls each request's KV off the lockstep loop."""

    def __init__(self, agent: TransferAgent) -> None:
        self.pulls = Pulls(agent)
        self.stats = TransferStats()
        #: (request ID, finish string) of requests ended outside the scheduler, for the driver.
        self.ended: list[tuple[str, str]] = []

    def take_ended(self) -> list[tuple[str, str]]:
        """(request ID, finish string) of requests whose KV never arrived."""
        ended, self.ended = self.ended, []
        return ended

    def transfer_stats(self) -> TransferStats:
        """The pulls' counters."""
        return self.stats

    def close(self) -> None:
        """Stop the transfer threads."""
        self.pulls.close()
