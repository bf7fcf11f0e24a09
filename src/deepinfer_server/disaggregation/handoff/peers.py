"""PrefillPeers: the prefill ranks a decode server depends on, paired by layout and probed by
its `/health`.

A decode server's `/health` answers 503 when every prefill rank named by a handoff in the
last `PEER_MEMORY_SECONDS` fails to answer on its bootstrap port: a gateway then stops sending
it requests it could not serve. A rank silent for `PEER_GONE_SECONDS` is forgotten: a prefill
server restarted on other ports (`--disaggregation-bootstrap-port 0`) is learned only from the
handoffs a gateway sends, and one that took the decode server out of rotation would send none.

Pairing: before a handoff's KV is pulled, the prefill rank's KV layout (its ping's answer,
kept per rank and engine ID, so a restarted rank is asked again) is compared with this decode
server's own (`disaggregation.layout`). A rank whose layout differs is refused: its requests
fail at once naming what differs, nothing is read, and `/health` names it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from deepinfer_server.disaggregation.handoff.bootstrap import bootstrap_hello
from deepinfer_server.disaggregation.handoff.params import KVTransferParams
from deepinfer_server.disaggregation.layout import KVLayout, layout_mismatch, parse_layout
from deepinfer_server.errors import ApiError, ErrorKind

#: A prefill peer not seen in a handoff for this long is forgotten (it may have been replaced).
PEER_MEMORY_SECONDS = 300.0
#: A prefill peer that has answered no probe for this long is forgotten (gone, or restarted on
#: other ports): the decode server is healthy again until a handoff names a peer.
PEER_GONE_SECONDS = 30.0
#: Seconds a health probe waits for a peer's bootstrap port.
PEER_PROBE_SECONDS = 1.0
#: Seconds a request waits for a prefill rank's layout (longer than a health probe: a busy
#: rank's answer must not let a mismatched pair through unchecked).
PAIRING_SECONDS = 5.0
#: The error code of a request whose prefill server is refused for its KV layout.
LAYOUT_MISMATCH_CODE = "kv_layout_mismatch"

_Peer = tuple[str, int]


@dataclass(frozen=True)
class _Pairing:
    """A prefill rank's engine as last asked, and why it is refused (None: it pairs)."""

    engine_id: object
    refusal: str | None
    #: Whether the rank had published its layout. A rank answers pings a moment before it
    #: publishes it (a restarted one on the same port, say), so an answer without one is
    #: asked again by the next request rather than kept.
    published: bool = True


def _no_layout() -> KVLayout | None:
    return None


def _refusal(answer: dict[str, object], local: KVLayout) -> str | None:
    layout = parse_layout(answer.get("layout"))
    if layout is None:
        return "layout (the prefill server publishes no KV layout: an older or other server)"
    return layout_mismatch(layout, local)


class PrefillPeers:
    """The prefill ranks a decode server depends on: those named by recent handoffs (their
    bootstrap ports), paired by KV layout and probed by `/health`.

    `local` is this decode server's own KV layout (None until its ranks reported it: nothing
    is compared until then)."""

    def __init__(self, local: Callable[[], KVLayout | None] = _no_layout) -> None:
        self._seen: dict[_Peer, float] = {}
        self._local = local
        self._pairings: dict[_Peer, _Pairing] = {}
        #: When each peer that answers no probe first failed one.
        self._silent_since: dict[_Peer, float] = {}

    def seen(self, params: KVTransferParams, now: float) -> None:
        """A handoff named this prefill rank."""
        self._seen[(params.remote_host, params.remote_bootstrap_port)] = now

    async def refusal(
        self, params: KVTransferParams, probe_seconds: float = PAIRING_SECONDS
    ) -> str | None:
        """Why the prefill rank of `params` cannot hand KV to this decode server (what differs
        in their layouts, each with both values), or None. A rank that does not answer is not
        refused here: its pull fails as any pull from an unreachable peer does."""
        local = self._local()
        if local is None:
            return None
        peer = (params.remote_host, params.remote_bootstrap_port)
        pairing = self._pairings.get(peer)
        if pairing is None or pairing.engine_id != params.remote_engine_id or not pairing.published:
            answer = await bootstrap_hello(*peer, probe_seconds)
            if answer is None:
                return None
            pairing = self._pair(peer, answer, local)
        return pairing.refusal

    def _pair(self, peer: _Peer, answer: dict[str, object], local: KVLayout) -> _Pairing:
        published = answer.get("layout") is not None
        pairing = _Pairing(answer.get("engine_id"), _refusal(answer, local), published)
        self._pairings[peer] = pairing
        return pairing

    def _recent(self, now: float) -> set[_Peer]:
        return {peer for peer, last in self._seen.items() if now - last <= PEER_MEMORY_SECONDS}

    def refused(self, now: float) -> dict[str, str]:
        """The recent peers refused for their layout, as host:port, with what differs."""
        recent = self._recent(now)
        return {
            f"{host}:{port}": pairing.refusal
            for (host, port), pairing in self._pairings.items()
            if pairing.refusal is not None and (host, port) in recent
        }

    def all_refused(self, now: float) -> bool:
        """Whether every recent peer is refused for its layout (none is usable)."""
        recent = self._recent(now)
        return bool(recent) and len(self.refused(now)) == len(recent)

    async def unreachable(self, now: float, probe_seconds: float = PEER_PROBE_SECONDS) -> list[str]:
        """The recent peers, as host:port, when none of them answers a ping within
        `probe_seconds` (empty: one does, or no peer is known yet). The answers renew the
        peers' pairings (a rank restarted with other settings is refused from now on)."""
        for peer, last in list(self._seen.items()):
            if now - last > PEER_MEMORY_SECONDS:
                self._forget(peer)
        peers = list(self._seen)
        answers = await asyncio.gather(
            *(bootstrap_hello(host, port, probe_seconds) for host, port in peers)
        )
        local = self._local()
        for peer, answer in zip(peers, answers, strict=True):
            if answer is None:
                if now - self._silent_since.setdefault(peer, now) >= PEER_GONE_SECONDS:
                    self._forget(peer)
                continue
            self._silent_since.pop(peer, None)
            if local is not None:
                self._pair(peer, answer, local)
        if not self._seen or any(answer is not None for answer in answers):
            return []
        return [f"{host}:{port}" for host, port in self._seen]

    def _forget(self, peer: _Peer) -> None:
        del self._seen[peer]
        self._pairings.pop(peer, None)
        self._silent_since.pop(peer, None)


async def refuse_unpaired(peers: PrefillPeers, params: KVTransferParams) -> None:
    """Raise a 503 naming what differs when the prefill rank of `params` lays out its KV
    differently from this decode server (nothing is pulled)."""
    refusal = await peers.refusal(params)
    if refusal is not None:
        raise ApiError(
            f"the prefill server at {params.remote_host}:{params.remote_bootstrap_port} lays "
            f"out its KV differently from this decode server: {refusal}; its KV cannot be "
            "used here (start both servers with the same model and settings)",
            param="kv_transfer_params",
            kind=ErrorKind.KV_TRANSFER_FAILED,
            code=LAYOUT_MISMATCH_CODE,
        )
