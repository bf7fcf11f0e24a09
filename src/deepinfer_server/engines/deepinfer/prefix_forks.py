"""The prefix cache's forks on DeepInfer's LLMEngine: those still waiting and those not ended.

A fork (`Scheduler.fork_seq`) pins its parent entry's blocks and state until its prefill runs:
while it waits it is in `waiting`, and until it ends the entry it came from counts it as a live
fork, which keeps the entry from being evicted to make a snapshot slot.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from deepinfer_server.engines.deepinfer.fork_seq import fork_seq
from deepinfer_server.engines.deepinfer.placement import GPU_CACHE_PREFILL_WATERMARK
from deepinfer_server.model.kv_block import BLOCK_SIZE, blocks_for
from deepinfer_server.prefix_cache.index import CacheEntry, Match

#: The branch name forks get; DeepInfer's prefill takes the forked path for a leading "_".
FORK_BRANCH = "_prefix_cache"


def fork_fits(table_blocks: int, match: Match[Any], prompt_tokens: int, total: int) -> bool:
    """Whether a fork of `match` (its entry's table holding `table_blocks` blocks) can ever
    have its prefill scheduled, on an otherwise idle rank of `total` blocks.

    A fork pins its parent's whole block table, answer included (the bindings give no
    block IDs to pin only the reused ones), until its prefill runs, and DeepInfer prefills
    it only at or below 90% KV use and with the blocks for the rest of its prompt free
    (`Scheduler`'s forked branch; more than the pool fails its TORCH_CHECK). A fork past
    that would wait forever, holding up the prompts queued behind it: a full prefill needs
    only the prompt's own blocks, once the entry is evicted."""
    needed = blocks_for(prompt_tokens) - match.fork_point // BLOCK_SIZE
    return table_blocks <= GPU_CACHE_PREFILL_WATERMARK * total and table_blocks + needed < total


class Forks:
    """One rank's forks; `status` is DeepInfer's `SequenceStatus`."""

    def __init__(self, scheduler: Any, status: Any) -> None:
        self._scheduler = scheduler
        self._status = status
        #: Forks not yet scheduled for their prefill (they still hold the fork's pins).
        self.waiting: dict[int, Any] = {}
        #: Every fork not yet ended -> (fork, the entry it came from).
        self.live: dict[int, tuple[Any, CacheEntry[Any]]] = {}

    def fork(self, match: Match[Any], seq: Any) -> Any:
        """Fork the built sequence `seq` from `match`'s entry at its fork point (DeepInfer
        prefills the rest of its prompt); the fork, waiting for its prefill."""
        entry, fork_point = match.entry, match.fork_point
        parent = entry.value
        # fork_seq copies these from the parent at the call: make them the new request's.
        parent.data = seq.data
        parent.compressed_data = seq.compressed_data
        parent.request_id = seq.request_id
        parent.user_id = seq.user_id
        parent.num_cached_tokens = fork_point
        # The parent's whole table, pinned; the prefill drops what it does not keep.
        fork = fork_seq(self._scheduler, parent, None, FORK_BRANCH, seq)
        fork.cached_hit_tokens = fork_point
        self.add(fork, entry)
        return fork

    def add(self, fork: Any, entry: CacheEntry[Any]) -> None:
        """A fork of `entry`, waiting for its prefill."""
        entry.live_forks += 1
        self.waiting[fork.seq_id] = fork
        self.live[fork.seq_id] = (fork, entry)

    def placed(self, fork: Any) -> None:
        """A prompt placed in blocks the cache chose (`placement`), from no pool entry, waiting
        for its prefill."""
        self.waiting[fork.seq_id] = fork

    def prefilled(self, seq_id: int) -> None:
        """The sequence's prompt was scheduled (or it finished): it no longer waits."""
        self.waiting.pop(seq_id, None)

    def ended(self, seq_id: int) -> None:
        """The sequence ended: a fork no longer counts on its entry."""
        ended = self.live.pop(seq_id, None)
        if ended is not None:
            ended[1].live_forks -= 1

    def reused_blocks(self) -> int:
        """The blocks the waiting forks' prefills keep from their parents, or, placed ones,
        hold already."""
        return sum(
            int(fork.num_cached_tokens) // BLOCK_SIZE
            if fork.branch_id.startswith("_")
            else blocks_for(int(fork.get_len()))
            for fork in self.waiting.values()
        )

    def free_aborted(self, request_ids: Collection[str]) -> None:
        """Free the waiting forks an abort reached: DeepInfer never frees aborted waiting ones."""
        for seq_id, fork in list(self.waiting.items()):
            if fork.request_id in request_ids and fork.status == self._status.FINISHED_ABORTED:
                self._scheduler.free_seq(fork)
                del self.waiting[seq_id]
                self.ended(seq_id)

    def drop_refused(self) -> None:
        """Forks the prefill refused (too long) were freed by DeepInfer; aborted ones by us."""
        alive = (self._status.WAITING, self._status.RUNNING, self._status.FINISHED_ABORTED)
        for seq_id, fork in list(self.waiting.items()):
            if fork.status not in alive:
                del self.waiting[seq_id]
                self.ended(seq_id)

    def drop_preempted(self, gone: Collection[Any]) -> None:
        """Running forks preempted (`gone`: their statuses) lost their blocks: they ended."""
        for seq_id, (fork, _entry) in list(self.live.items()):
            if seq_id not in self.waiting and fork.status in gone:
                self.ended(seq_id)
