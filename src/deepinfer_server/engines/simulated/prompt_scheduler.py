"""PromptScheduler: which waiting requests a step prefills (DeepInfer 0.1.0, chunked prefill off).

Prompts are scheduled only at the prefill cadence's attempt points (`scheduler.PrefillCadence`),
from the head of the queue in order, while they fit: the running cap, the KV blocks and a state
slot, and the step's prompt-token budget (`max_num_batched_tokens`, counting the tokens a
prompt computes: a prefix-cache fork computes only its last ones). A prompt longer than the
context, or a request whose grammar failed, ends "ignored" at its turn; each prefilled request
generates its first token in the prompt step.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer_server.disaggregation.role import DisaggregationRole
from deepinfer_server.engines.simulated.collectives import Ballot, Tally
from deepinfer_server.engines.simulated.kv_blocks import AllocStatus
from deepinfer_server.engines.simulated.outputs import OutputRecord
from deepinfer_server.engines.simulated.request_table import RequestTable
from deepinfer_server.engines.simulated.scheduler import KV_WATERMARK, PrefillCadence
from deepinfer_server.engines.simulated.sequence import (
    FINISH_PROMPT_TOO_LONG,
    FINISH_SO_FAILED,
    Sequence,
)
from deepinfer_server.engines.simulated.token_generator import TokenGenerator

#: `PromptScheduler._turn`'s answers besides a finish reason.
_START = "start"
_STOP = "stop before it"


@dataclass
class PromptScheduler:
    """The prompt steps of one engine."""

    table: RequestTable
    generator: TokenGenerator
    cadence: PrefillCadence
    max_model_len: int
    max_num_seqs: int
    #: Prompt tokens one step may take; without chunked prefill it also bounds a prompt.
    batched_tokens: int
    prompt_limit: int
    #: The DP group's size (an ALL point needs every rank's vote).
    world_size: int = 1
    #: The prompt tokens the last prompt step computed (a fork's reused ones excluded).
    computed_tokens: int = 0
    #: DeepInfer's engine type: NULL (NORMAL: the cadence's votes), PREFILL (PROMPT: every
    #: step is a prompt step) or DECODE (COMPLETION: none is), as scheduler.hpp `schedule()`.
    engine_type: DisaggregationRole = DisaggregationRole.NULL

    def ballot(self, now: float) -> Ballot:
        """This rank's prefill votes at an attempt point, for a step ending at `now`: it wants a
        prefill with KV usage at or below the watermark and a ready head of the queue, and
        would schedule (or end ignored) that head."""
        waiting = self.table.waiting
        head_ready = bool(waiting) and waiting[0].ready_at <= now
        want = self.table.kv_usage() <= KV_WATERMARK and head_ready
        return Ballot(want, want and self._turn(waiting[0], 0, now) != _STOP)

    def schedule(
        self, returned: list[OutputRecord], now: float, ballot: Ballot | None, tally: Tally | None
    ) -> bool:
        """DeepInfer's prefill cadence (scheduler.PrefillCadence), given this rank's `ballot`
        and the group's `tally` for the step (both None off the attempt points): True for a
        prompt step, whose outputs (first tokens, ignored requests) are appended to `returned`
        and whose prompt tokens computed are `computed_tokens`; `now` is the step's end, as of
        which requests are ready."""
        self.computed_tokens = 0
        if self.engine_type is DisaggregationRole.DECODE:
            return False
        if self.engine_type is DisaggregationRole.PREFILL:
            returned.extend(self._prefill(now))
            return True
        if ballot is None or not self.cadence.prefill(tally, self.world_size):
            return False
        outputs = self._prefill(now) if ballot.want else []
        # The vote said what this rank would schedule, from the same state.
        assert bool(outputs) == ballot.schedulable, "a prefill vote disagreed with its step"
        returned.extend(outputs)  # empty: this rank pads the group's prompt step
        return True

    def _prefill(self, now: float) -> list[OutputRecord]:
        """Schedule the queue's head in order (scheduler.hpp:351-554, chunked prefill off): stop
        at the first request that is not ready or does not fit (no skipping ahead)."""
        table = self.table
        outputs: list[OutputRecord] = []
        tokens = 0
        while table.waiting:
            sequence = table.waiting[0]
            turn = self._turn(sequence, tokens, now)
            if turn == _STOP:
                break
            if turn != _START:
                table.drop_head(sequence)
                outputs.append(sequence.ignored_output(turn))
                continue
            tokens += sequence.length - sequence.fork_point
            self.computed_tokens += table.start(sequence)
            outputs.extend(self.generator.generate(sequence, budget=1))
        return outputs

    def _turn(self, sequence: Sequence, tokens: int, now: float) -> str:
        """What the head of the queue does in a prompt step that has taken `tokens` so far:
        `_START`, `_STOP` (the step ends before it), or the reason it ends ignored. Reads the
        state only: the prefill votes ask it too."""
        if sequence.ready_at > now:
            return _STOP
        # A preempted sequence is recomputed: prompt and output so far are prefilled again.
        allocation = self.table.can_prefill(sequence)
        too_long = len(sequence.prompt) > self.prompt_limit
        if too_long or sequence.length > self.max_model_len or allocation is AllocStatus.NEVER:
            return FINISH_PROMPT_TOO_LONG
        if sequence.grammar_failed:
            return FINISH_SO_FAILED
        if allocation is AllocStatus.LATER or len(self.table.running) >= self.max_num_seqs:
            return _STOP
        # The step's budget counts the tokens it computes (a fork's last ones only).
        computes = sequence.length - sequence.fork_point
        if tokens and tokens + computes > self.batched_tokens:
            return _STOP  # the next prompt step takes it (alone, if it must)
        return _START
