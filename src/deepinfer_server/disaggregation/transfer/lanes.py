"""PeerLanes: a decode rank's transfer threads, one small pool per prefill peer.

Each peer (a prefill rank's transfer engine, `host:port`) gets its own pull threads and its
own release thread, made when it is first named. A peer that hangs (stopped, or its network
gone quiet) holds only its own threads: the pulls queued behind them wait on that peer alone
while every other peer's pulls go on. A peer whose pull outlived the transfer timeout is sick
for `SICK_SECONDS` (or until one of its pulls succeeds): new pulls from it fail at once
instead of queueing behind the stuck ones. A lane with nothing in flight for `IDLE_SECONDS` is
closed (`prune`): prefill ranks come and go (a restarted one listens on a new port), and a
decode server must not keep threads for every peer it ever heard of.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

#: Pull threads per peer (what the rank's one shared pool had before peers were isolated).
PULL_THREADS_PER_PEER = 4
#: Seconds a peer whose pull timed out stays sick, unless a pull from it succeeds sooner.
SICK_SECONDS = 30.0
#: Seconds a lane with nothing in flight is kept before its threads are let go.
IDLE_SECONDS = 300.0


@dataclass
class PeerLane:
    """One peer's threads and the requests of its pulls not yet finished."""

    pulls: ThreadPoolExecutor
    releases: ThreadPoolExecutor
    #: Request IDs of the pulls submitted to this peer and not yet taken as done.
    requests: set[str] = field(default_factory=set)
    #: When a pull or release was last submitted to it.
    used_at: float = 0.0


class PeerLanes:
    """The lanes by peer and which peers are sick. Not thread-safe: the engine's thread owns
    it (the lanes' threads only run what is submitted to them)."""

    def __init__(self, threads_per_peer: int = PULL_THREADS_PER_PEER) -> None:
        self._threads = threads_per_peer
        self._lanes: dict[str, PeerLane] = {}
        self._sick_until: dict[str, float] = {}

    def lane(self, peer: str, now: float) -> PeerLane:
        """`peer`'s lane, made on first use, used at `now`."""
        lane = self._lanes.get(peer)
        if lane is None:
            name = f"kv-pull-{peer}"
            lane = PeerLane(
                ThreadPoolExecutor(self._threads, thread_name_prefix=name),
                ThreadPoolExecutor(1, thread_name_prefix=f"kv-release-{peer}"),
            )
            self._lanes[peer] = lane
        lane.used_at = now
        return lane

    def peers(self) -> set[str]:
        """The peers that have a lane now."""
        return set(self._lanes)

    def prune(self, now: float) -> list[str]:
        """Close the lanes with nothing in flight and unused for `IDLE_SECONDS` (their queued
        releases still go out); the peers whose lanes were closed."""
        idle = [
            peer
            for peer, lane in self._lanes.items()
            if not lane.requests and now - lane.used_at >= IDLE_SECONDS
        ]
        self._sick_until = {peer: until for peer, until in self._sick_until.items() if until > now}
        for peer in idle:
            lane = self._lanes.pop(peer)
            lane.pulls.shutdown(wait=False)
            lane.releases.shutdown(wait=False)
        return idle

    def sick(self, peer: str, now: float) -> bool:
        """Whether pulls from `peer` fail at once now."""
        until = self._sick_until.get(peer)
        if until is None:
            return False
        if until <= now:
            del self._sick_until[peer]
            return False
        return True

    def mark_sick(self, peer: str, now: float) -> None:
        """A pull from `peer` (running or queued) outlived the transfer timeout."""
        self._sick_until[peer] = now + SICK_SECONDS

    def mark_well(self, peer: str) -> None:
        """A pull from `peer` succeeded: it answers again."""
        self._sick_until.pop(peer, None)

    def close(self) -> None:
        """Stop every lane; threads stuck in a read are left to return on their own."""
        for lane in self._lanes.values():
            lane.pulls.shutdown(wait=False, cancel_futures=True)
            lane.releases.shutdown(wait=False, cancel_futures=True)
        self._lanes.clear()
