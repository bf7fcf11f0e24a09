"""HostPath: the prefix cache's host-memory tier on DeepInfer's LLMEngine (`--kv-offload-host-gb`).

The policy is the shared one (`prefix_cache.host_tier.HostTier`: byte budget, LRU, fair share
per partition, restore only when faster than computing); this module moves real rows.

DeepInfer 0.1.0 binds no sequence's block table to Python, so an entry's rows can be copied
only if the server placed its prompt itself (as the prompt role does): with the tier on, a
prompt the cache can keep enters through `Scheduler.fork_seq(blocks=...)` in blocks and a state
slot the server allocated (`placement.Placement`):

- a prompt without a match: its own blocks, computed in full;
- a fork of an entry placed so: the entry's full blocks up to the fork point, new blocks for the
  rest, a new state slot; the state snapshot and the partial block are cloned as DeepInfer's
  forked-prompt path clones them (`clone_and_zero_states_and_blocks_on_default_stream`);
- a restore from the tier: new blocks and slot, the host rows copied back into them.

Each is prefilled from its `num_cached_tokens`. When its blocks are not free now (after evicting
idle entries, to the tier), the prompt waits in the tier's queue and is placed before a later
step; a prompt that could never be placed, or a fork of an entry DeepInfer placed, takes the
cache's ordinary path, and its entry is dropped, not offloaded, when evicted. A restore is
taken only when its host entry reuses more than the pool's best fork and restoring beats
computing the difference; the host entry leaves the tier as the restored prompt (whose own
entry the pool keeps when it ends) takes its rows.

`PrefixCache.evict` offloads a placed entry (its prompt's block rows and snapshot row,
`host_rows.RowCopier`) before freeing it. With the shared store (`prefix_store`), a placed
entry the pool keeps is written there, and a prompt the store may serve more of than the pool
and the tier is looked up there first, the snapshot found brought into the tier.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from deepinfer_server.engines.deepinfer.host_rows import HostRows, RowCopier
from deepinfer_server.engines.deepinfer.placement import GPU_CACHE_PREFILL_WATERMARK, Placement
from deepinfer_server.engines.deepinfer.prefix_forks import Forks
from deepinfer_server.engines.deepinfer.prefix_settings import PrefixCacheSettings
from deepinfer_server.engines.deepinfer.prefix_store import StorePath, store_path
from deepinfer_server.ipc.messages import HostTierStats
from deepinfer_server.model.kv_block import BLOCK_SIZE, blocks_for
from deepinfer_server.prefix_cache.host_tier import HostCopy, HostTier, HostTierSettings
from deepinfer_server.prefix_cache.index import CacheEntry, Match, PrefixIndex

logger = logging.getLogger(__name__)


def host_path(engine: Any, cache: _Cache, settings: PrefixCacheSettings) -> HostPath | None:
    """The host tier of `cache`, or None with more than one CP worker (each holds its own rows,
    and the copies read the driver worker's: the server refuses the option then)."""
    if int(engine.parallel_config.context_parallel_size) > 1:
        logger.warning("[startup] prefix cache host tier off: more than one CP worker")
        return None
    path = HostPath(engine, cache, settings)
    if settings.store is not None:
        path.store = store_path(engine, path.copier, path.tier, settings.store)
    return path


class _Cache(Protocol):
    """What the host path reads and updates of `prefix_cache.PrefixCache`."""

    index: PrefixIndex[Any]
    forks: Forks
    hit_tokens: int

    def evict(self, entry: CacheEntry[Any], offload: bool = True) -> bool: ...

    def eviction_order(self) -> list[CacheEntry[Any]]: ...

    def evict_for_room(self, entry: CacheEntry[Any]) -> None: ...

    def enter_unplaced(self, seq: Any, match: Match[Any] | None) -> Any: ...


@dataclass
class _Pending:
    """A prompt waiting here for the blocks to place it in."""

    seq: Any
    prompt: npt.NDArray[np.int32]
    salt: bytes | None


class HostPath:
    """One rank's host tier, its placed tables and its copies."""

    def __init__(self, engine: Any, cache: _Cache, settings: PrefixCacheSettings) -> None:
        from deepinfer._C.engine import SequenceStatus

        self._engine = engine
        self._scheduler = engine.scheduler
        self._cache = cache
        self._alive = (SequenceStatus.WAITING, SequenceStatus.RUNNING)
        self._total_blocks = int(engine.cache_config.num_gpu_blocks)
        self.copier = RowCopier(engine.driver_worker.cache_engine, self._measured)
        self.tier = HostTier(
            HostTierSettings(
                budget_bytes=settings.host_tier_bytes,
                bandwidth=settings.host_bandwidth,
                block_bytes=self.copier.block_bytes,
                state_bytes=self.copier.state_bytes,
                prefill_tokens_per_s=settings.prefill_tokens_per_s,
                measured=True,
            ),
            max_rollback=cache.index.max_rollback,
        )
        self.placement = Placement(engine)
        #: Prompts waiting for their blocks, in arrival order.
        self.pending: deque[_Pending] = deque()
        #: Evicted entries DeepInfer placed (their rows cannot be named): dropped, not offloaded.
        self.unplaced_evictions = 0
        self.store: StorePath | None = None

    def _measured(self, offloaded: bool, seconds: float) -> None:
        if offloaded:
            self.tier.offload_seconds += seconds
        else:
            self.tier.restore_seconds += seconds

    def stats(self) -> HostTierStats:
        """The tier's counters and occupancy."""
        self.copier.reap()
        stats = self.tier.stats()
        if self.store is not None:
            stats.store_errors = self.store.store.errors
        return stats

    # add_request

    def add(
        self, seq: Any, prompt: npt.NDArray[np.int32], salt: bytes | None, match: Match[Any] | None
    ) -> Any:
        """Enter `seq` (built, not queued) placed: restored from the tier, forked from a placed
        entry, or computed in full; queued here while its blocks cannot be had (placed at a
        later step, `place_pending`); a prompt that could never be placed, or a fork of an
        entry DeepInfer placed, takes the cache's ordinary path (`fallback`)."""
        if len(self.placement) > self.placement.pruned_at:
            self.placement.prune(self._alive, {entry.value.seq_id for entry in self._cache.index})
        needed = blocks_for(int(prompt.size))
        if needed + 1 > GPU_CACHE_PREFILL_WATERMARK * self._total_blocks:
            return self._fallback(seq, match)
        if self.store is not None:
            served = self.store.served(prompt, salt, match)
            self.store.bring(prompt, int(prompt.size) - 2, salt, served)
        if not self.pending:
            entered = self._enter_or_fallback(seq, prompt, salt, match)
            if entered is not None:
                return entered
        # Its usage reports what it would reuse now; placed later, it may reuse otherwise.
        seq.num_cached_tokens = self._reusable(prompt, salt, match)
        self.pending.append(_Pending(seq, prompt, salt))
        return seq

    def place_pending(self) -> None:
        """Before a step: place the queued prompts in order while their blocks can be had; on
        an engine with nothing else to run, one that still cannot be placed takes the
        ordinary path."""
        while self.pending:
            head = self.pending[0]
            match = self._cache.index.match(head.prompt, int(head.prompt.size) - 2, head.salt)
            if self._enter_or_fallback(head.seq, head.prompt, head.salt, match) is None:
                if self._scheduler.has_unfinished_seqs():
                    return
                self._fallback(head.seq, match)
            self.pending.popleft()

    def abort(self, request_ids: Collection[str]) -> list[int]:
        """Queued prompts an abort reached end here (DeepInfer never saw them): the sequence
        IDs of those that ended."""
        ended = [p.seq.seq_id for p in self.pending if p.seq.request_id in request_ids]
        if ended:
            kept = [p for p in self.pending if p.seq.request_id not in request_ids]
            self.pending = deque(kept)
        return ended

    def _fallback(self, seq: Any, match: Match[Any] | None) -> Any:
        seq.num_cached_tokens = 0
        return self._cache.enter_unplaced(seq, match)

    def _reusable(
        self, prompt: npt.NDArray[np.int32], salt: bytes | None, match: Match[Any] | None
    ) -> int:
        pool_fork = 0 if match is None else match.fork_point
        restore = self.tier.match(prompt, int(prompt.size) - 2, salt, pool_fork)
        return pool_fork if restore is None else restore.fork_point

    def _enter_or_fallback(
        self, seq: Any, prompt: npt.NDArray[np.int32], salt: bytes | None, match: Match[Any] | None
    ) -> Any:
        """`_enter`, or, when placing fails (a copy, a clone or `fork_seq` raised, having given
        back what it reserved), the ordinary path: one request's failure never ends the rank's
        step."""
        try:
            return self._enter(seq, prompt, salt, match)
        except Exception:
            logger.exception("placing request %s failed: full prefill", seq.request_id)
            return self._fallback(seq, None)

    def _enter(
        self, seq: Any, prompt: npt.NDArray[np.int32], salt: bytes | None, match: Match[Any] | None
    ) -> Any:
        """The placed fork of `seq`, or None while its blocks cannot be had."""
        length = int(prompt.size)
        pool_fork = 0 if match is None else match.fork_point
        restore = self.tier.match(prompt, length - 2, salt, pool_fork)
        if restore is not None:
            self.tier.pin(restore.entry)  # the room made for it may offload others
            if self._room(blocks_for(length), match):
                return self._restore(seq, restore)
            self.tier.unpin(restore.entry)
        if match is None:
            return self._placed(seq) if self._room(blocks_for(length), None) else None
        parent = self.placement.table_of(match.entry.value)
        if parent is None:
            return self._fallback(seq, match)  # DeepInfer's forked path waits for its room
        if not self._room(blocks_for(length) - match.fork_point // BLOCK_SIZE, match):
            return None
        return self._fork(seq, match, parent)

    def _room(self, blocks: int, keep: Match[Any] | None) -> bool:
        """Whether `blocks` KV blocks and a state slot can be taken now (under the prefill
        watermark, a block left for each running sequence's next token), after evicting idle
        entries other than `keep`'s, least recently used first (pinned ones last)."""
        scheduler, states = self._scheduler, self._engine.state_manager
        running, _ = scheduler.get_sum_prompt_len_running()
        limit = GPU_CACHE_PREFILL_WATERMARK * self._total_blocks

        def satisfied() -> bool:
            free = int(scheduler.get_num_free_gpu_blocks())
            fits = self._total_blocks - free + blocks <= limit and free - blocks >= running
            return fits and int(states.get_num_free_blocks()) >= 1

        if satisfied():
            return True
        kept = None if keep is None else keep.entry
        for entry in self._cache.eviction_order():
            if entry.live_forks or entry is kept:
                continue
            self._cache.evict_for_room(entry)
            if satisfied():
                return True
        return False

    def _restore(self, seq: Any, match: Match[HostCopy]) -> Any:
        entry, fork_point = match.entry, match.fork_point
        rows = entry.value.rows
        assert isinstance(rows, HostRows)
        blocks, slot = self.placement.reserve(blocks_for(int(seq.get_prompt_len())))
        try:
            self.copier.restore(rows, blocks[: blocks_for(fork_point)], slot)
        except Exception:
            self.placement.release(blocks, slot)
            self.tier.unpin(entry)
            raise
        self.tier.restore(entry, fork_point)
        fork = self.placement.enter(seq, blocks, slot, fork_point, owned=blocks)
        self._cache.forks.placed(fork)
        self._cache.hit_tokens += fork_point
        return fork

    def _fork(self, seq: Any, match: Match[Any], parent: list[int]) -> Any:
        entry, fork_point = match.entry, match.fork_point
        kept = fork_point // BLOCK_SIZE
        new, slot = self.placement.reserve(blocks_for(int(seq.get_prompt_len())) - kept)
        partial = [(parent[kept], new[0])] if fork_point % BLOCK_SIZE else []
        try:
            self.placement.clone([(int(entry.value.state_id), slot)], partial)
        except Exception:
            self.placement.release(new, slot)
            raise
        fork = self.placement.enter(seq, parent[:kept] + new, slot, fork_point, owned=new)
        self._cache.forks.add(fork, entry)
        self._cache.index.touch(entry)
        self._cache.hit_tokens += fork_point
        return fork

    def _placed(self, seq: Any) -> Any:
        blocks, slot = self.placement.reserve(blocks_for(int(seq.get_prompt_len())))
        fork = self.placement.enter(seq, blocks, slot, 0, owned=blocks)
        self._cache.forks.placed(fork)
        return fork

    # keeping and eviction

    def kept(self, entry: CacheEntry[Any]) -> None:
        """The pool keeps `entry`: with a shared store, write its pages (if it was placed)."""
        table = self.placement.table_of(entry.value)
        if self.store is not None and table is not None:
            self.store.kept(entry.tokens, entry.salt, table, int(entry.value.state_id))

    def evicted(self, entry: CacheEntry[Any], offload: bool) -> bool:
        """The pool evicts `entry` (its blocks and slot still held): copy it to the tier;
        whether the tier kept it (not when DeepInfer placed it, nor when it cannot fit)."""
        table = self.placement.forget(entry.value)
        if not offload:
            return False
        if table is None:
            self.unplaced_evictions += 1
            return False
        blocks = table[: blocks_for(entry.length)]
        slot = int(entry.value.state_id)
        copy = functools.partial(self.copier.offload, blocks, slot)
        return self.tier.offload(entry.tokens, entry.salt, copy=copy)

    def preempted(self, gone: Collection[Any]) -> None:
        """Placed sequences preempted lost their blocks (`gone`: their statuses)."""
        self.placement.drop_preempted(gone, self._cache.forks.waiting)

    def clear(self) -> None:
        """Drop every host entry."""
        self.tier.clear()
