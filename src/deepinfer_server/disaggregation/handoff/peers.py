"""PrefillPeers: the prefill ranks a decode server depends on, probed by its `/health`.

A decode server's `/health` answers 503 when every prefill rank named by a handoff in the
last `PEER_MEMORY_SECONDS` fails to answer on its bootstrap port: a gateway then stops sending
it requests it could not serve.
"""

from __future__ import annotations

import asyncio

from deepinfer_server.disaggregation.handoff.bootstrap import bootstrap_ping
from deepinfer_server.disaggregation.handoff.params import KVTransferParams

#: A prefill peer not seen in a handoff for this long is forgotten (it may have been replaced).
PEER_MEMORY_SECONDS = 300.0
#: Seconds a health probe waits for a peer's bootstrap port.
PEER_PROBE_SECONDS = 1.0


class PrefillPeers:
    """The prefill ranks a decode server depends on: those named by recent handoffs (their
    bootstrap ports), probed by `/health`."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, int], float] = {}

    def seen(self, params: KVTransferParams, now: float) -> None:
        """A handoff named this prefill rank."""
        self._seen[(params.remote_host, params.remote_bootstrap_port)] = now

    async def unreachable(self, now: float, probe_seconds: float = PEER_PROBE_SECONDS) -> list[str]:
        """The recent peers, as host:port, when none of them answers a ping within
        `probe_seconds` (empty: one does, or no peer is known yet)."""
        for peer, last in list(self._seen.items()):
            if now - last > PEER_MEMORY_SECONDS:
                del self._seen[peer]
        peers = list(self._seen)
        answers = await asyncio.gather(
            *(bootstrap_ping(host, port, probe_seconds) for host, port in peers)
        )
        if any(answers):
            return []
        return [f"{host}:{port}" for host, port in peers]
