"""What live sequences asked of DeepInfer's prefix cache: a partition and a retention.

A request's cache salt (the partition it forks from and is kept in) and its retention (how
long its prompt stays pinned once kept: `prefix_cache.retention`) reach
`PrefixCache.add_request` with it and are read when its sequence is finalized. DeepInfer's
sequences take no attributes of the server's, so they are held here by sequence ID meanwhile.
A sequence DeepInfer ends without finalizing (aborted while waiting; ignored: too long,
preempted for good, a failed grammar or image) would leave its ask behind: those are dropped
at the abort, and the ignored ones by an amortised prune.

A retained prompt's write is decided at admission, as on the simulated engine, so that its
written tokens come with the request's first output (`Ask.written`): by the rule the cache
keeps prompts by (`keepable_at_admission`). What only its run decides (a spare state slot for
its snapshot, no preemption before it, how it ends) can still leave it unkept.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

#: Asks noted before the first look for sequences DeepInfer ended without finalizing.
_PRUNE_MIN = 1024


@dataclass(frozen=True, slots=True)
class Ask:
    """One live sequence's partition and retention."""

    seq: Any
    #: The cache salt it is kept under (None: the unsalted partition).
    salt: bytes | None
    #: How long its prompt is pinned once kept (0: not pinned).
    retain_seconds: float = 0.0
    #: The prompt tokens reported written to the cache for it (0: none, and no pin).
    written: int = 0


def keepable_at_admission(
    prompt_tokens: int, text_only: bool, min_tokens: int, prompt_limit: int
) -> bool:
    """Whether a prompt just added is one the cache would keep: text (`Snapshots.note` takes
    no image prompt), at least `min_tokens` long (nor a shorter one) and within the prompt
    limit (DeepInfer ignores a longer one: it is never finalized)."""
    return text_only and min_tokens <= prompt_tokens <= prompt_limit


class Asks:
    """The asks of one rank's live sequences, by sequence ID; `status` is DeepInfer's
    `SequenceStatus`."""

    def __init__(self, status: Any) -> None:
        self._status = status
        #: Finishes that are never finalized or never kept (DeepInfer's ignored sequences).
        self._never_kept = {
            status.FINISHED_IGNORED,
            status.FINISHED_PREEMPTED,
            status.FINISHED_SO_FAILED,
            status.FINISHED_VE_FAILED,
        }
        self._by_seq: dict[int, Ask] = {}
        #: Past this many, asks of sequences that can no longer be kept are dropped.
        self._pruned_at = _PRUNE_MIN

    def __len__(self) -> int:
        return len(self._by_seq)

    def note(self, ask: Ask) -> None:
        """Hold `ask` until its sequence is finalized (or can no longer be)."""
        self._by_seq[ask.seq.seq_id] = ask

    def get(self, seq_id: int) -> Ask | None:
        """The ask of a live sequence, if it made one."""
        return self._by_seq.get(seq_id)

    def pop(self, seq_id: int) -> Ask | None:
        """The ask of a sequence being finalized, forgotten."""
        return self._by_seq.pop(seq_id, None)

    def waiting(self, request_ids: Collection[str]) -> list[int]:
        """The sequences of `request_ids` still waiting (an abort ends them unfinalized)."""
        waiting = self._status.WAITING
        return [
            seq_id
            for seq_id, ask in self._by_seq.items()
            if ask.seq.request_id in request_ids and ask.seq.status == waiting
        ]

    def drop_aborted(self, seq_ids: list[int]) -> None:
        """Drop those of `seq_ids` (waiting before an abort) that the abort reached: one whose
        grammar still compiles is in no queue yet, and may yet run (and be kept) before a
        later abort finds it."""
        aborted = self._status.FINISHED_ABORTED
        for seq_id in seq_ids:
            if self._by_seq[seq_id].seq.status == aborted:
                del self._by_seq[seq_id]

    def prune_if_due(self) -> None:
        """Drop the asks of sequences DeepInfer ended as ignored: they are never kept.
        Amortised: the bound doubles."""
        if len(self._by_seq) <= self._pruned_at:
            return
        never = self._never_kept
        for seq_id, ask in list(self._by_seq.items()):
            if ask.seq.status in never:
                del self._by_seq[seq_id]
        self._pruned_at = max(_PRUNE_MIN, 2 * len(self._by_seq))
