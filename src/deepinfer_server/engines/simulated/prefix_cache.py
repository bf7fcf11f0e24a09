"""PrefixCache: the simulated engine's cross-request prefix cache, with DeepInfer's semantics.

It mirrors the server's cache on DeepInfer (`engines/deepinfer/prefix_cache.py`; design:
docs/design/prefix-caching.md) on the simulated block model, and shares its index
(`prefix_cache.index.PrefixIndex`: block-prefix hashes, then an exact token compare):

- `add`: a text prompt of at least `min_tokens` whose first P tokens (P - 1 after a
  thinking-mode turn dropped `<think>`) are a cached sequence's prompt becomes a fork: it pins
  the parent's blocks up to F (those it keeps and the partial one it copies) and its state
  snapshot, reports `num_cached_tokens = F` and goes
  to the front of the queue (DeepInfer's `fork_seq`); every prompt counts as queried. Only
  entries of the prompt's cache salt (`Sequence.cache_salt`) are candidates.
- `start` (its prefill): a fork keeps `F // 128` whole blocks, drops its other pins once its
  state is cloned into a slot of its own, and computes only its last `len - F` tokens; a
  prompt that can be cached takes a snapshot slot when one is spare, evicting entries without
  live forks to make one (DeepInfer snapshots on the first decode step; here the prefill ends
  at P).
- `finish`: a sequence with a snapshot (stopped, capped or aborted after its prefill) stays as
  an entry with its whole block table and the snapshot; anything else frees what it held.
- `evict_for_demand`, before each step: least-recently-used entries go while waiting prompts
  would not fit under the 90% prefill watermark, running sequences lack a block each for their
  next token, or waiting prompts lack state slots. Without demand nothing is evicted.
- A request that asked for retention (`retention.Retention`) reserves its snapshot slot at
  `add` and its entry is pinned at `finish`: pinned entries are evicted last.
- With a host tier (`HostTier`, `--kv-offload-host-gb`), an evicted entry is copied
  there instead of dropped, and `add` restores a prompt from a host entry that reuses more
  than the pool's best fork when the copy back is faster than computing the difference: the
  prompt keeps no parent blocks, reports the restored tokens as cached and its prompt step
  lasts the copy's seconds on top of the tokens it computes (`prompt_seconds`).
- With a shared store too (`store_tier.StoreTier`, `--kv-offload-store`), every entry the
  pool keeps is written there in the background (its whole blocks and its state snapshot),
  and a prompt that can fork from a stored entry further than from the pool and the host
  tier (the index's rule: at the entry's P, or P - 1) has that entry brought into the host
  tier and restored from there; shared blocks without a snapshot restore nothing.

Requests it cannot serve (prompt logprobs, images, grammars) are prefilled in full. With the
cache off it only hands out the state slots (which running sequences never exhaust).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from deepinfer_server.engines.simulated.kv_blocks import PREFILL_WATERMARK, KVBlocks
from deepinfer_server.engines.simulated.sequence import Sequence
from deepinfer_server.engines.simulated.state_slots import StateSlots
from deepinfer_server.ipc.messages import HostTierStats
from deepinfer_server.model.kv_block import BLOCK_SIZE, blocks_for
from deepinfer_server.prefix_cache.host_tier import HostCopy, HostTier
from deepinfer_server.prefix_cache.index import CacheEntry, Match, PrefixIndex
from deepinfer_server.prefix_cache.retention import KEY_BUDGET_SHARE, Retention
from deepinfer_server.prefix_cache.store_tier import StoreTier

#: Prompts shorter than this are neither cached nor looked up (as on DeepInfer).
MIN_TOKENS = 256
#: How far before its snapshot an entry may be forked: 1 serves a thinking-mode user turn.
MAX_ROLLBACK = 1


@dataclass(frozen=True, slots=True)
class _Cached:
    """What a cache entry holds: a block table (under `owner`) and a state snapshot slot."""

    owner: str
    slot: int


class PrefixCache:
    """The prefix cache and state slots of one simulated rank (its loop's thread owns it)."""

    def __init__(
        self,
        kv: KVBlocks,
        slots: StateSlots,
        *,
        enabled: bool,
        max_num_seqs: int,
        batched_tokens: int,
        prompt_limit: int,
        host: HostTier | None = None,
        prefill_tokens_per_s: float = 0.0,
        store: StoreTier | None = None,
        retention_share: float = KEY_BUDGET_SHARE,
    ) -> None:
        self.kv = kv
        self.slots = slots
        self.enabled = enabled
        #: The host-memory tier evicted entries go to (None: they are dropped).
        self.host = host if enabled else None
        #: The store shared with other replicas (None: none; it needs the host tier).
        self.store = store if self.host is not None else None
        self.index: PrefixIndex[_Cached] = PrefixIndex(max_rollback=MAX_ROLLBACK)
        self._max_num_seqs = max_num_seqs
        self._batched_blocks = batched_tokens // BLOCK_SIZE
        self._prompt_limit = prompt_limit
        self._entries = 0
        self.query_tokens = 0
        self.hit_tokens = 0
        self._restore_seconds = 0.0
        self._prefill_tokens_per_s = prefill_tokens_per_s
        tier_blocks = (
            kv.cache_config.num_gpu_blocks
            if self.host is None
            else self.host.settings.capacity_blocks()
        )
        #: The prompts requests asked to keep for a time (`retention.Retention`).
        self.retention = Retention(int(tier_blocks * retention_share))
        if self.host is not None:
            self.host.pins = self.retention
        #: The waiting sequences holding a snapshot slot reserved for their write.
        self._reserved: set[str] = set()

    def stats(self) -> tuple[int, int, int]:
        """(prompt tokens looked up, prompt tokens reused from either tier, cached sequences
        in the pool now)."""
        return self.query_tokens, self.hit_tokens, len(self.index)

    def host_stats(self) -> HostTierStats | None:
        """The host tier's counters (None without one)."""
        if self.host is None:
            return None
        stats = self.host.stats()
        if self.store is not None:
            stats.store_errors = self.store.errors
        return stats

    def prompt_seconds(self, computed: int) -> float:
        """How long the prompt step that started the prompts since the last call lasts at
        least: its `computed` tokens at the prefill rate (0: free), after the host-tier
        restores it made."""
        seconds, self._restore_seconds = self._restore_seconds, 0.0
        rate = self._prefill_tokens_per_s
        return seconds + (computed / rate if rate > 0 else 0.0)

    # add_request

    def add(self, sequence: Sequence, prompt: npt.NDArray[np.int32], cacheable: bool) -> bool:
        """Count the prompt and fork it from the entry with the longest match (or restore it
        from the host tier's, when that reuses more and is worth it); True for a fork (the
        caller queues it first, as DeepInfer's fork_seq does). A restore queues last, as any
        prompt: restores arriving faster than the queue drains would otherwise hold the
        prompts that compute in full back for good. `cacheable`: no images, prompt logprobs
        or grammar."""
        if not self.enabled:
            return False
        self.query_tokens += int(prompt.size)
        if not (cacheable and MIN_TOKENS <= prompt.size <= self._prompt_limit):
            return False
        sequence.prompt_ids = prompt
        limit, salt = int(prompt.size) - 2, sequence.cache_salt
        match = self.index.match(prompt, limit=limit, salt=salt)
        pool_fork = 0 if match is None else match.fork_point
        restore = None if self.host is None else self.host.match(prompt, limit, salt, pool_fork)
        if restore is None and self.store is not None:
            restore = self._from_store(prompt, limit, salt, pool_fork)
        if restore is not None:
            self._restore_from(sequence, restore)
        elif match is not None:
            self._fork(sequence, match)
        # After the fork pinned its parent: the reservation may evict idle entries.
        self._reserve_write(sequence)
        self.hit_tokens += sequence.fork_point
        return restore is None and match is not None

    def _reserve_write(self, sequence: Sequence) -> None:
        """A prompt that asked for retention is written when it ends: its snapshot slot is
        taken now, so that the written tokens reported with its first output are true. Fewer
        reservations than the slots beyond `max_num_seqs` are held, so running sequences
        always have theirs; when none can be had, nothing is written (and 0 reported)."""
        if sequence.retain_seconds <= 0 or sequence.prompt_ids is None:
            return
        if len(self._reserved) >= self.slots.size - 1 - self._max_num_seqs:
            return
        slot = self._spare_slot(0, 0)
        if slot:
            self._reserved.add(sequence.request_id)
            sequence.snapshot_slot = slot
            sequence.num_written_tokens = int(sequence.prompt_ids.size)

    def _from_store(
        self, prompt: npt.NDArray[np.int32], limit: int, salt: bytes | None, pool_fork: int
    ) -> Match[HostCopy] | None:
        """The host entry to restore `prompt` from once the store's copy of an entry (its
        pages and its state snapshot) is brought to host memory, when it reuses more than the
        pool's fork and it is worth it."""
        assert self.store is not None and self.host is not None
        if limit <= pool_fork:
            return None  # nothing beyond the pool's fork can be restored: no round trip
        snapshots = self.store.lookup(prompt[: limit + MAX_ROLLBACK], salt)
        # The index's rule decides where (and whether) the prompt can fork from each one.
        candidates: PrefixIndex[None] = PrefixIndex(max_rollback=MAX_ROLLBACK)
        for snapshot in snapshots:
            candidates.add(None, snapshot.tokens, salt)
        best = candidates.match(prompt, limit=limit, salt=salt)
        if best is None or best.fork_point <= pool_fork:
            return None
        settings, found = self.host.settings, best.entry.tokens
        seconds = self.store.transfer_seconds(settings.copy_bytes(len(found)))
        if not settings.worth_restoring(best.fork_point, best.fork_point - pool_fork, seconds):
            return None
        if not self.host.offload(found, salt, fetched=seconds):
            return None
        return self.host.match(prompt, limit, salt, pool_fork)

    def _restore_from(self, sequence: Sequence, match: Match[HostCopy]) -> None:
        """`sequence` will restore its first `match.fork_point` tokens from the host tier."""
        assert self.host is not None
        self.host.pin(match.entry)
        sequence.restore_of = match.entry
        sequence.fork_point = sequence.num_cached_tokens = match.fork_point

    def _fork(self, sequence: Sequence, match: Match[_Cached]) -> None:
        """`sequence` forks from a pool entry at `match.fork_point` (DeepInfer's fork_seq)."""
        entry, fork_point = match.entry, match.fork_point
        # Only the blocks up to the fork point: those it keeps and the partial one it copies
        # (DeepInfer's fork_seq with explicit `blocks`). Pinning the parent's whole table would
        # hold its output's blocks too, which no eviction could free while the fork waits.
        pinned = blocks_for(fork_point)
        self.kv.share(sequence.request_id, self.kv.table(entry.value.owner)[:pinned])
        self.slots.pin(entry.value.slot)
        entry.live_forks += 1
        self.index.touch(entry)
        sequence.fork_of = entry
        sequence.fork_point = sequence.num_cached_tokens = fork_point

    # Prefill

    def kept_blocks(self, sequence: Sequence) -> int:
        """The blocks a waiting sequence's prefill keeps from its parent (a fork's; a restore
        allocates all of its own)."""
        return sequence.fork_point // BLOCK_SIZE if sequence.fork_of is not None else 0

    def start(self, sequence: Sequence, waiting: int, running: int) -> int:
        """The prefill of `sequence` (its blocks are allocated next): its state slot, a fork's
        kept blocks and a snapshot if one is spare; returns the tokens it computes. `waiting`
        and `running` count the other sequences."""
        sequence.state_slot = self.slots.take()
        entry = sequence.fork_of
        if sequence.fork_point and entry is not None:
            self.kv.keep_first(sequence.request_id, self.kept_blocks(sequence))
            self.slots.release(entry.value.slot)  # cloned into the sequence's own slot
        restored, sequence.restore_of = sequence.restore_of, None
        if sequence.fork_point and restored is not None and self.host is not None:
            self._restore_seconds += self.host.restore(restored, sequence.fork_point)
        computed = sequence.length - sequence.fork_point
        sequence.fork_point = 0
        at_prompt_end = sequence.length == len(sequence.prompt)
        if sequence.snapshot_slot:  # a write reserved at admission (or before a preemption)
            self._reserved.discard(sequence.request_id)
        elif self.enabled and sequence.prompt_ids is not None and at_prompt_end:
            sequence.snapshot_slot = self._spare_slot(waiting, running + 1)
        return computed

    def _spare_slot(self, waiting: int, running: int) -> int:
        """A state slot for a snapshot, leaving the waiting prompts theirs; the least recently
        used entry without live forks is evicted to make one (a newer prefix is the likelier
        one reused); 0 when none can be had."""
        reserve = min(waiting, max(0, self._max_num_seqs - running))
        while self.slots.free_count - reserve < 1:
            order = self.retention.last(self.index.eviction_order())
            idle = [entry for entry in order if entry.live_forks == 0]
            if not idle:
                return 0
            self.evict(idle[0])
        return self.slots.take()

    # The end of a sequence

    def finish(self, sequence: Sequence) -> None:
        """A running sequence ended: kept as an entry if it has a snapshot, else freed."""
        self._fork_ended(sequence)
        if sequence.state_slot:
            self.slots.release(sequence.state_slot)
            sequence.state_slot = 0
        snapshot, sequence.snapshot_slot = sequence.snapshot_slot, 0
        if not snapshot or sequence.prompt_ids is None:
            self.kv.free(sequence.request_id)
            return
        self._entries += 1
        owner = f"prefix-cache:{self._entries}"
        self.kv.rename(sequence.request_id, owner)
        entry = self.index.add(_Cached(owner, snapshot), sequence.prompt_ids, sequence.cache_salt)
        if sequence.num_written_tokens:
            self.retention.pin(entry, sequence.retain_seconds)
        if self.store is not None:
            self.store.write(sequence.prompt_ids, sequence.cache_salt)

    def abort_waiting(self, sequence: Sequence) -> None:
        """A waiting sequence was aborted: a fork drops its pins, a restore its host entry's."""
        restored, sequence.restore_of = sequence.restore_of, None
        if restored is not None and self.host is not None:
            self.host.unpin(restored)
            sequence.fork_point = 0
        entry = sequence.fork_of
        if sequence.fork_point and entry is not None:
            self.kv.free(sequence.request_id)
            self.slots.release(entry.value.slot)
            sequence.fork_point = 0
        self._fork_ended(sequence)
        # A write's slot, reserved at admission or kept through a preemption.
        if sequence.snapshot_slot:
            self._reserved.discard(sequence.request_id)
            self.slots.release(sequence.snapshot_slot)
            sequence.snapshot_slot = 0

    def preempted(self, sequence: Sequence) -> None:
        """A running sequence lost its blocks (freed by the decode plan): its state and
        snapshot go too; it will be recomputed in full."""
        if sequence.state_slot:
            self.slots.release(sequence.state_slot)
            sequence.state_slot = 0
        # A write reported at admission keeps its slot: the recomputed prompt is written.
        if sequence.snapshot_slot and not sequence.num_written_tokens:
            self.slots.release(sequence.snapshot_slot)
            sequence.snapshot_slot = 0

    def _fork_ended(self, sequence: Sequence) -> None:
        entry, sequence.fork_of = sequence.fork_of, None
        if entry is not None:
            entry.live_forks -= 1

    # Eviction

    def evict_for_demand(self, waiting: Seq[Sequence], running: int) -> None:
        """Evict entries, least recently used first, while they stand in the way of waiting
        prompts (the prefill watermark, state slots) or of the next decode step's blocks."""
        if not self.index:
            return
        want_blocks = want_slots = 0
        # With every running slot taken no prompt starts this step: waiting ones want nothing.
        if waiting and running < self._max_num_seqs:
            tokens = sum(sequence.length for sequence in waiting)
            reused = sum(self.kept_blocks(sequence) for sequence in waiting)
            needed = blocks_for(tokens) + len(waiting) - reused
            want_blocks = min(needed, self._batched_blocks + len(waiting))
            want_slots = min(len(waiting), max(0, self._max_num_seqs - running))
        total = self.kv.cache_config.num_gpu_blocks

        def satisfied() -> bool:
            free = self.kv.get_num_free_gpu_blocks()
            fits = total - free + want_blocks <= PREFILL_WATERMARK * total
            return fits and free >= running and self.slots.free_count >= want_slots

        # Pinned entries go last (to the host tier, where they stay pinned).
        if satisfied():
            return
        for entry in self.retention.last(self.index.eviction_order()):
            self.evict(entry)
            if satisfied():
                return

    def evict(self, entry: CacheEntry[Any]) -> None:
        """Drop one entry: its blocks and snapshot, except what forks still pin; with a host
        tier, a copy of its prompt's blocks and snapshot goes there first."""
        offloaded = self.host is not None and self.host.offload(entry.tokens, entry.salt)
        self.index.remove(entry)
        if not offloaded:
            # No tier took its pin along: a pin of a prompt gone would count until its ttl.
            self.retention.release(entry, self.index)
        self.kv.free(entry.value.owner)
        self.slots.release(entry.value.slot)
