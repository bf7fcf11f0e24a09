"""StateSlots: DeepSeek-V4.1's per-sequence state (sliding-window and compressed-attention
rings) as DeepInfer 0.1.0 pools it: `int(max_num_seqs * ratio) + 1` slots, the ratio being
`DEEPINFER_NUM_STATE_SLOTS_RATIO` (default 1.2; `worker/cache_engine.py`), slot 0 never
allocatable, with reference counts like the KV blocks (`csrc/engine/block_manager.hpp`).

A running sequence holds one slot from its prefill; a prefix-cache entry holds the snapshot of
its state at the end of its prompt, and a fork pins its parent's snapshot until its own prefill
has cloned it. Without the cache, running sequences never exhaust the pool.
"""

from __future__ import annotations

import os

#: DeepInfer's DEEPINFER_NUM_STATE_SLOTS_RATIO default (`deepinfer/environ.py`).
STATE_SLOTS_RATIO = 1.2


class StateSlots:
    """The state-slot pool of one rank."""

    def __init__(self, count: int) -> None:
        if count < 2:
            raise ValueError("the state pool needs at least 2 slots (slot 0 is never used)")
        self._free: list[int] = list(range(count - 1, 0, -1))
        self._refs = [0] * count

    @classmethod
    def for_running(cls, max_num_seqs: int, ratio: float | None = None) -> StateSlots:
        """DeepInfer's pool for `max_num_seqs` running sequences: `ratio` slots per sequence,
        by default `$DEEPINFER_NUM_STATE_SLOTS_RATIO` or DeepInfer's 1.2, as on DeepInfer."""
        if ratio is None:
            ratio = float(os.environ.get("DEEPINFER_NUM_STATE_SLOTS_RATIO") or STATE_SLOTS_RATIO)
        return cls(int(max_num_seqs * ratio) + 1)

    @property
    def size(self) -> int:
        """Slots in the pool, slot 0 included."""
        return len(self._refs)

    @property
    def free_count(self) -> int:
        """Slots free for allocation."""
        return len(self._free)

    def take(self) -> int:
        """A free slot, held once (callers checked `free_count`)."""
        assert self._free, "take() from an empty state pool"
        slot = self._free.pop()
        self._refs[slot] = 1
        return slot

    def pin(self, slot: int) -> None:
        """One more holder of `slot`."""
        assert self._refs[slot] > 0, f"state slot {slot} is not held"
        self._refs[slot] += 1

    def release(self, slot: int) -> None:
        """One holder fewer; the slot is free once none is left."""
        self._refs[slot] -= 1
        assert self._refs[slot] >= 0, f"state slot {slot} released twice"
        if self._refs[slot] == 0:
            self._free.append(slot)
