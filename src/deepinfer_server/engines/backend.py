"""The server-owned engine interface: what a backend declares and what the rank loop drives.

An engine backend is one `EngineBackend` subclass registered in `engines.registry`. The API
process reads only its declarations (options, required checkpoint files, rank environments,
preflight checks, shared state); the engine itself is imported and built only inside a rank
process, from the dotted path in `builder`, and driven through `EngineCore`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol

from deepinfer_server.config.resolved import (
    DEFAULT_PREFILL_ANY_ATTEMPT_INTERVAL,
    DEFAULT_PREFILL_ATTEMPT_INTERVAL,
    EngineDefaults,
)
from deepinfer_server.disaggregation.layout import KVLayout
from deepinfer_server.disaggregation.role import DisaggregationRole
from deepinfer_server.errors import ConfigError
from deepinfer_server.model.images import ImagePolicy, recipe_image_policy

if TYPE_CHECKING:
    from deepinfer_server.config import ResolvedConfig
    from deepinfer_server.ipc.messages import (
        AddRequest,
        EngineCounters,
        PrefixCacheStats,
        RequestDelta,
        RequestRejected,
    )


class EngineCore(Protocol):
    """One engine on one DP rank, driven by the rank loop from a single thread."""

    def add(self, request: AddRequest) -> RequestRejected | None:
        """Start a request; a request the engine refuses comes back as a rejection."""

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests; nothing more is reported for them."""

    def iterate(self) -> tuple[bool, list[RequestDelta]]:
        """One lockstep iteration: (whether any DP rank had work, this rank's new outputs)."""

    def kv_cache_usage(self) -> float | None:
        """The share (0-1) of the KV cache in use now, or None when the engine cannot tell."""

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The prefix cache's counters now, or None when the engine has no prefix cache."""

    def counters(self) -> EngineCounters | None:
        """The disaggregation counters, or None when they did not change since the last call."""

    def close(self) -> None:
        """Release the engine (collective across the DP ranks where the engine says so)."""


class SharedState(Protocol):
    """Cross-process state a backend creates before the ranks are spawned (picklable)."""

    def abort(self) -> None:
        """Break anything peers may be blocked in: a rank has failed."""


#: Metadata of an EngineSpec field each rank's spec is given; any other field is engine-wide, its
#: ResolvedConfig namesake's value.
OF_THE_RANK = {"of_the_rank": True}


@dataclass(frozen=True)
class EngineSpec:
    """What one rank's engine is built from (picklable for the spawn start method).

    Built by `for_rank()`: an engine-wide setting is one field here named as in ResolvedConfig,
    and nothing else. Server-only settings (API keys, the reasoning secret, the Responses
    store) have no field, so they never reach a rank.
    """

    rank: int = field(metadata=OF_THE_RANK)
    #: The local checkpoint directory (`model.source.resolve_model`), not MODEL as given.
    model: str | None = field(metadata=OF_THE_RANK)
    served_model_name: str
    data_parallel_size: int
    context_parallel_size: int
    expert_parallel_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int | None
    #: The backend's option group (`EngineBackend.options_type`).
    engine_options: object
    environment: dict[str, str] = field(default_factory=dict, metadata=OF_THE_RANK)
    #: DeepInfer's prefill attempt points (DEEPINFER_PREFILL_ATTEMPT_INTERVAL and
    #: DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL): prompts are scheduled only every so many steps.
    prefill_attempt_interval: int = DEFAULT_PREFILL_ATTEMPT_INTERVAL
    prefill_any_attempt_interval: int = DEFAULT_PREFILL_ANY_ATTEMPT_INTERVAL
    #: `--speculative-tokens`: MTP draft tokens per sequence per decode step (0: off).
    speculative_tokens: int = 0
    #: `--enable-prefix-caching`: reuse the KV cache and state of earlier requests' prompts.
    enable_prefix_caching: bool = False
    #: `--prefix-cache-retention-share`: the share of a tier one partition may pin.
    prefix_cache_retention_share: float = 0.25
    #: `--kv-offload-host-gb`: the prefix cache's host tier, in GB (0: none).
    kv_offload_host_gb: float = 0.0
    #: `--kv-offload-store` and `--kv-offload-store-master`: the shared store tier (None: none).
    kv_offload_store: Literal["mooncake"] | None = None
    kv_offload_store_master: str | None = None
    #: Prepare the grammar compiler once the rank is ready (`BuiltEngine.after_ready`).
    grammar_warmup: bool = True

    #: `--disaggregation-*`: the engine's role (NULL: NORMAL, PREFILL: PROMPT, DECODE:
    #: COMPLETION) and what the KV transfer needs.
    disaggregation_mode: DisaggregationRole = DisaggregationRole.NULL
    disaggregation_bootstrap_port: int = 8998
    disaggregation_ib_device: str | None = None
    disaggregation_transport: Literal["auto", "tcp", "rdma", "nvlink"] = "auto"
    disaggregation_host: str = "127.0.0.1"
    disaggregation_kv_hold_timeout: float = 60.0
    disaggregation_transfer_timeout: float = 30.0
    #: The key a prefill rank checks release proofs with (`handoff.signing.release_key`).
    disaggregation_release_key: bytes | None = field(default=None, repr=False)

    @classmethod
    def for_rank(
        cls,
        config: ResolvedConfig,
        rank: int,
        checkpoint: str | None,
        environment: dict[str, str],
    ) -> EngineSpec:
        """The spec of DP rank `rank`: its own values, and every engine-wide field from `config`."""
        engine_wide = {
            f.name: getattr(config, f.name)
            for f in fields(cls)
            if not f.metadata.get("of_the_rank")
        }
        return cls(rank=rank, model=checkpoint, environment=environment, **engine_wide)


@dataclass
class BuiltEngine:
    """A constructed engine and the child processes it started (watched for deaths)."""

    core: EngineCore
    children: list[BaseProcess] = field(default_factory=list)
    #: Called once the rank reported ready: work the engine does ahead of its first use that
    #: must not slow the server's start (a simulated rank's grammar compiler), given what to
    #: call (from any thread) once its grammar builder is warm. Without it, the grammar builder
    #: is warm once the engine is built (DeepInfer builds its own with the engine).
    after_ready: Callable[[Callable[[], None]], None] | None = None
    #: A prefill rank's bound disaggregation bootstrap port, reported with its readiness.
    bootstrap_port: int | None = None
    #: A prefill or decode rank's KV layout, reported with its readiness (the decode side's API
    #: process compares it with its prefill peers').
    layout: KVLayout | None = None


class EngineBackend(abc.ABC):
    """Declarations of one engine kind; subclasses set the class attributes."""

    #: The `--engine` value.
    name: ClassVar[str]
    #: One line for `--help`.
    summary: ClassVar[str]
    #: The option group of this engine: a frozen dataclass whose fields use `config.option`.
    options_type: ClassVar[type]
    #: "module:function" building the engine in a rank: `(EngineSpec, SharedState | None)` ->
    #: BuiltEngine. Imported only inside rank processes.
    builder: ClassVar[str]
    #: Files a checkpoint directory must hold for this engine.
    required_files: ClassVar[tuple[str, ...]]
    #: Hub download patterns (None: the whole repository).
    download_patterns: ClassVar[list[str] | None] = None
    #: What this engine decides where the command line is silent.
    defaults: ClassVar[EngineDefaults] = EngineDefaults()

    def validate_options(self, options: object, data_parallel_size: int) -> None:
        """Raise ConfigError for option values this engine cannot use."""
        del options, data_parallel_size

    def check_installed(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Raise ConfigError when the engine's package is missing (before any download)."""

    def preflight(self, config: ResolvedConfig, checkpoint: str | None) -> None:
        """Raise ConfigError, before any rank starts, for settings the engine would reject."""
        del config, checkpoint

    def rank_environments(
        self, config: ResolvedConfig, master_port: int
    ) -> Sequence[dict[str, str]]:
        """The environment of each rank process, applied before the engine is imported."""
        plain = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port)}
        return [dict(plain) for _ in range(config.data_parallel_size)]

    def image_policy(self, checkpoint: str | None, tokenizer_json: str) -> ImagePolicy:
        """The image placeholder this engine expands and how it counts image tokens."""
        del checkpoint
        return recipe_image_policy(tokenizer_json)

    def prompt_logprobs_unavailable(self) -> str | None:
        """Why this engine, as configured, computes no prompt logprobs (None: it does)."""
        return None

    def shared_state(self, config: ResolvedConfig) -> SharedState | None:
        """Cross-process state the ranks share (created in the API process), if any."""
        del config
        return None


def check_store_tier(config: ResolvedConfig) -> None:
    """The shared store tier (`--kv-offload-store`) needs its master and the host tier it
    restores through, on every engine."""
    if config.kv_offload_store is None:
        if config.kv_offload_store_master is not None:
            raise ConfigError("--kv-offload-store-master needs --kv-offload-store")
        return
    if not config.kv_offload_store_master:
        raise ConfigError(
            "--kv-offload-store needs --kv-offload-store-master HOST:PORT (its master's)"
        )
    if config.kv_offload_host_gb <= 0:
        raise ConfigError(
            "--kv-offload-store restores through the host tier: it needs --kv-offload-host-gb "
            "above 0 (and the prefix cache on)"
        )
