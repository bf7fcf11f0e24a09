"""PrefillCadence: when DeepInfer 0.1.0's scheduler may run a prompt step (NORMAL engine).

`csrc/engine/scheduler.hpp` `_schedule` (lines 295-341, 667-686) only schedules prompts at
attempt points of `decode_step`:

* ALL points, `decode_step % DEEPINFER_PREFILL_ATTEMPT_INTERVAL == 0` (default 70): every DP
  rank must want a prefill (an all-reduce MIN of "want");
* ANY points, `decode_step != 0 and decode_step % DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL == 0`
  (default 100): one rank suffices (a MIN of "not want"); ANY wins when both coincide.

A rank wants a prefill with KV usage at or below 90% and a schedulable head of its queue. After
a winning vote a second MIN vote asks whether any rank scheduled something; if none did, the
step decodes, otherwise ranks with nothing run an empty prompt step, so that a step is all
prefill or all decode across the group. A prompt step resets `decode_step` (so prefills repeat
back to back while every rank still wants one); every other step, empty ones included,
increments it. The counter is equal on every rank because every rank takes the same decisions.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer_server.config.resolved import (
    DEFAULT_PREFILL_ANY_ATTEMPT_INTERVAL,
    DEFAULT_PREFILL_ATTEMPT_INTERVAL,
)
from deepinfer_server.engines.simulated.collectives import LockstepGroup

__all__ = [
    "DEFAULT_PREFILL_ANY_ATTEMPT_INTERVAL",
    "DEFAULT_PREFILL_ATTEMPT_INTERVAL",
    "KV_WATERMARK",
    "PrefillCadence",
]
#: A rank wants a prefill only at or below this KV usage (scheduler.hpp:80).
KV_WATERMARK = 0.9


@dataclass
class PrefillCadence:
    """The prefill attempt points and votes of one DP rank."""

    group: LockstepGroup
    rank: int
    attempt_interval: int = DEFAULT_PREFILL_ATTEMPT_INTERVAL
    any_attempt_interval: int = DEFAULT_PREFILL_ANY_ATTEMPT_INTERVAL
    decode_step: int = 0

    def __post_init__(self) -> None:
        if self.attempt_interval < 1 or self.any_attempt_interval < 1:
            raise ValueError("prefill attempt intervals must be at least 1")

    def vote(self, want: bool) -> bool:
        """Whether the group attempts a prefill this step (collective at attempt points only)."""
        step = self.decode_step
        any_point = step != 0 and step % self.any_attempt_interval == 0
        all_point = step % self.attempt_interval == 0
        if any_point:
            return self.group.all_reduce_min(self.rank, 0 if want else 1) == 0
        if all_point:
            return self.group.all_reduce_min(self.rank, 1 if want else 0) == 1
        return False

    def anyone_scheduled(self, scheduled: bool) -> bool:
        """The second vote after a winning one: did any rank schedule a prompt (or ignore one)?"""
        return self.group.all_reduce_min(self.rank, 0 if scheduled else 1) == 0

    def advance(self, prompt_step: bool) -> None:
        """Count the step: a prompt step resets the counter, any other step increments it."""
        self.decode_step = 0 if prompt_step else self.decode_step + 1
