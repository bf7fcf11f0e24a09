"""The prefix cache's state snapshots on DeepInfer's LLMEngine.

A sequence whose prompt was just computed gets its state slot copied to a spare slot on its
first decode step, before that step's forward (the snapshot at P), through `_run_workers`, so
that every CP worker copies its own state. A finished sequence with a snapshot, or one that
finished before it decoded (its live slot is still at P), can be kept as a cache entry.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import numpy as np


class Snapshots:
    """One rank's snapshots; `status` is DeepInfer's `SequenceStatus`."""

    def __init__(self, engine: Any, status: Any, min_tokens: int) -> None:
        self._engine = engine
        self._states = engine.state_manager
        self._status = status
        self._min_tokens = min_tokens
        #: Live sequences whose last prompt chunk ran: snapshotted on their first decode step.
        self.pending: dict[int, Any] = {}
        #: Live sequences -> (sequence, the slot holding their state at the prompt's end).
        self.taken: dict[int, tuple[Any, int]] = {}

    def note(self, seq: Any) -> None:
        """The sequence's last prompt chunk ran: snapshot it on its first decode step."""
        # A recomputed (preempted) sequence's prefill ends past its prompt: no snapshot at P.
        # Image prompts are never cached: their placeholder tokens do not name the image.
        length = seq.get_prompt_len()
        if seq.get_len() == length and length >= self._min_tokens and seq.multi_modal_data is None:
            self.pending[seq.seq_id] = seq

    def take(self, outputs: Any, spare_slot: Callable[[int], int | None]) -> None:
        """On a decode step, copy the pending sequences' states to slots `spare_slot` gives
        (called with the step's running count; None: no slot, no snapshot)."""
        scheduled = {seq.seq_id for seq in outputs.scheduled_seqs}
        finishing: set[int] | None = None
        pairs: list[tuple[int, int]] = []
        running_status = self._status.RUNNING
        for seq_id, seq in list(self.pending.items()):
            if seq.status != running_status and seq.status != self._status.WAITING:
                # Finished before decoding: finalize_seq keeps its live slot, if it runs.
                if finishing is None:
                    finishing = {s.seq_id for s in outputs.finished_seqs}
                if seq_id not in finishing:
                    del self.pending[seq_id]
                continue
            at_prompt_end = (
                seq.status == running_status and seq.num_cached_tokens == seq.get_prompt_len()
            )
            if seq_id not in scheduled:
                if not at_prompt_end:
                    del self.pending[seq_id]
                continue
            del self.pending[seq_id]
            if not at_prompt_end:
                continue
            slot = spare_slot(len(scheduled))
            if slot is None:
                # No spare state slot this step: the prompt is not kept, and a later request
                # with its prefix prefills in full, as without the cache.
                continue
            pairs.append((int(seq.state_id), slot))
            self.taken[seq_id] = (seq, slot)
        if pairs:
            self._clone(pairs)

    def _clone(self, pairs: list[tuple[int, int]]) -> None:
        # Before this step's forward writes the live slot (stream order, as DeepInfer's own
        # fork clones); on every CP worker. The returned "to release" arrays are the clone
        # sources, which are live: never unpinned.
        self._engine._run_workers(
            "clone_and_zero_states_and_blocks_on_default_stream",
            clone_states=np.array(pairs, dtype=np.int32),
            clone_blocks=np.empty((0, 2), dtype=np.int32),
            zero_states=np.empty(0, dtype=np.int32),
        )

    def drop_preempted(self, gone: Collection[Any]) -> None:
        """Preempted sequences (`gone`: their statuses) lost their states: no snapshot."""
        for seq_id, (seq, slot) in list(self.taken.items()):
            if seq.status in gone:
                self.unpin(slot)
                del self.taken[seq_id]
        for seq_id, seq in list(self.pending.items()):
            if seq.status in gone:
                del self.pending[seq_id]

    def finished(self, seq: Any) -> tuple[int | None, bool]:
        """A finished sequence's snapshot slot (None: none), and whether its live slot is at
        the prompt's end (it finished, or was aborted, before its first decode step)."""
        seq_id = seq.seq_id
        snapshot = self.taken.pop(seq_id, None)
        at_prompt_end = (
            self.pending.pop(seq_id, None) is not None
            and seq.num_cached_tokens == seq.get_prompt_len()
        )
        return (snapshot[1] if snapshot is not None else None), at_prompt_end

    def unpin(self, slot: int) -> None:
        """Release one state slot."""
        self._states.unpin_blocks(np.array([slot], dtype=np.int32))
