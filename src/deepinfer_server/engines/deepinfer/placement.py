"""Placement: prompts the prefix cache puts in KV blocks and a state slot it chose itself.

DeepInfer 0.1.0 binds no sequence's block table to Python (`Sequence` has no `block_table`),
so the rows of a prompt DeepInfer placed cannot be named. A placed prompt can: the sequence
DeepInfer built (`add_request` with `enqueue=False`) enters through
`Scheduler.fork_seq(seq, blocks, ...)` on a branch without a leading `_`, which pins exactly
those blocks and that slot, puts it at the front of the waiting queue, and makes its prefill
keep that table and compute from its `num_cached_tokens` (`scheduler.hpp` `fork_seq` and
`_schedule_prefill`: a waiting sequence with a table off the forked branch allocates nothing).
As the prompt role does, a prompt computed in full is forked with `num_cached_tokens` 1 (a fork
needs a computed prefix) and set back to 0. The caller's own pins are dropped once the fork
holds its own.

A placed sequence's table is known until it ends or is preempted (a recomputed sequence gets
blocks from DeepInfer); a kept one's until its entry is evicted.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from deepinfer_server.engines.deepinfer.cache_memory import allocate
from deepinfer_server.engines.deepinfer.fork_seq import fork_seq

#: KV use above which DeepInfer's scheduler starts no prefill (`GPU_CACHE_PREFILL_WATERMARK`).
GPU_CACHE_PREFILL_WATERMARK = 0.9
#: The branch placed prompts get (no leading "_": DeepInfer's prefill keeps their table).
PLACED_BRANCH = "prefix_placed"
#: Tables noted before the first look for sequences that ended without being kept.
_PRUNE_MIN = 256


class Placement:
    """One rank's placed sequences and their tables (the engine's loop thread owns it)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._scheduler = engine.scheduler
        #: Placed sequences (live, or kept as entries) -> (sequence, its block table).
        self._tables: dict[int, tuple[Any, list[int]]] = {}
        #: Past this many tables, those of sequences that ended unkept are dropped.
        self.pruned_at = _PRUNE_MIN

    def __len__(self) -> int:
        return len(self._tables)

    def reserve(self, blocks: int) -> tuple[list[int], int]:
        """`blocks` KV blocks and a state slot, pinned once for the caller."""
        (slot,) = allocate(self._engine.state_manager, 1)
        return (allocate(self._engine.block_manager, blocks) if blocks else []), slot

    def clone(self, states: Sequence[tuple[int, int]], blocks: Sequence[tuple[int, int]]) -> None:
        """Copy state rows and block rows (source, destination) on every worker, on the default
        stream (before the next step's forward). What the clone returns to release (its
        sources) stays held: they belong to a cached entry."""
        self._engine._run_workers(
            "clone_and_zero_states_and_blocks_on_default_stream",
            clone_states=np.array(states, dtype=np.int32).reshape(-1, 2),
            clone_blocks=np.array(blocks, dtype=np.int32).reshape(-1, 2),
            zero_states=np.empty(0, dtype=np.int32),
        )

    def enter(self, seq: Any, table: list[int], slot: int, cached: int, owned: list[int]) -> Any:
        """Fork `seq` (built, not queued) into `table` and `slot`, prefilled from `cached`;
        the caller's pins on `owned` blocks and on `slot` are dropped."""
        seq.num_cached_tokens = max(cached, 1)
        seq.state_id = slot
        try:
            fork = fork_seq(self._scheduler, seq, table, PLACED_BRANCH, seq)
        finally:
            seq.state_id = -1
            self.release(owned, slot)  # the fork holds its own pins (or failed: none)
        if cached == 0:
            fork.num_cached_tokens = 0
        fork.cached_hit_tokens = cached
        self._tables[int(fork.seq_id)] = (fork, list(table))
        return fork

    def release(self, blocks: list[int], slot: int) -> None:
        """Drop the caller's pins on `blocks` and `slot` (`reserve`)."""
        engine = self._engine
        if blocks:
            engine.block_manager.unpin_blocks(np.asarray(blocks, dtype=np.int32))
        engine.state_manager.unpin_blocks(np.asarray([slot], dtype=np.int32))

    def table_of(self, seq: Any) -> list[int] | None:
        """The block table of a placed sequence or entry (None: DeepInfer placed it)."""
        known = self._tables.get(int(seq.seq_id))
        return None if known is None or known[0] is not seq else known[1]

    def forget(self, seq: Any) -> list[int] | None:
        """An entry is evicted: its table, which is no longer held."""
        known = self._tables.pop(int(seq.seq_id), None)
        return None if known is None or known[0] is not seq else known[1]

    def drop_preempted(self, gone: Collection[Any], waiting: Collection[int]) -> None:
        """Placed sequences preempted (`gone`: their statuses; `waiting`: forks not yet
        prefilled, whose WAITING is not a preemption) lost their blocks."""
        for seq_id, (seq, _table) in list(self._tables.items()):
            if seq_id not in waiting and seq.status in gone:
                del self._tables[seq_id]

    def prune(self, alive: Collection[Any], kept: Collection[int]) -> None:
        """Drop the tables of sequences that ended without being kept (`alive`: the statuses
        of sequences that may still run; `kept`: the entries' sequence IDs). Called past
        `pruned_at` tables, which then doubles (amortised)."""
        for seq_id, (seq, _table) in list(self._tables.items()):
            if seq_id not in kept and seq.status not in alive:
                del self._tables[seq_id]
        self.pruned_at = max(_PRUNE_MIN, 2 * len(self._tables))
