"""TokenGenerator: the simulated model's tokens for one scheduled sequence in one step.

Each token is the script's (`Sequence.scripted_token`), or under a grammar the matcher's
choice; then DeepInfer's stop rules. A finished sequence leaves the request table here. A
matcher failure ends that one request with DeepInfer's structured-output failure.

Speculative decoding (`speculative_tokens` N > 0) as DeepInfer's MTP emits it: a decode step
verifies N drafts per sequence and emits the accepted ones, then the step's own ("golden")
token, each in turn through the stop rules and the grammar, so an EOS, max_tokens or the
length limit inside the drafts ends the sequence there and nothing after it is emitted. The
drafts a model proposes and the target rejects are never tokens here: what a step emits is
what the target would have emitted one step at a time, so speculation changes how many tokens
a step carries, never which. The acceptance is a fixed pattern (`accepted_drafts`). As in
DeepInfer's `build_request_outputs` (csrc/engine/outputs.hpp), the step's last entry carries
`draft_tok` = N + 1 and `accept_tok` = accepted + 1, counted before any stop truncates the
emission; a prompt step has no drafts (1 and 1).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from deepinfer_server.engines.simulated.logprobs import annotate
from deepinfer_server.engines.simulated.outputs import OutputRecord
from deepinfer_server.engines.simulated.request_table import RequestTable
from deepinfer_server.engines.simulated.sequence import FINISH_SO_FAILED, Sequence
from deepinfer_server.grammar import MatcherFailure

logger = logging.getLogger(__name__)


@dataclass
class TokenGenerator:
    """Generates and records tokens; `table` loses each sequence that finishes."""

    table: RequestTable
    eos_id: int
    vocab_size: int
    max_model_len: int
    tokens_per_step: int
    #: What the output records report as `max_num_batched_tokens` (0: not configured).
    max_num_batched_tokens: int
    #: Drafts verified per sequence per decode step (DEEPINFER_USE_NEXTN_DECODE; 0: none).
    speculative_tokens: int = 0

    def generate(self, sequence: Sequence, budget: int | None = None) -> list[OutputRecord]:
        """Generate up to `budget` tokens (a decode step's by default), stopping per token."""
        drafts = accepted = 0
        if budget is not None:
            count = budget
        elif self.speculative_tokens:
            drafts = self.speculative_tokens
            accepted = accepted_drafts(drafts, sequence.verifications)
            sequence.verifications += 1
            count = accepted + 1
        else:
            count = self.tokens_per_step
        records: list[OutputRecord] = []
        for _ in range(count):
            try:
                token = self._next_token(sequence)
            except MatcherFailure as exc:
                # DeepInfer's update_so_status: a matcher failure ends this request only.
                logger.warning("request %s: %s", sequence.request_id, exc)
                records.append(self._end_with_grammar_failure(sequence))
                break
            sequence.output.append(token)
            reason = sequence.stop_reason(token, self.eos_id, self.max_model_len)
            record = OutputRecord(
                request_id=sequence.request_id,
                prompt_len=len(sequence.prompt),
                token_id=token,
                finish_reason=reason,
                finished=bool(reason),
                num_output_tokens=len(sequence.output),
                max_num_batched_tokens=self.max_num_batched_tokens,
            )
            annotate(record, sequence.prompt, sequence.params, self.vocab_size)
            records.append(record)
            if reason:
                sequence.finish_reason = reason
                self.table.finish(sequence)
                break
        # draft_tok/accept_tok are set only on the last entry of a request in a step.
        if drafts:
            records[-1].draft_tok, records[-1].accept_tok = drafts + 1, accepted + 1
        else:
            records[-1].draft_tok = records[-1].accept_tok = len(records)
        return records

    def _end_with_grammar_failure(self, sequence: Sequence) -> OutputRecord:
        sequence.finish_reason = FINISH_SO_FAILED
        self.table.finish(sequence)
        return sequence.ignored_output(FINISH_SO_FAILED)

    def _next_token(self, sequence: Sequence) -> int:
        scripted = sequence.forced_token
        if scripted is None:
            scripted = sequence.scripted_token(self.eos_id)
        else:
            sequence.forced_token = None
        if sequence.matcher is None:
            return scripted
        # The grammar decides: the scripted token when it is allowed, else the matcher's
        # deterministic choice that completes the value within max_tokens. A token the
        # grammar forced is inserted: the script's token is still to be said.
        token = sequence.matcher.choose(scripted)
        if token != scripted:
            sequence.inserted += 1
        return token


def accepted_drafts(drafts: int, verification: int) -> int:
    """Drafts the target accepts at a sequence's `verification`-th decode step (0-based).

    A fixed cycle, so outputs and counters are reproducible: all `drafts`, then one fewer each
    step down to none, then all again. Over a cycle half the drafts are accepted and a step
    emits 1 + drafts / 2 tokens on average; a real model's rate depends on the text.
    """
    return drafts - verification % (drafts + 1)
