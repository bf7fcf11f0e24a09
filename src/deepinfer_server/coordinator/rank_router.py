"""RankRouter: what a request's rank choice knows before admission places it, and what the
API process learns once it is placed.

With `--enable-prefix-caching` and DP > 1 a request goes to the rank holding its session
(`session_routing.py`), else to the rank holding its prompt's prefix (`prefix_directory.py`),
each unless that rank is much more loaded (`prefix_routing.py`), else to the least-loaded rank.
Where it went is remembered for the next request of its session and prefix, and counted by why
(`deepinfer:dp_routing_total{reason, dp_rank}`, with DP > 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer_server.config import ResolvedConfig
from deepinfer_server.coordinator.prefix_directory import PrefixDirectory, directory_for
from deepinfer_server.coordinator.prefix_routing import PrefixRouting
from deepinfer_server.coordinator.session_routing import (
    RouteHint,
    RoutingReason,
    SessionNames,
    SessionTable,
    session_id,
)
from deepinfer_server.metrics import ServerMetrics


@dataclass(frozen=True, slots=True)
class Placement:
    """A request's routing until it is placed: its prompt's block hashes, the hint for the
    rank choice (None: by load alone), and the sessions that will live where it goes."""

    hashes: list[int]
    hint: RouteHint | None = None
    sessions: tuple[bytes, ...] = ()


_BY_LOAD = Placement([])


class RankRouter:
    """The prefix directory and the session table of one API process. Use from the event loop
    thread only."""

    def __init__(self, config: ResolvedConfig, metrics: ServerMetrics) -> None:
        #: Where prompts' prefixes are cached: only with a choice of ranks to make.
        self.directory: PrefixDirectory | None = directory_for(config)
        self._routing = PrefixRouting.for_ranks_of(config.max_num_seqs)
        self._sessions = SessionTable()
        self._metrics = metrics
        self._counted = config.data_parallel_size > 1

    def placement(
        self,
        packed: bytes,
        prompt_tokens: int,
        cache_salt: bytes | None,
        tenant: int,
        session: SessionNames | None,
    ) -> Placement:
        """What the rank choice of a request of API key number `tenant` goes by: its session
        `session`, and its prompt (packed by `ipc.codec`) under its cache partition."""
        directory = self.directory
        if directory is None:
            return _BY_LOAD
        hashes, prefix = directory.hint(packed, prompt_tokens, cache_salt, self._routing)
        sessions: tuple[bytes, ...] = ()
        rank = None
        if session is not None:
            sessions = tuple(session_id(tenant, cache_salt, name) for name in session.recorded)
            rank = self._session_rank(tenant, cache_salt, session.key)
        if rank is None and prefix is None:
            return Placement(hashes, None, sessions)
        return Placement(hashes, RouteHint(self._routing, rank, prefix), sessions)

    def _session_rank(self, tenant: int, cache_salt: bytes | None, key: str | None) -> int | None:
        """The rank holding the session `key` names, if it is known."""
        return None if key is None else self._sessions.rank_of(session_id(tenant, cache_salt, key))

    def placed(self, rank: int, request_id: str, placement: Placement) -> None:
        """The request `request_id` was sent to `rank`: its prefix and its sessions are there."""
        if self.directory is not None:
            self.directory.record(rank, request_id, placement.hashes)
            self._sessions.place(placement.sessions, rank)
        if self._counted:
            hint = placement.hint
            reason = RoutingReason.LOAD if hint is None else hint.reason(rank)
            self._metrics.observe_routing(rank, reason)

    @property
    def sessions(self) -> int:
        """Sessions remembered."""
        return len(self._sessions)
