"""Session-affine rank choice: the turns of one session go to the DP rank that served the last
one, where its conversation's prefix is cached, unless that rank is much more loaded.

A request names its session (`protocol/core/session_key.py`: `prompt_cache_key`, a Responses
`conversation` or `previous_response_id`, a session header, Messages' `metadata.user_id`); the
API process remembers, per session, the rank its last request was placed on. Sessions are
partitioned as the prefix cache is, and by API key always: two keys' sessions of the same name
are two sessions, and neither can move the other's requests. The load rule is prefix routing's
(`PrefixRouting.much_more_loaded`): past it the request goes by its prefix, or by load, and the
session moves to the rank it went to. Without a session, or for one not seen yet (or forgotten:
the table keeps the `MAX_SESSIONS` most recently placed), the prefix directory decides.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import orjson

from deepinfer_server.coordinator.prefix_routing import PrefixHint, PrefixRouting

#: Sessions remembered per API server process (about 100 bytes each), least recently placed
#: forgotten first: more than the ranks of one server run conversations at once.
MAX_SESSIONS = 65_536
_PERSON = b"session-route"


class RoutingReason(StrEnum):
    """Why a request went to the rank it went to (the `reason` of `dp_routing_total`)."""

    SESSION = "session"
    PREFIX = "prefix"
    LOAD = "load"


@dataclass(frozen=True, slots=True)
class SessionNames:
    """What a request's session is called: `key` finds the rank that holds it (None: the
    request names none to follow), and its rank is remembered under every name in `recorded`
    (the key, and the ID a later request may continue it by)."""

    key: str | None
    recorded: tuple[str, ...] = ()


def session_id(tenant: int, partition: bytes | None, name: str) -> bytes:
    """The table's key for session `name` of API key number `tenant` in cache partition
    `partition`: a digest, so a long name costs the table no more than a short one."""
    scope = orjson.dumps([tenant, None if partition is None else partition.hex(), name])
    return hashlib.blake2b(scope, digest_size=16, person=_PERSON).digest()


class SessionTable:
    """Session -> the rank its last request was placed on, bounded, least recently placed
    forgotten first. Use from the event loop thread only."""

    def __init__(self, limit: int = MAX_SESSIONS) -> None:
        self._limit = limit
        self._ranks: OrderedDict[bytes, int] = OrderedDict()

    def rank_of(self, session: bytes) -> int | None:
        """The rank that holds `session`, or None for a session not (or no longer) known."""
        return self._ranks.get(session)

    def place(self, sessions: Iterable[bytes], rank: int) -> None:
        """A request of these sessions was placed on `rank`: they live there now."""
        ranks = self._ranks
        for session in sessions:
            ranks[session] = rank
            ranks.move_to_end(session)
        while len(ranks) > self._limit:
            ranks.popitem(last=False)

    def __len__(self) -> int:
        return len(self._ranks)


@dataclass(frozen=True, slots=True)
class RouteHint:
    """What a request's rank choice goes by besides load: the rank holding its session, and
    where its prompt's prefix is held."""

    policy: PrefixRouting
    session_rank: int | None = None
    prefix: PrefixHint | None = None

    def choose(self, in_flight: Sequence[int], least: int) -> int:
        """The session's rank unless it is much more loaded than `least`; else the prefix
        hint's choice; else `least`."""
        rank = self.session_rank
        if rank is not None and not self.policy.much_more_loaded(in_flight[rank], in_flight[least]):
            return rank
        return least if self.prefix is None else self.prefix.choose(in_flight, least)

    def reason(self, rank: int) -> RoutingReason:
        """Why the request went to `rank`, as chosen by `choose`."""
        if rank == self.session_rank:
            return RoutingReason.SESSION
        if self.prefix is not None and self.prefix.holds(rank):
            return RoutingReason.PREFIX
        return RoutingReason.LOAD
