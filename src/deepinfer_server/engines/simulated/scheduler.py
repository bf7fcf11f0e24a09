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

Both votes are cast together in the step's work check (`collectives.LockstepGroup`): a rank's
second vote ("I scheduled something") is known before the first is counted, because it only
attempts a prefill when it wants one and whether its queue's head fits is decided before any
prompt is scheduled. Each rank gets DeepInfer's answers at the same iteration, in one
rendezvous instead of three.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer_server.config.resolved import (
    DEFAULT_PREFILL_ANY_ATTEMPT_INTERVAL,
    DEFAULT_PREFILL_ATTEMPT_INTERVAL,
)
from deepinfer_server.engines.simulated.collectives import Tally

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

    attempt_interval: int = DEFAULT_PREFILL_ATTEMPT_INTERVAL
    any_attempt_interval: int = DEFAULT_PREFILL_ANY_ATTEMPT_INTERVAL
    decode_step: int = 0

    def __post_init__(self) -> None:
        if self.attempt_interval < 1 or self.any_attempt_interval < 1:
            raise ValueError("prefill attempt intervals must be at least 1")

    def _any_point(self) -> bool:
        return self.decode_step != 0 and self.decode_step % self.any_attempt_interval == 0

    def at_attempt_point(self) -> bool:
        """Whether this step votes (the same on every rank)."""
        return self._any_point() or self.decode_step % self.attempt_interval == 0

    def prefill(self, tally: Tally | None, world_size: int) -> bool:
        """Whether the group runs a prompt step, given the votes of an attempt point: at an ANY
        point one wanting rank suffices (scheduler.hpp's MIN of "not want" == 0), at an ALL
        point every rank must want (MIN of "want" == 1); then some rank must have scheduled
        something (the second MIN vote)."""
        if tally is None:
            return False
        wanted = tally.wants > 0 if self._any_point() else tally.wants == world_size
        return wanted and tally.schedulable > 0

    def advance(self, prompt_step: bool) -> None:
        """Count the step: a prompt step resets the counter, any other step increments it."""
        self.decode_step = 0 if prompt_step else self.decode_step + 1
