"""ResolvedConfig: the one immutable configuration the running server reads.

`resolve()` validates the options as given, copies those that pass through unchanged in one
step, derives the rest (DP/CP from EP, the engine's context length, the served names, API keys
from the environment, ...) and attaches the engine backend's own option group, passed whole to
the rank processes.
"""

from __future__ import annotations

import os
import socket
from collections.abc import MutableMapping
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from deepinfer_server.config.media_origins import parse_origin
from deepinfer_server.config.options import ServerConfig
from deepinfer_server.config.response_store import (
    default_state_dir,
    parse_duration,
    store_url,
)
from deepinfer_server.config.tenants import NamedKey, Tenant, named_keys, tenants_of
from deepinfer_server.disaggregation.role import DisaggregationRole
from deepinfer_server.errors import ConfigError

DEFAULT_SERVED_MODEL_NAME = "deepseek-flash"
#: DeepInfer 0.1.0's prefill attempt intervals (deepinfer/environ.py:174,177).
DEFAULT_PREFILL_ATTEMPT_INTERVAL = 70
DEFAULT_PREFILL_ANY_ATTEMPT_INTERVAL = 100
#: DeepInfer's MTP draft length, read by its Python (environ.py:129) and its C++ (utils.hpp).
SPECULATIVE_TOKENS_VARIABLE = "DEEPINFER_USE_NEXTN_DECODE"
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
    reasoning_secret: str | None = field(metadata=DERIVED, repr=False)
    get_load_format: Literal["vllm", "sglang"]
    api_server_count: int
    stream_interval: int
    disaggregation_mode: DisaggregationRole
    disaggregation_transfer_backend: Literal["mooncake"]
    disaggregation_bootstrap_port: int
    disaggregation_ib_device: str | None
    #: The address peers reach this server's transfer engine at (`advertised_host`).
    disaggregation_host: str = field(metadata=DERIVED)
    disaggregation_kv_hold_timeout: float
    disaggregation_transfer_timeout: float
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
    batch_concurrency: int

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


def derive_parallelism(ep: int | None, dp: int | None, cp: int | None) -> tuple[int, int, int]:
    """Return (EP, DP, CP) with DP * CP == EP, or raise ConfigError with a one-line reason.

    Without --ep, EP is DP * CP (each defaulting to 1), so `--dp 2` alone means two ranks of
    one GPU each; with --ep, the missing one of DP and CP is derived from it.
    """
    for name, value in (("--ep", ep), ("--dp", dp), ("--cp", cp)):
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be at least 1, got {value}")
    if ep is None:
        dp, cp = dp or 1, cp or 1
        return dp * cp, dp, cp
    return (ep, *_split(ep, dp, cp))


def _split(ep: int, dp: int | None, cp: int | None) -> tuple[int, int]:
    if dp is None and cp is None:
        return 1, ep
    if dp is None:
        assert cp is not None
        if ep % cp:
            raise ConfigError(f"--cp {cp} does not divide --ep {ep}: DP*CP must equal EP")
        return ep // cp, cp
    if cp is None:
        if ep % dp:
            raise ConfigError(
                f"--dp {dp} does not divide --ep {ep}: DP*CP must equal EP "
                f"(for {dp} ranks of one GPU each, pass --dp {dp} without --ep, or --ep {dp})"
            )
        return dp, ep // dp
    if dp * cp != ep:
        raise ConfigError(f"--dp {dp} times --cp {cp} is {dp * cp}, not --ep {ep}")
    return dp, cp


def _interval(flag: str, given: int | None, variable: str, default: int) -> int:
    """A prefill interval: the flag, else the exported DeepInfer variable, else its default."""
    if given is None:
        raw = os.environ.get(variable, "").strip()
        if not raw:
            return default
        try:
            given = int(raw)
        except ValueError:
            raise ConfigError(f"{variable}={raw!r} is not an integer") from None
        flag = variable
    if given < 1:
        raise ConfigError(f"{flag} must be at least 1, got {given}")
    return given


def _speculative_tokens(given: int | None) -> int:
    """Draft tokens per step: the flag, else the exported DEEPINFER_USE_NEXTN_DECODE, else 0
    (DeepInfer's own default is 5; this server ships speculation off)."""
    flag = "--speculative-tokens"
    if given is None:
        raw = os.environ.get(SPECULATIVE_TOKENS_VARIABLE, "").strip()
        if not raw:
            return 0
        try:
            given = int(raw)
        except ValueError:
            raise ConfigError(f"{SPECULATIVE_TOKENS_VARIABLE}={raw!r} is not an integer") from None
        flag = SPECULATIVE_TOKENS_VARIABLE
    if given < 0:
        raise ConfigError(f"{flag} must not be negative (0 turns speculation off), got {given}")
    return given


def _check_ranges(config: ServerConfig, max_model_len: int) -> None:
    positive = {
        "--max-model-len": max_model_len,
        "--max-num-seqs": config.max_num_seqs,
        "--stream-interval": config.stream_interval,
        "--max-queued-compiles-per-key": config.max_queued_compiles_per_key,
    }
    for flag, value in positive.items():
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    non_negative: dict[str, float] = {
        "--max-queued-requests": config.max_queued_requests,
        "--request-timeout": config.request_timeout,
        "--queue-timeout": config.queue_timeout,
        "--step-timeout": config.step_timeout,
        "--startup-timeout": config.startup_timeout,
        "--shutdown-timeout": config.shutdown_timeout,
    }
    for flag, amount in non_negative.items():
        if amount < 0:
            raise ConfigError(f"{flag} must not be negative, got {amount}")
    if not 0 <= config.port < 65536:
        raise ConfigError(
            f"--port must be in 0..65535 (0: one the system picks), got {config.port}"
        )
    if config.media_fetch_timeout <= 0:
        raise ConfigError("--media-fetch-timeout must be positive")
    for entry in config.allowed_media_domains:
        try:
            parse_origin(entry)
        except ValueError as exc:
            raise ConfigError(f"--allowed-media-domains: {exc}") from exc
    if config.max_images_per_request < 0 or config.max_image_bytes < 1:
        raise ConfigError("--max-images-per-request must be >= 0 and --max-image-bytes >= 1")
    if config.max_request_bytes < 1024:
        raise ConfigError("--max-request-bytes must be at least 1024")
    positive_seconds = {
        "--body-read-timeout": config.body_read_timeout,
        "--header-timeout": config.header_timeout,
        "--write-timeout": config.write_timeout,
        "--grammar-queue-timeout": config.grammar_queue_timeout,
    }
    for flag, seconds in positive_seconds.items():
        if seconds <= 0:
            raise ConfigError(f"{flag} must be positive")
    if not 0 < config.key_running_share <= 1:
        raise ConfigError(f"--key-running-share must be in (0, 1], got {config.key_running_share}")
    if config.api_server_count < 1:
        raise ConfigError(f"--api-server-count must be at least 1, got {config.api_server_count}")
    if config.max_connections < 1:
        raise ConfigError(f"--max-connections must be at least 1, got {config.max_connections}")
    if not 0 < config.disaggregation_bootstrap_port < 65536:
        raise ConfigError(
            "--disaggregation-bootstrap-port must be in 1..65535, got "
            f"{config.disaggregation_bootstrap_port}"
        )
    for flag, seconds in (
        ("--disaggregation-kv-hold-timeout", config.disaggregation_kv_hold_timeout),
        ("--disaggregation-transfer-timeout", config.disaggregation_transfer_timeout),
    ):
        if seconds <= 0:
            raise ConfigError(f"{flag} must be positive")
    if (
        config.max_header_line_bytes < 1024
        or config.max_header_bytes < config.max_header_line_bytes
    ):
        raise ConfigError(
            "--max-header-line-bytes must be at least 1024 and --max-header-bytes at least as "
            f"large (got {config.max_header_line_bytes} and {config.max_header_bytes})"
        )
    if config.max_receive_buffer_mb < 1:
        raise ConfigError(
            f"--max-receive-buffer-mb must be at least 1, got {config.max_receive_buffer_mb}"
        )
    store_caps = {
        "--response-store-max-mb": config.response_store_max_mb,
        "--response-store-key-max-mb": config.response_store_key_max_mb,
        "--response-store-max-response-mb": config.response_store_max_response_mb,
        "--batch-max-file-mb": config.batch_max_file_mb,
        "--batch-max-lines": config.batch_max_lines,
        "--batch-max-active": config.batch_max_active,
        "--batch-concurrency": config.batch_concurrency,
    }
    for flag, mib in store_caps.items():
        if mib < 1:
            raise ConfigError(f"{flag} must be at least 1, got {mib}")


def resolve(
    config: ServerConfig,
    engine_options: object,
    *,
    model_required: bool,
    default_max_model_len: int,
    default_prefix_caching: bool = False,
) -> ResolvedConfig:
    """Validate the options as given and fill every derived default.

    `engine_options` is the chosen backend's option group (already validated by the backend);
    `model_required`, `default_max_model_len` and `default_prefix_caching` are that backend's.
    """
    if config.model is None and model_required:
        raise ConfigError(f"MODEL is required with --engine {config.engine}")
    ep, dp, cp = derive_parallelism(
        config.expert_parallel_size, config.data_parallel_size, config.context_parallel_size
    )
    max_model_len = config.max_model_len or default_max_model_len
    if config.disaggregation_mode is DisaggregationRole.DECODE and cp > 1:
        # DeepInfer asserts it: a COMPLETION engine has no context-parallel prefill to split.
        raise ConfigError(
            "--disaggregation-mode decode needs --cp 1 (DeepInfer's COMPLETION engine)"
        )
    _check_ranges(config, max_model_len)
    served = config.served_model_name or (config.model or DEFAULT_SERVED_MODEL_NAME,)
    if any(not name for name in served):
        raise ConfigError("--served-model-name must not be empty")
    api_keys = config.api_key or (
        (os.environ["DEEPINFER_API_KEY"],) if os.environ.get("DEEPINFER_API_KEY") else ()
    )
    if any(not key for key in api_keys):
        raise ConfigError("--api-key must not be empty")
    key_cap = min(config.response_store_key_max_mb, config.response_store_max_mb) * MIB
    keys = named_keys(api_keys, config.api_key_file)
    state_dir = (
        Path(config.state_dir).expanduser().absolute() if config.state_dir else default_state_dir()
    )
    return ResolvedConfig(
        **_as_given(config),
        engine_options=engine_options,
        served_model_names=tuple(dict.fromkeys(served)),
        expert_parallel_size=ep,
        data_parallel_size=dp,
        context_parallel_size=cp,
        max_model_len=max_model_len,
        prefill_attempt_interval=_interval(
            "--prefill-attempt-interval",
            config.prefill_attempt_interval,
            "DEEPINFER_PREFILL_ATTEMPT_INTERVAL",
            DEFAULT_PREFILL_ATTEMPT_INTERVAL,
        ),
        prefill_any_attempt_interval=_interval(
            "--prefill-any-attempt-interval",
            config.prefill_any_attempt_interval,
            "DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL",
            DEFAULT_PREFILL_ANY_ATTEMPT_INTERVAL,
        ),
        speculative_tokens=_speculative_tokens(config.speculative_tokens),
        enable_prefix_caching=(
            default_prefix_caching
            if config.enable_prefix_caching is None
            else config.enable_prefix_caching
        ),
        allowed_media_domains=tuple(d.lower() for d in config.allowed_media_domains),
        disaggregation_host=advertised_host(config.disaggregation_host, config.host),
        access_log=not config.disable_access_log,
        api_keys=tuple(entry.key for entry in keys),
        named_keys=keys,
        tenants=tenants_of(keys),
        reasoning_secret=config.reasoning_secret or os.environ.get("DEEPINFER_REASONING_SECRET"),
        state_dir=str(state_dir),
        response_store=store_url(config.response_store, state_dir),
        response_store_ttl=parse_duration("--response-store-ttl", config.response_store_ttl),
        response_store_max_bytes=config.response_store_max_mb * MIB,
        response_store_key_max_bytes=key_cap,
        response_store_max_response_bytes=min(config.response_store_max_response_mb * MIB, key_cap),
    )


def advertised_host(given: str | None, listen_host: str) -> str:
    """The address a prefill server gives decode servers: `given`, else the listen address,
    else (a wildcard) this machine's own address."""
    if given:
        return given
    if listen_host not in ("0.0.0.0", "::", ""):
        return listen_host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _as_given(config: ServerConfig) -> dict[str, Any]:
    """The ResolvedConfig fields that are not DERIVED: their ServerConfig namesakes, as given."""
    return {f.name: getattr(config, f.name) for f in fields(ResolvedConfig) if not is_derived(f)}


#: Settings only the HTTP processes read: once resolved they leave the environment, so that no
#: rank process, DeepInfer worker or other child inherits them.
SERVER_ONLY_VARIABLES = ("DEEPINFER_API_KEY", "DEEPINFER_REASONING_SECRET")


def withhold_server_secrets(environ: MutableMapping[str, str] | None = None) -> None:
    """Remove the server's own secrets from the environment children inherit."""
    env = os.environ if environ is None else environ
    for variable in SERVER_ONLY_VARIABLES:
        env.pop(variable, None)
