"""RequestTable: the simulated engine's scheduled requests, waiting and running, with their KV.

`waiting` is served in order (preempted sequences and prefix-cache forks are put at its
front); a sequence holds its own KV blocks and a state slot exactly while it is in `running`
(a waiting fork pins its parent's). What a sequence holds when it starts and ends goes
through the rank's `PrefixCache`, which may keep it as a cache entry. Requests whose grammar is
still being built are in neither (`matcher_builds.MatcherBuilds`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from deepinfer_server.engines.simulated.kv_blocks import AllocStatus, KVBlocks
from deepinfer_server.engines.simulated.prefix_cache import PrefixCache
from deepinfer_server.engines.simulated.sequence import Sequence


@dataclass
class RequestTable:
    """The waiting queue, the running set and the KV blocks and state slots they hold."""

    kv: KVBlocks
    cache: PrefixCache
    waiting: list[Sequence] = field(default_factory=list)
    running: list[Sequence] = field(default_factory=list)
    #: Called with each running sequence that ends, before its blocks are freed or cached
    #: (a PROMPT engine holds them for a decode server).
    on_finish: Callable[[Sequence], None] | None = None

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def can_prefill(self, sequence: Sequence) -> AllocStatus:
        """Whether a waiting sequence's blocks and a state slot are free for its prefill."""
        status = self.kv.can_prefill(sequence.length + 1, self.cache.kept_blocks(sequence))
        if status is AllocStatus.OK and not self.cache.slots.free_count:
            return AllocStatus.LATER  # DeepInfer's _can_allocate_with_state
        return status

    def start(self, sequence: Sequence) -> int:
        """Move the head of `waiting` (`sequence`) to `running`, with its blocks and state;
        returns the tokens its prefill computes."""
        assert self.waiting[0] is sequence, "the queue is served in order"
        self.waiting.pop(0)
        computed = self.cache.start(sequence, len(self.waiting), len(self.running))
        self.kv.allocate(sequence.request_id, sequence.length + 1)
        self.running.append(sequence)
        return computed

    def drop_head(self, sequence: Sequence) -> None:
        """Remove the head of `waiting` (`sequence`), which ends without running."""
        assert self.waiting[0] is sequence, "the queue is served in order"
        self.waiting.pop(0)
        self.cache.abort_waiting(sequence)

    def finish(self, sequence: Sequence) -> None:
        """A running sequence ended: it leaves `running`; its blocks are freed or cached."""
        self.running.remove(sequence)
        if self.on_finish is not None:
            self.on_finish(sequence)
        self.cache.finish(sequence)

    def preempted(self, sequence: Sequence) -> None:
        """A running sequence whose blocks the decode plan freed leaves `running` (the caller
        requeues or ends it)."""
        self.running.remove(sequence)
        self.cache.preempted(sequence)

    def abort(self, request_ids: Collection[str]) -> tuple[list[Sequence], list[Sequence]]:
        """Remove the requests among `request_ids`: (those that waited, those that ran)."""
        waited = [s for s in self.waiting if s.request_id in request_ids]
        for sequence in waited:
            self.waiting.remove(sequence)
            self.cache.abort_waiting(sequence)
        ran = [s for s in self.running if s.request_id in request_ids]
        for sequence in ran:
            self.finish(sequence)
        return waited, ran

    def kv_usage(self) -> float:
        """Fraction of usable KV blocks in use (block 0 is never usable, as in DeepInfer)."""
        usable = self.kv.cache_config.num_gpu_blocks - 1
        return (usable - self.kv.get_num_free_gpu_blocks()) / max(1, usable)
