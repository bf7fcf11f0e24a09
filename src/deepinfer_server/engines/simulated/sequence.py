"""Sequence: one request inside the simulated engine, and DeepInfer's finish strings.

The scripted answer stands in for the model; the stop rules are DeepInfer 0.1.0's
(`csrc/engine/scheduler.hpp` `_check_stop`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from deepinfer_server.engines.simulated.outputs import OutputRecord
from deepinfer_server.engines.simulated.sampling_params import SamplingParams
from deepinfer_server.grammar import SimulatedMatcher
from deepinfer_server.prefix_cache.index import CacheEntry

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_PROMPT_TOO_LONG = "prompt_length_exceeded"
FINISH_SO_FAILED = "xgrammar runtime errors or timeout"


@dataclass
class Sequence:
    """A request: its prompt, parameters, scripted answer and what it generated so far."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    script: list[int]
    ready_at: float
    output: list[int] = field(default_factory=list)
    finish_reason: str = ""
    matcher: SimulatedMatcher | None = None
    grammar_failed: bool = False
    #: Tokens the grammar put in place of the script's: the script goes on after them where
    #: it was, not shifted by them.
    inserted: int = 0
    #: The prompt as `add_request` got it, for the prefix cache (None: it cannot be cached).
    prompt_ids: npt.NDArray[np.int32] | None = None
    #: Its prefix-cache partition (`AddRequest.cache_salt`): it forks from, and is kept for,
    #: only sequences with the same one.
    cache_salt: bytes | None = None
    #: Prompt tokens reused from a cached sequence, as DeepInfer's Sequence reports them after
    #: `add_request`: what usage shows, even when a preemption recomputes them later.
    num_cached_tokens: int = 0
    #: Seconds it asked the prefix cache to keep its prompt (`AddRequest.retention_seconds`;
    #: 0: none), and the prompt tokens that will be written for it, decided at admission
    #: (`PrefixCache.add`; reported with its first output as DeepInfer's Sequence would).
    retain_seconds: float = 0.0
    num_written_tokens: int = 0
    #: Prompt tokens the next prefill skips: the fork point (0 once a preemption dropped it).
    fork_point: int = 0
    #: The cache entry it was forked from, until it ends.
    fork_of: CacheEntry[Any] | None = None
    #: The host-tier entry its prefill restores its first `fork_point` tokens from, until then
    #: (`prefix_cache.host_tier.HostTier`; None: none).
    restore_of: CacheEntry[Any] | None = None
    #: Its state slot while running, and the snapshot of its state at the prompt's end
    #: (`state_slots.StateSlots`; 0: none).
    state_slot: int = 0
    snapshot_slot: int = 0
    #: The next token, sampled elsewhere: a prefill server's first token (`fork_seq`'s
    #: `sp_token`) that a decode engine's sequence starts with.
    forced_token: int | None = None
    #: Decode steps that verified drafts for it (`token_generator.accepted_drafts`).
    verifications: int = 0

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)

    def scripted_token(self, eos_id: int) -> int:
        """The model's next token: the script, then EOS."""
        position = len(self.output) - self.inserted
        script = self.script
        if self.params.ignore_eos:
            # DeepInfer skips only the EOS check: the model still generates EOS where it
            # would stop, as an ordinary token, and goes on (here: the script again).
            at = position % (len(script) + 1)
            return script[at] if at < len(script) else eos_id
        return script[position] if position < len(script) else eos_id

    def stop_reason(self, token: int, eos_id: int, max_model_len: int) -> str:
        """The finish string after `token` was appended, or "" to go on."""
        params = self.params
        first_token_guard = params.first_n_token_no_eos == 1 and len(self.output) == 1
        if token == eos_id and not params.ignore_eos and not first_token_guard:
            return FINISH_STOP
        if self.length > max_model_len:
            return FINISH_LENGTH
        if len(self.output) == params.max_tokens:
            return FINISH_LENGTH
        return ""

    def ignored_output(self, reason: str) -> OutputRecord:
        """A terminal output of the "ignored" class: it repeats the last token, never a new one."""
        last_token = self.output[-1] if self.output else self.prompt[-1]
        return OutputRecord(
            request_id=self.request_id,
            prompt_len=len(self.prompt),
            token_id=last_token,
            finish_reason=reason,
            finished=True,
            token_logprobs=1.0,
            sum_smaller_probs=-1.0,
            num_output_tokens=len(self.output) + 1,
        )
