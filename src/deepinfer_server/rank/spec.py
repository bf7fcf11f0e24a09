"""RankSpec: everything a rank process needs, built by the API process (no engine imports)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RankSpec:
    """The construction parameters of DP rank `rank`, picklable for the spawn start method."""

    rank: int
    engine: str
    model: str | None
    served_model_name: str
    data_parallel_size: int
    context_parallel_size: int
    expert_parallel_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int | None
    gpu_memory_utilization: float
    trust_remote_code: bool
    disable_log_stats: bool
    inbox_address: str
    outbox_address: str
    log_level: str = "info"
    idle_wait_seconds: float = 0.05
    environment: dict[str, str] = field(default_factory=dict)
    sim_ttft_ms: float = 20.0
    sim_itl_ms: float = 10.0
    sim_tokens_per_step: int = 1
    sim_zero_overhead_scheduling: bool = True
    sim_fault: str | None = None
    sim_fault_after_steps: int = 0
