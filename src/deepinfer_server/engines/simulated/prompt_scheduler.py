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

from deepinfer_server.engines.simulated.kv_blocks import AllocStatus
from deepinfer_server.engines.simulated.outputs import OutputRecord
from deepinfer_server.engines.simulated.request_table import RequestTable
from deepinfer_server.engines.simulated.scheduler import KV_WATERMARK, PrefillCadence
from deepinfer_server.engines.simulated.sequence import FINISH_PROMPT_TOO_LONG, FINISH_SO_FAILED
from deepinfer_server.engines.simulated.token_generator import TokenGenerator


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
    #: The prompt tokens the last prompt step computed (a fork's reused ones excluded).
    computed_tokens: int = 0
    #: DeepInfer's engine type: "null" (NORMAL: the cadence's votes), "prefill" (PROMPT: every
    #: step is a prompt step) or "decode" (COMPLETION: none is), as scheduler.hpp `schedule()`.
    engine_type: str = "null"

    def schedule(self, returned: list[OutputRecord], now: float) -> bool:
        """DeepInfer's prefill cadence (scheduler.PrefillCadence): True for a prompt step,
        whose outputs (first tokens, ignored requests) are appended to `returned` and whose
        prompt tokens computed are `computed_tokens`; `now` is the step's end, as of which
        requests are ready."""
        self.computed_tokens = 0
        if self.engine_type == "decode":
            return False
        if self.engine_type == "prefill":
            returned.extend(self._prefill(now))
            return True
        waiting = self.table.waiting
        head_ready = bool(waiting) and waiting[0].ready_at <= now
        want = self.table.kv_usage() <= KV_WATERMARK and head_ready
        if not self.cadence.vote(want):
            return False
        outputs = self._prefill(now) if want else []
        if not self.cadence.anyone_scheduled(bool(outputs)):
            return False
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
            if sequence.ready_at > now:
                break
            # A preempted sequence is recomputed: prompt and output so far are prefilled again.
            allocation = table.can_prefill(sequence)
            too_long = len(sequence.prompt) > self.prompt_limit
            if too_long or sequence.length > self.max_model_len:
                too_long = True
            if too_long or allocation is AllocStatus.NEVER:
                table.drop_head(sequence)
                outputs.append(sequence.ignored_output(FINISH_PROMPT_TOO_LONG))
                continue
            if sequence.grammar_failed:
                table.drop_head(sequence)
                outputs.append(sequence.ignored_output(FINISH_SO_FAILED))
                continue
            if allocation is AllocStatus.LATER or len(table.running) >= self.max_num_seqs:
                break
            # The step's budget counts the tokens it computes (a fork's last ones only).
            computes = sequence.length - sequence.fork_point
            if tokens and tokens + computes > self.batched_tokens:
                break  # the next prompt step takes it (alone, if it must)
            tokens += computes
            self.computed_tokens += table.start(sequence)
            outputs.extend(self.generator.generate(sequence, budget=1))
        return outputs
