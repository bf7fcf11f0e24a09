"""RequestTable: the simulated engine's scheduled requests, waiting and running, with their KV.

`waiting` is served in order (preempted sequences are put back at its front); a sequence
holds KV blocks exactly while it is in `running`. Requests whose grammar is still being
built are in neither (`matcher_builds.MatcherBuilds`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from deepinfer_server.engines.simulated.kv_blocks import KVBlocks
from deepinfer_server.engines.simulated.sequence import Sequence


@dataclass
class RequestTable:
    """The waiting queue, the running set and the KV blocks they hold."""

    kv: KVBlocks
    waiting: list[Sequence] = field(default_factory=list)
    running: list[Sequence] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def start(self, sequence: Sequence) -> None:
        """Move the head of `waiting` (`sequence`) to `running`, with its blocks."""
        assert self.waiting[0] is sequence, "the queue is served in order"
        self.waiting.pop(0)
        self.kv.allocate(sequence.request_id, sequence.length + 1)
        self.running.append(sequence)

    def finish(self, sequence: Sequence) -> None:
        """A running sequence ended: it leaves `running` and frees its blocks."""
        self.running.remove(sequence)
        self.kv.free(sequence.request_id)

    def abort(self, request_ids: Collection[str]) -> tuple[list[Sequence], list[Sequence]]:
        """Remove the requests among `request_ids`: (those that waited, those that ran)."""
        waited = [s for s in self.waiting if s.request_id in request_ids]
        for sequence in waited:
            self.waiting.remove(sequence)
        ran = [s for s in self.running if s.request_id in request_ids]
        for sequence in ran:
            self.finish(sequence)
        return waited, ran

    def kv_usage(self) -> float:
        """Fraction of usable KV blocks in use (block 0 is never usable, as in DeepInfer)."""
        usable = self.kv.cache_config.num_gpu_blocks - 1
        return (usable - self.kv.get_num_free_gpu_blocks()) / max(1, usable)
