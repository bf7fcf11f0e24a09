"""Cross-request prefix caching on DeepInfer 0.1.0's LLMEngine.

Design: docs/design/prefix-caching.md (every claim there checked against DeepInfer's source).
DeepInfer already has the mechanism, a forked prompt (`Scheduler.fork_seq` and the `_` branch of
its prefill: keep the parent's full blocks, copy the partial one, clone the state slot, prefill
only the rest); this module supplies the policy, through the engine's own hooks:

- `post_schedule`: a sequence whose prompt was just computed gets its state slot copied to a
  spare slot on its first decode step, before that step's forward (the snapshot at P).
- `finalize_seq`: a finished sequence with a snapshot is kept (its blocks and the snapshot slot)
  as a cache entry instead of being freed.
- `add_request`: a text prompt that starts with an entry's P tokens (P - 1 with a thinking-mode
  turn) is forked from it; anything the fork path cannot serve (prompt logprobs, images, a
  grammar, chunk checkpoints, a too-long prompt, a fork whose pins leave its prefill no room)
  takes DeepInfer's ordinary path, never an error. The fork's `num_cached_tokens` counts the
  reused tokens. A request's cache salt partitions the cache: it forks only from entries kept
  under the same salt, and is kept under its own. A retained request (`retention_seconds`) has
  its write decided at admission (`prefix_asks`) and, once kept, its entry pinned within its
  partition's budget (`prefix_cache.retention`). With the host tier (`prefix_host`) prompts
  are placed in blocks the cache chose, evicted entries copied to host memory and restored.
- `step`: before the scheduler runs, least-recently-used entries (pinned ones last) are evicted
  until the waiting prompts fit under the 90% prefill watermark, running sequences have a block
  each for their next token, and waiting prompts have state slots.
- `abort_request`: a fork aborted while still waiting would keep its pins (DeepInfer frees
  aborted waiting sequences never), so it is freed here, and the asks noted for it dropped.

Everything runs on the rank loop's thread, as the engine does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from deepinfer_server.engines.deepinfer.engine_checks import copy_clone_unpins, disabled_reason
from deepinfer_server.engines.deepinfer.placement import GPU_CACHE_PREFILL_WATERMARK
from deepinfer_server.engines.deepinfer.prefix_asks import Ask, Asks, keepable_at_admission
from deepinfer_server.engines.deepinfer.prefix_forks import Forks, fork_fits
from deepinfer_server.engines.deepinfer.prefix_host import HostPath, host_path
from deepinfer_server.engines.deepinfer.prefix_settings import PrefixCacheSettings
from deepinfer_server.engines.deepinfer.prefix_snapshots import Snapshots
from deepinfer_server.ipc.messages import HostTierStats
from deepinfer_server.model.kv_block import BLOCK_SIZE, blocks_for
from deepinfer_server.prefix_cache.index import CacheEntry, Match, PrefixIndex
from deepinfer_server.prefix_cache.retention import Retention

logger = logging.getLogger(__name__)


class PrefixCache:
    """The cache of one rank's engine: its entries, snapshots, live forks and counters."""

    def __init__(self, engine: Any, settings: PrefixCacheSettings) -> None:
        from deepinfer import envs
        from deepinfer._C.engine import SequenceStatus

        self._scheduler = engine.scheduler
        self._states = engine.state_manager
        self._status = SequenceStatus
        self._keepable = {
            SequenceStatus.FINISHED_STOPPED,
            SequenceStatus.FINISHED_LENGTH_CAPPED,
            SequenceStatus.FINISHED_ABORTED,
        }
        self.settings = settings
        rollback = min(settings.max_rollback, int(envs.DEEPINFER_MAX_BACKTRACKING_TOKENS))
        self.index: PrefixIndex[Any] = PrefixIndex(max_rollback=rollback)
        self._read_limits(engine)
        self.snapshots = Snapshots(engine, SequenceStatus, settings.min_tokens)
        self.forks = Forks(self._scheduler, SequenceStatus)
        #: Entries -> the KV blocks their table holds (at most): what a fork of them pins.
        self._table_blocks: dict[int, int] = {}
        #: Live sequences with a cache salt or a retention: what `finalize` keeps them under.
        self.asks = Asks(SequenceStatus)
        #: Matches prefilled in full because their fork could never be scheduled.
        self.forks_too_large = 0
        self._preempted_seen = int(self._scheduler.get_num_preempted_seqs())
        self.query_tokens = self.hit_tokens = self.evictions = 0
        self.disabled = disabled_reason(engine)
        if self.disabled is None:
            copy_clone_unpins(engine.deferred_release)
        self.host: HostPath | None = None
        if self.disabled is None and settings.host_tier_bytes > 0:
            self.host = host_path(engine, self, settings)
        #: The prompts requests asked to keep for a time, pinned within a per-partition share of
        #: the slowest tier (the host tier's blocks, else the pool's), whose eviction they follow.
        tier_blocks = (
            self._total_blocks if self.host is None else self.host.tier.settings.capacity_blocks()
        )
        self.retention = Retention(int(tier_blocks * settings.retention_share))
        if self.host is not None:
            self.host.tier.pins = self.retention

    def _read_limits(self, engine: Any) -> None:
        """The engine's sizes the cache's decisions read: sequences, blocks, prompt limit."""
        config = engine.scheduler_config
        self._max_num_seqs = int(config.max_num_seqs)
        self._max_batched_blocks = int(config.max_num_batched_tokens) // BLOCK_SIZE
        limit = int(config.max_model_len)
        if not config.chunked_prefill:
            limit = min(limit, int(config.max_num_batched_tokens))
        self._prompt_limit = limit
        self._total_blocks = int(engine.cache_config.num_gpu_blocks)

    # Counters

    def stats(self) -> tuple[int, int, int]:
        """(prompt tokens looked up, prompt tokens reused, entries now)."""
        return self.query_tokens, self.hit_tokens, len(self.index)

    def host_stats(self) -> HostTierStats | None:
        """The host tier's counters (None without one)."""
        return None if self.host is None else self.host.stats()

    # F: add_request

    def add_request(
        self,
        add: Callable[..., Any],
        *args: Any,
        cache_salt: bytes | None = None,
        retention_seconds: float = 0.0,
    ) -> Any:
        """`LLMEngine.add_request(*args)` (all nine arguments, positionally), or a fork of an
        entry kept under `cache_salt`; the sequence is kept under `cache_salt` when it ends,
        and pinned for `retention_seconds` (0: not pinned)."""
        if self.disabled is not None:
            return add(*args)
        seq = self._add(add, args, cache_salt)
        if seq is not None:
            self._note_ask(seq, args, cache_salt, retention_seconds)
        return seq

    def _note_ask(
        self, seq: Any, args: tuple[Any, ...], salt: bytes | None, retain_seconds: float
    ) -> None:
        """Note what `finalize` keeps `seq` under; a retained prompt the cache would keep is
        reported written now (`written_tokens`)."""
        written = 0
        if retain_seconds > 0:
            images, extra = args[4], args[6]
            text_only = images is None and not (extra and "multi_modal_data" in extra)
            prompt_tokens = int(seq.get_prompt_len())
            limits = (self.settings.min_tokens, self._prompt_limit)
            if keepable_at_admission(prompt_tokens, text_only, *limits):
                written = prompt_tokens
        if salt is not None or written:
            self.asks.note(Ask(seq, salt, retain_seconds if written else 0.0, written))

    def written_tokens(self, seq: Any) -> int:
        """The prompt tokens reported written to the cache for a sequence just added (0: none:
        no retention asked, or a prompt the cache does not keep)."""
        ask = self.asks.get(seq.seq_id)
        return 0 if ask is None else ask.written

    def _add(self, add: Callable[..., Any], args: tuple[Any, ...], salt: bytes | None) -> Any:
        (user_id, request_id, params, prompt, images, arrival, extra, enqueue, checkpoints) = args
        prompt = np.asarray(prompt)
        self.query_tokens += int(prompt.size)
        if not (enqueue and images is None and not extra and checkpoints is None):
            return add(*args)
        if not self._forkable(params, prompt):
            return add(*args)
        match = self.index.match(prompt, limit=len(prompt) - 2, salt=salt)
        if self.host is not None:
            return self._add_placed(self.host, add, args, salt, match)
        if match is None:
            return add(*args)
        if not self._fork_fits(match, int(prompt.size)):
            self.forks_too_large += 1
            return add(*args)
        # DeepInfer builds and validates the sequence (token range, compressed encoding, the
        # normalised SamplingParams); it is never enqueued: the fork takes its place.
        seq = add(user_id, request_id, params, prompt, None, arrival, extra, False, None)
        if seq is None:
            return None
        try:
            return self._fork(match, seq)
        except Exception:
            logger.exception("forking request %s failed: full prefill", request_id)
            self.evict(match.entry)
            self._scheduler.add_sequence(seq)
            return seq

    def _add_placed(
        self, host: HostPath, add: Callable[..., Any], args: tuple[Any, ...], salt: Any, match: Any
    ) -> Any:
        """With the host tier: the prompt placed (`prefix_host`), else as without it."""
        seq = add(*args[:4], None, *args[5:7], False, None)  # built, never enqueued
        return None if seq is None else host.add(seq, np.asarray(args[3]), salt, match)

    def enter_unplaced(self, seq: Any, match: Match[Any] | None) -> Any:
        """Queue a built sequence DeepInfer places: forked from `match`, or computed in full."""
        if match is not None and self._fork_fits(match, int(seq.get_prompt_len())):
            return self._fork(match, seq)
        self._scheduler.add_sequence(seq)
        return seq

    def _forkable(self, params: Any, prompt: npt.NDArray[Any]) -> bool:
        def field(name: str) -> Any:
            return params.get(name) if isinstance(params, dict) else getattr(params, name, None)

        if field("prompt_logprobs") or field("so_args") is not None or field("golden_token_ids"):
            return False
        return self.settings.min_tokens <= prompt.size <= self._prompt_limit

    def _fork_fits(self, match: Match[Any], prompt_tokens: int) -> bool:
        table_blocks = self._table_blocks[match.entry.value.seq_id]
        return fork_fits(table_blocks, match, prompt_tokens, self._total_blocks)

    def _fork(self, match: Match[Any], seq: Any) -> Any:
        fork = self.forks.fork(match, seq)
        self.index.touch(match.entry)
        self.hit_tokens += match.fork_point
        return fork

    # G: aborts

    def abort_request(
        self, abort: Callable[[list[str]], tuple[int, int]], request_ids: list[str]
    ) -> tuple[int, int]:
        """`LLMEngine.abort_request(request_ids)`, then free the forks it hit while they wait
        and drop the asks of waiting sequences (DeepInfer ends those without finalizing)."""
        ids = set(request_ids)
        waiting = self.asks.waiting(ids)
        result = abort(request_ids)
        self.asks.drop_aborted(waiting)
        if self.forks.waiting:
            self.forks.free_aborted(ids)
        if self.host is not None:
            for seq_id in self.host.abort(ids):
                self.asks.pop(seq_id)
        return result

    # A: eviction

    def evict_for_demand(self) -> None:
        """Evict entries (least recently used first, pinned ones last) while they stand in the
        way of waiting prompts (KV watermark, state slots) or of the next decode step's
        blocks."""
        if not self.index:
            return
        scheduler = self._scheduler
        waiting, waiting_tokens = scheduler.get_sum_prompt_len_waiting()
        running, _ = scheduler.get_sum_prompt_len_running()
        want_blocks = want_slots = 0
        # With every running slot taken no prompt starts this step: waiting ones want nothing.
        if waiting and running < self._max_num_seqs:
            needed = blocks_for(waiting_tokens) + waiting - self.forks.reused_blocks()
            want_blocks = min(needed, self._max_batched_blocks + waiting)
            want_slots = min(waiting, max(0, self._max_num_seqs - running))

        limit = GPU_CACHE_PREFILL_WATERMARK * self._total_blocks

        def satisfied() -> bool:
            free = int(scheduler.get_num_free_gpu_blocks())
            slots = int(self._states.get_num_free_blocks())
            fits = self._total_blocks - free + want_blocks <= limit
            return fits and free >= running and slots >= want_slots

        if satisfied():
            return
        for entry in self.eviction_order():
            self.evict_for_room(entry)
            if satisfied():
                return

    def eviction_order(self) -> list[CacheEntry[Any]]:
        """The entries in the order room is made: least recently used first, pinned ones last."""
        return self.retention.last(self.index.eviction_order())

    def evict_for_room(self, entry: CacheEntry[Any]) -> None:
        """Evict `entry` to make room; unless the host tier took it (and its pin along), its
        pin goes."""
        if not self.evict(entry):
            self.retention.release(entry, self.index)

    def evict(self, entry: CacheEntry[Any], offload: bool = True) -> bool:
        """Drop one entry and free its blocks and snapshot (what no fork still pins), after
        copying it to the host tier (if any, and `offload`); whether the tier kept a copy."""
        self.index.remove(entry)
        self._table_blocks.pop(entry.value.seq_id, None)
        kept = False
        if self.host is not None:
            try:
                kept = self.host.evicted(entry, offload)
            except Exception:  # a failed copy loses the entry, never its rows or the step
                logger.exception("copying an evicted prefix to host memory failed: dropped")
        self._scheduler.free_seq(entry.value)
        self.evictions += 1
        return kept

    def clear(self) -> None:
        """Evict every entry, the host tier's too."""
        for entry in list(self.index):
            self.evict(entry, offload=False)
        if self.host is not None:
            self.host.clear()

    # C: snapshots

    def post_schedule(self, outputs: Any) -> None:
        """Note the prompts this step completes; on a decode step, snapshot their states."""
        if self.disabled is not None:
            return
        if outputs.prompt_run:
            for seq in outputs.scheduled_seqs:
                if seq.chunked_rest_len == 0:
                    self.forks.prefilled(seq.seq_id)
                    self.snapshots.note(seq)
        if self.forks.waiting:
            self.forks.drop_refused()
        self.asks.prune_if_due()
        if outputs.prompt_run:
            return
        preempted = int(self._scheduler.get_num_preempted_seqs())
        if preempted != self._preempted_seen:
            self._preempted_seen = preempted
            # A preempted sequence lost its blocks: its snapshot and fork bookkeeping go.
            gone = (self._status.WAITING, self._status.FINISHED_PREEMPTED)
            self.snapshots.drop_preempted(gone)
            self.forks.drop_preempted(gone)
            if self.host is not None:
                self.host.preempted(gone)
        if self.snapshots.pending:
            self.snapshots.take(outputs, self._spare_state_slot)

    def _spare_state_slot(self, running: int) -> int | None:
        """A state slot for a snapshot, leaving the waiting prompts theirs; the least recently
        used idle entry (pinned ones last) is evicted to make one (a newer prefix is the
        likelier one reused)."""
        waiting, _ = self._scheduler.get_sum_prompt_len_waiting()
        reserve = min(waiting, max(0, self._max_num_seqs - running))
        while self._states.get_num_free_blocks() - reserve < 1:
            idle = [entry for entry in self.eviction_order() if entry.live_forks == 0]
            if not idle:
                return None
            self.evict_for_room(idle[0])
        self._states.lock()
        try:
            (slot,) = self._states.allocate_nolock(1)
        finally:
            self._states.unlock()
        return int(slot)

    # D: keeping finished sequences

    def finalize(self, seq: Any) -> None:
        """`finalize_seq`: keep a finished sequence with a state at P as an entry (pinned when
        its write was reported), else free it."""
        seq_id = seq.seq_id
        self.forks.ended(seq_id)
        self.forks.prefilled(seq_id)
        ask = self.asks.pop(seq_id)
        slot, at_prompt_end = self.snapshots.finished(seq)
        if (slot is None and not at_prompt_end) or seq.status not in self._keepable:
            if slot is not None:
                self.snapshots.unpin(slot)
            self._scheduler.free_seq(seq)
            return
        if slot is not None:
            self.snapshots.unpin(seq.state_id)
            seq.state_id = slot
        prompt_len = seq.get_prompt_len()
        tokens = np.array(seq.data.get_token_ids()[:prompt_len], dtype=np.int32)
        # Its table covers its tokens and at most one block more (MTP drafts, in flight); read
        # now, since a fork sets the entry's data to the fork's prompt.
        self._table_blocks[seq_id] = blocks_for(int(seq.get_len())) + 1
        entry = self.index.add(seq, tokens, ask.salt if ask is not None else None)
        if self.host is not None:
            self.host.kept(entry)
        if ask is not None and ask.written:
            # Over its partition's budget it stays unpinned: plain LRU.
            self.retention.pin(entry, ask.retain_seconds)
