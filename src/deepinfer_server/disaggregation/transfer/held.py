"""HeldKV: the prompts a prefill engine holds for decode servers, and when each is freed.

A PROMPT engine's sequence ends for its client after the prompt step, but its KV blocks and
state slot stay pinned until a decode server says it has them (or gives up on them: a
release), or until the hold times out because no decode server ever came. Freeing is the
engine's callback, run on the engine's thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass
class _Hold:
    free: Callable[[], None]
    deadline: float


class HeldKV:
    """Held prompts by transfer ID. Not thread-safe: the engine's thread owns it."""

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._holds: dict[str, _Hold] = {}
        #: Freed holds, by rule: "released" (the decode side is done) or "expired".
        self.freed = {"released": 0, "expired": 0}

    def __len__(self) -> int:
        return len(self._holds)

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self._holds

    def hold(self, transfer_id: str, free: Callable[[], None], now: float) -> None:
        """Keep a prompt's KV until released or `timeout` seconds from `now`."""
        assert transfer_id not in self._holds, "a transfer ID is held once"
        self._holds[transfer_id] = _Hold(free, now + self._timeout)

    def collect(self, released: Iterable[str], now: float) -> None:
        """Free what was released (unknown IDs are ignored: a repeat, or already expired) and
        every hold past its deadline."""
        for transfer_id in released:
            hold = self._holds.pop(transfer_id, None)
            if hold is not None:
                hold.free()
                self.freed["released"] += 1
        expired = [tid for tid, hold in self._holds.items() if hold.deadline <= now]
        for transfer_id in expired:
            self._holds.pop(transfer_id).free()
            self.freed["expired"] += 1

    def free_all(self) -> None:
        """The engine closes: nothing is held any more."""
        holds, self._holds = self._holds, {}
        for hold in holds.values():
            hold.free()
