"""ResolvedConfig: the one immutable configuration the running server reads.

`resolve()` validates the options as given, copies those that pass through unchanged in one
step, derives the rest (DP/CP from EP, the engine's context length, the served names, API keys
from the environment, ...) and attaches the engine backend's own option group, passed whole to
the rank processes.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, TypedDict

from deepinfer_server.config.checks import check_decode_layout, check_ranges
from deepinfer_server.config.derive import (
    DEFAULT_PREFILL_ANY_ATTEMPT_INTERVAL,
    DEFAULT_PREFILL_ATTEMPT_INTERVAL,
    SPECULATIVE_TOKENS_VARIABLE,
    advertised_host,
    derive_parallelism,
    prefill_interval,
    speculative_tokens,
)
from deepinfer_server.config.options import ServerConfig
from deepinfer_server.config.pd_secret import SECRET_VARIABLE, disaggregation_secret
from deepinfer_server.config.response_store import (
    default_state_dir,
    parse_duration,
    store_url,
)
from deepinfer_server.config.tenants import NamedKey, Tenant, named_keys, tenants_of
from deepinfer_server.disaggregation.handoff.signing import release_key
from deepinfer_server.disaggregation.role import DisaggregationRole
from deepinfer_server.errors import ConfigError

__all__ = [
    "DEFAULT_PREFILL_ANY_ATTEMPT_INTERVAL",
    "DEFAULT_PREFILL_ATTEMPT_INTERVAL",
    "DEFAULT_SERVED_MODEL_NAME",
    "SPECULATIVE_TOKENS_VARIABLE",
    "ResolvedConfig",
    "advertised_host",
    "derive_parallelism",
    "is_derived",
    "resolve",
    "withhold_server_secrets",
]

DEFAULT_SERVED_MODEL_NAME = "deepseek-flash"
MIB = 1024 * 1024


#: Metadata of a ResolvedConfig field `resolve()` computes; any other field is its ServerConfig
#: namesake, copied as given.
DERIVED = {"derived": True}


def is_derived(f: Field[Any]) -> bool:
    """Whether `resolve()` computes this ResolvedConfig field rather than copying it."""
    return bool(f.metadata.get("derived"))


@dataclass(frozen=True)
class ResolvedConfig:
    """Every setting of one server, with nothing left to derive.

    A field without `DERIVED` metadata holds its ServerConfig namesake's value unchanged
    (`resolve()` copies those in one step); no field has a default, so one `resolve()` forgets
    is an error rather than a silent default.
    """

    engine: str
    #: The chosen backend's option group, passed whole to the rank processes.
    engine_options: object = field(metadata=DERIVED)
    model: str | None
    served_model_names: tuple[str, ...] = field(metadata=DERIVED)
    host: str
    port: int
    expert_parallel_size: int = field(metadata=DERIVED)
    data_parallel_size: int = field(metadata=DERIVED)
    context_parallel_size: int = field(metadata=DERIVED)
    max_model_len: int = field(metadata=DERIVED)
    max_num_seqs: int
    max_queued_requests: int
    max_num_batched_tokens: int | None
    prefill_attempt_interval: int = field(metadata=DERIVED)
    prefill_any_attempt_interval: int = field(metadata=DERIVED)
    #: Draft tokens per sequence per decode step (DEEPINFER_USE_NEXTN_DECODE); 0: off.
    speculative_tokens: int = field(metadata=DERIVED)
    enable_prefix_caching: bool = field(metadata=DERIVED)
    prefix_cache_scope: Literal["key", "global"]
    #: The share of a prefix-cache tier one partition's retained prompts may pin.
    prefix_cache_retention_share: float
    #: The prefix cache's host tier per DP rank, in GB (0: none).
    kv_offload_host_gb: float = field(metadata=DERIVED)
    #: The prefix cache's shared store and its master (None: none).
    kv_offload_store: Literal["mooncake"] | None
    kv_offload_store_master: str | None
    step_timeout: float
    request_timeout: float
    startup_timeout: float
    shutdown_timeout: float
    queue_timeout: float
    clamp_max_tokens: bool
    default_thinking: Literal["enabled", "disabled"]
    allowed_origins: tuple[str, ...]
    allowed_methods: tuple[str, ...]
    allowed_headers: tuple[str, ...]
    max_request_bytes: int
    max_images_per_request: int
    max_image_bytes: int
    allowed_media_domains: tuple[str, ...] = field(metadata=DERIVED)
    media_fetch_timeout: float
    body_read_timeout: float
    header_timeout: float
    write_timeout: float
    sse_keepalive_seconds: float
    max_queued_compiles_per_key: int
    grammar_queue_timeout: float
    grammar_warmup: bool
    max_connections: int
    max_header_bytes: int
    max_header_line_bytes: int
    max_receive_buffer_mb: int
    access_log: bool = field(metadata=DERIVED)
    log_requests: bool
    log_level: str
    #: Every accepted key: `--api-key`'s (or $DEEPINFER_API_KEY) and `--api-key-file`'s.
    api_keys: tuple[str, ...] = field(metadata=DERIVED, repr=False)
    api_key_file: str | None
    #: Each of `api_keys` with its tenant (`config.tenants`).
    named_keys: tuple[NamedKey, ...] = field(metadata=DERIVED, repr=False)
    #: The tenants admission shares the running slots between, in a fixed order.
    tenants: tuple[Tenant, ...] = field(metadata=DERIVED)
    key_running_share: float
    key_queued_share: float
    reasoning_secret: str | None = field(metadata=DERIVED, repr=False)
    get_load_format: Literal["vllm", "sglang"]
    api_server_count: int
    stream_interval: int
    disaggregation_mode: DisaggregationRole
    disaggregation_transfer_backend: Literal["mooncake"]
    disaggregation_bootstrap_port: int
    disaggregation_ib_device: str | None
    disaggregation_transport: Literal["auto", "tcp", "rdma", "nvlink"]
    #: The address peers reach this server's transfer engine at (`advertised_host`).
    disaggregation_host: str = field(metadata=DERIVED)
    disaggregation_kv_hold_timeout: float
    disaggregation_transfer_timeout: float
    disaggregation_secret_file: str | None
    #: The secret the prefill/decode pair signs handoffs with (`config.pd_secret`).
    disaggregation_secret: bytes | None = field(metadata=DERIVED, repr=False)
    state_dir: str = field(metadata=DERIVED)
    #: The Responses store (`store.location.store_url`), None when disabled.
    response_store: str | None = field(metadata=DERIVED, repr=False)
    response_store_ttl: float = field(metadata=DERIVED)
    response_store_max_bytes: int = field(metadata=DERIVED)
    #: One API key's cap, at most the store's.
    response_store_key_max_bytes: int = field(metadata=DERIVED)
    #: The largest response stored, at most a key's cap.
    response_store_max_response_bytes: int = field(metadata=DERIVED)

    batch_max_file_mb: int
    batch_max_lines: int
    batch_max_active: int
    files_key_max_count: int
    batch_concurrency: int

    @property
    def disaggregation_release_key(self) -> bytes | None:
        """The key prefill ranks check release proofs with (derived from the pair's secret,
        which stays in the HTTP processes)."""
        secret = self.disaggregation_secret
        return None if secret is None else release_key(secret)

    @property
    def response_store_scope_max_bytes(self) -> int:
        """One scope's cap: an API key's, or without API keys (one scope) the store's."""
        return self.response_store_key_max_bytes if self.api_keys else self.response_store_max_bytes

    @property
    def admission_running_limit(self) -> int | None:
        """Requests a DP rank runs before admission queues the rest in the server; None: every
        admitted request goes to its rank at once. On a decode server a request carries KV that
        its prefill server holds only for --disaggregation-kv-hold-timeout, so it must reach
        its rank at once: the engine then waits, in order, for KV room and a state slot within
        --disaggregation-transfer-timeout (and releases the prefill side's KV on every exit)."""
        return None if self.disaggregation_mode is DisaggregationRole.DECODE else self.max_num_seqs

    @property
    def admission_running_share(self) -> float:
        """The share of the running slots one API key may hold while others wait (1: no limit
        on a decode server, whose requests never wait in the server's queue)."""
        return (
            1.0 if self.disaggregation_mode is DisaggregationRole.DECODE else self.key_running_share
        )

    @property
    def admission_queued_share(self) -> float:
        """The share of the server's queue one API key's waiting requests may hold (1 on a
        decode server, which queues nothing)."""
        return (
            1.0 if self.disaggregation_mode is DisaggregationRole.DECODE else self.key_queued_share
        )

    @property
    def served_model_name(self) -> str:
        """The name responses and /v1/models report first."""
        return self.served_model_names[0]

    @property
    def running_capacity(self) -> int:
        """Requests the engines run at once: every rank's `--max-num-seqs`."""
        return self.data_parallel_size * self.max_num_seqs

    @property
    def admission_capacity(self) -> int:
        """Requests admitted at once: running capacity of every rank plus the queue allowance."""
        return self.data_parallel_size * self.max_num_seqs + self.max_queued_requests


@dataclass(frozen=True)
class EngineDefaults:
    """What an engine backend decides where the command line is silent."""

    #: Whether MODEL must be given.
    model_required: bool = True
    #: --max-model-len when not given.
    max_model_len: int = 32768
    #: --enable-prefix-caching when neither it nor --no-enable-prefix-caching is given.
    prefix_caching: bool = False
    #: --kv-offload-host-gb when not given and the prefix cache is on.
    kv_offload_host_gb: float = 0.0


def resolve(
    config: ServerConfig, engine_options: object, defaults: EngineDefaults
) -> ResolvedConfig:
    """Validate the options as given and fill every derived default.

    `engine_options` is the chosen backend's option group (already validated by the backend),
    `defaults` what that backend decides where the options are silent.
    """
    if config.model is None and defaults.model_required:
        raise ConfigError(f"MODEL is required with --engine {config.engine}")
    ep, dp, cp = derive_parallelism(
        config.expert_parallel_size, config.data_parallel_size, config.context_parallel_size
    )
    max_model_len = config.max_model_len or defaults.max_model_len
    check_decode_layout(config, cp)
    check_ranges(config, max_model_len)
    served = _served_model_names(config)
    keys = named_keys(_api_keys(config), config.api_key_file)
    prefill_attempt, prefill_any_attempt = _prefill_intervals(config)
    caching = (
        defaults.prefix_caching
        if config.enable_prefix_caching is None
        else config.enable_prefix_caching
    )
    return ResolvedConfig(
        **_as_given(config),
        engine_options=engine_options,
        served_model_names=served,
        expert_parallel_size=ep,
        data_parallel_size=dp,
        context_parallel_size=cp,
        max_model_len=max_model_len,
        prefill_attempt_interval=prefill_attempt,
        prefill_any_attempt_interval=prefill_any_attempt,
        speculative_tokens=speculative_tokens(config.speculative_tokens),
        enable_prefix_caching=caching,
        kv_offload_host_gb=_host_tier_gb(config, caching, defaults.kv_offload_host_gb),
        allowed_media_domains=tuple(d.lower() for d in config.allowed_media_domains),
        disaggregation_host=advertised_host(config.disaggregation_host, config.host),
        access_log=not config.disable_access_log,
        api_keys=tuple(entry.key for entry in keys),
        named_keys=keys,
        tenants=tenants_of(keys),
        reasoning_secret=config.reasoning_secret or os.environ.get("DEEPINFER_REASONING_SECRET"),
        disaggregation_secret=disaggregation_secret(config),
        **_store_settings(config),
    )


def _host_tier_gb(config: ServerConfig, caching: bool, default: float) -> float:
    """`--kv-offload-host-gb` as given, else the engine's default while the cache is on."""
    if config.kv_offload_host_gb is None:
        return default if caching else 0.0
    if config.kv_offload_host_gb < 0:
        raise ConfigError(
            f"--kv-offload-host-gb must not be negative, got {config.kv_offload_host_gb:g}"
        )
    return float(config.kv_offload_host_gb)


def _served_model_names(config: ServerConfig) -> tuple[str, ...]:
    served = config.served_model_name or (config.model or DEFAULT_SERVED_MODEL_NAME,)
    if any(not name for name in served):
        raise ConfigError("--served-model-name must not be empty")
    return tuple(dict.fromkeys(served))


def _api_keys(config: ServerConfig) -> tuple[str, ...]:
    api_keys = config.api_key or (
        (os.environ["DEEPINFER_API_KEY"],) if os.environ.get("DEEPINFER_API_KEY") else ()
    )
    if any(not key for key in api_keys):
        raise ConfigError("--api-key must not be empty")
    return api_keys


def _prefill_intervals(config: ServerConfig) -> tuple[int, int]:
    return (
        prefill_interval(
            "--prefill-attempt-interval",
            config.prefill_attempt_interval,
            "DEEPINFER_PREFILL_ATTEMPT_INTERVAL",
            DEFAULT_PREFILL_ATTEMPT_INTERVAL,
        ),
        prefill_interval(
            "--prefill-any-attempt-interval",
            config.prefill_any_attempt_interval,
            "DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL",
            DEFAULT_PREFILL_ANY_ATTEMPT_INTERVAL,
        ),
    )


class _StoreSettings(TypedDict):
    """The derived fields of the Responses store."""

    state_dir: str
    response_store: str | None
    response_store_ttl: float
    response_store_max_bytes: int
    response_store_key_max_bytes: int
    response_store_max_response_bytes: int


def _store_settings(config: ServerConfig) -> _StoreSettings:
    key_cap = min(config.response_store_key_max_mb, config.response_store_max_mb) * MIB
    state_dir = (
        Path(config.state_dir).expanduser().absolute() if config.state_dir else default_state_dir()
    )
    return _StoreSettings(
        state_dir=str(state_dir),
        response_store=store_url(config.response_store, state_dir),
        response_store_ttl=parse_duration("--response-store-ttl", config.response_store_ttl),
        response_store_max_bytes=config.response_store_max_mb * MIB,
        response_store_key_max_bytes=key_cap,
        response_store_max_response_bytes=min(config.response_store_max_response_mb * MIB, key_cap),
    )


def _as_given(config: ServerConfig) -> dict[str, Any]:
    """The ResolvedConfig fields that are not DERIVED: their ServerConfig namesakes, as given."""
    return {f.name: getattr(config, f.name) for f in fields(ResolvedConfig) if not is_derived(f)}


#: Settings only the HTTP processes read: once resolved they leave the environment, so that no
#: rank process, DeepInfer worker or other child inherits them.
SERVER_ONLY_VARIABLES = ("DEEPINFER_API_KEY", "DEEPINFER_REASONING_SECRET", SECRET_VARIABLE)


def withhold_server_secrets(environ: MutableMapping[str, str] | None = None) -> None:
    """Remove the server's own secrets from the environment children inherit."""
    env = os.environ if environ is None else environ
    for variable in SERVER_ONLY_VARIABLES:
        env.pop(variable, None)
