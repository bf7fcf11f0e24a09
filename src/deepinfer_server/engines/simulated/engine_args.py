"""SimEngineArgs: the simulated engine's construction arguments (the subset of DeepInfer's
EngineArgs it uses, and the cost model's)."""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer_server.disaggregation.role import DisaggregationRole
from deepinfer_server.engines.role_settings import RoleSettings
from deepinfer_server.engines.simulated.collectives import LockstepGroup
from deepinfer_server.engines.simulated.kv_size import KVSize
from deepinfer_server.engines.simulated.scheduler import (
    DEFAULT_PREFILL_ANY_ATTEMPT_INTERVAL,
    DEFAULT_PREFILL_ATTEMPT_INTERVAL,
)
from deepinfer_server.prefix_cache.host_tier import HostTierSettings
from deepinfer_server.prefix_cache.retention import KEY_BUDGET_SHARE
from deepinfer_server.prefix_cache.store_tier import StoreTier


@dataclass
class SimEngineArgs:
    """Construction arguments of the simulated engine (the subset of EngineArgs it uses)."""

    tokenizer_json: str
    lockstep: LockstepGroup
    engine_rank: int = 0
    data_parallel_size: int = 1
    max_model_len: int = 32768
    max_num_seqs: int = 16
    max_num_batched_tokens: int | None = None
    ttft_ms: float = 20.0
    itl_ms: float = 10.0
    itl_ms_per_request: float = 0.0  # a decode step's added length per sequence (`step_clock`)
    tokens_per_step: int = 1
    speculative_tokens: int = 0  # MTP drafts verified per sequence per decode step (0: none)
    zero_overhead_scheduling: bool = True
    close_timeout: float = 10.0
    prefill_attempt_interval: int = DEFAULT_PREFILL_ATTEMPT_INTERVAL
    prefill_any_attempt_interval: int = DEFAULT_PREFILL_ANY_ATTEMPT_INTERVAL
    fault: str | None = None
    fault_after_steps: int = 0
    kv_blocks: int | None = None
    enable_prefix_caching: bool = False  # keep finished prompts' KV and state, fork from them
    #: Prompt tokens a prompt step computes per second; 0: a prompt step lasts one period.
    prefill_tokens_per_s: float = 0.0
    prefix_cache_retention_share: float = KEY_BUDGET_SHARE  # one partition's pins, of a tier
    host_tier: HostTierSettings | None = None  # the prefix cache's (`host_tier`; None: none)
    store_tier: StoreTier | None = None  # the host tier's shared store (`store_tier`)
    #: NULL (NORMAL), PREFILL (PROMPT) or DECODE (COMPLETION): `disaggregation.py`.
    disaggregation_mode: DisaggregationRole = DisaggregationRole.NULL
    #: What a PREFILL or DECODE engine's transfer reads (needed with either).
    role: RoleSettings | None = None
    #: A KV block's and a state slot's bytes, as a role's transfers move them (None: 8 a token).
    kv_size: KVSize | None = None
