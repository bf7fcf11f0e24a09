"""ServerConfig: every command-line option, defined once, and the DP/CP/EP derivation.

Each field carries its flags and help text in `metadata`; `cli.build_parser()` generates the
argument parser from these fields, so an option is never spelled out twice.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from deepinfer_server.errors import ConfigError

EngineKind = Literal["deepinfer", "simulated"]

SIMULATED_DEFAULT_MODEL_NAME = "deepseek-flash"
SIMULATED_DEFAULT_MAX_MODEL_LEN = 32768


def _opt(default: Any, *flags: str, help: str, secret: bool = False, **argparse_kwargs: Any) -> Any:
    """A dataclass field that is also a command-line option (a secret one stays out of repr)."""
    metadata = {"flags": flags, "help": help, "argparse": argparse_kwargs}
    return field(default=default, metadata=metadata, repr=not secret)


@dataclass(frozen=True)
class ServerConfig:
    """The whole server configuration, as parsed and then resolved by `resolve()`."""

    model: str | None = _opt(
        None,
        "model",
        help="checkpoint directory or Hugging Face repository id (optional with "
        "--engine simulated)",
        nargs="?",
    )
    engine: EngineKind = _opt(
        "deepinfer",
        "--engine",
        help="inference engine: DeepInfer on SM100 GPUs, or the CPU simulation "
        "(default: %(default)s)",
        choices=["deepinfer", "simulated"],
    )
    served_model_name: str | None = _opt(
        None,
        "--served-model-name",
        help="model name clients use (default: MODEL as given, or 'deepseek-flash' for the "
        "simulated engine without MODEL)",
    )
    host: str = _opt("0.0.0.0", "--host", help="HTTP listen address (default: %(default)s)")
    port: int = _opt(8000, "--port", help="HTTP port (default: %(default)s)", type=int)
    expert_parallel_size: int = _opt(
        1,
        "--expert-parallel-size",
        "--ep",
        help="expert-parallel size EP, the number of GPUs; DP*CP must equal EP (default: 1)",
        type=int,
    )
    data_parallel_size: int | None = _opt(
        None,
        "--data-parallel-size",
        "--dp",
        help="data-parallel ranks, one engine process each (default: 1, or EP/CP)",
        type=int,
    )
    context_parallel_size: int | None = _opt(
        None,
        "--context-parallel-size",
        "--cp",
        help="context-parallel GPUs per DP rank (default: EP/DP)",
        type=int,
    )
    max_model_len: int | None = _opt(
        None,
        "--max-model-len",
        help="context length in tokens, prompt plus output (default: 32768)",
        type=int,
    )
    max_num_seqs: int = _opt(
        16,
        "--max-num-seqs",
        help="running sequences per DP rank (default: %(default)s)",
        type=int,
    )
    max_queued_requests: int = _opt(
        0,
        "--max-queued-requests",
        help="requests admitted beyond running capacity before 429 (default: %(default)s)",
        type=int,
    )
    max_num_batched_tokens: int | None = _opt(
        None,
        "--max-num-batched-tokens",
        help="tokens per engine step, passed to DeepInfer (default: DeepInfer's)",
        type=int,
    )
    step_timeout: float = _opt(
        300.0,
        "--step-timeout",
        help="seconds a rank may take for one engine step while requests are in flight "
        "before it is treated as failed (a hung engine); 0 disables (default: %(default)s)",
        type=float,
    )
    disable_log_stats: bool = _opt(
        False,
        "--disable-log-stats",
        help="turn off DeepInfer's periodic engine statistics log",
        action="store_true",
    )
    request_timeout: float = _opt(
        600.0,
        "--request-timeout",
        help="seconds a request may run before it is cancelled; 0 disables (default: %(default)s)",
        type=float,
    )
    startup_timeout: float = _opt(
        3600.0,
        "--startup-timeout",
        help="seconds every rank may take to become ready (default: %(default)s)",
        type=float,
    )
    gpu_memory_utilization: float = _opt(
        0.9,
        "--gpu-memory-utilization",
        help="fraction of GPU memory DeepInfer may use (default: %(default)s)",
        type=float,
    )
    trust_remote_code: bool = _opt(
        False,
        "--trust-remote-code",
        help="allow the checkpoint's own tokenizer code (passed to the engine)",
        action="store_true",
    )
    default_thinking: Literal["enabled", "disabled"] = _opt(
        "enabled",
        "--default-thinking",
        help="thinking mode for requests that do not choose one (default: %(default)s)",
        choices=["enabled", "disabled"],
    )
    api_key: tuple[str, ...] = _opt(
        (),
        "--api-key",
        help="require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on every /v1 route; "
        "repeat for several keys (default: $DEEPINFER_API_KEY, else no authentication)",
        secret=True,
        action="append",
    )
    allowed_origins: tuple[str, ...] = _opt(
        (),
        "--allowed-origins",
        help="CORS: an allowed origin, or '*'; repeatable (default: no CORS)",
        action="append",
    )
    allowed_methods: tuple[str, ...] = _opt(
        (),
        "--allowed-methods",
        help="CORS: an allowed method; repeatable (default with origins: '*')",
        action="append",
    )
    allowed_headers: tuple[str, ...] = _opt(
        (),
        "--allowed-headers",
        help="CORS: an allowed request header; repeatable (default with origins: '*')",
        action="append",
    )
    max_request_bytes: int = _opt(
        8 * 1024 * 1024,
        "--max-request-bytes",
        help="largest request body accepted; larger ones get 413 (default: %(default)s)",
        type=int,
    )
    body_read_timeout: float = _opt(
        60.0,
        "--body-read-timeout",
        help="seconds a client may take to send its request body before 408 (default: %(default)s)",
        type=float,
    )
    disable_access_log: bool = _opt(
        False, "--disable-access-log", help="do not log one line per request", action="store_true"
    )
    log_requests: bool = _opt(
        False,
        "--log-requests",
        help="also log each request's body (prompts included); off by default",
        action="store_true",
    )
    log_level: str = _opt(
        "info",
        "--log-level",
        help="log level (default: %(default)s)",
        choices=["critical", "error", "warning", "info", "debug"],
    )
    shutdown_timeout: float = _opt(
        0.0,
        "--shutdown-timeout",
        help="on SIGTERM, seconds in-flight requests may still finish (default: %(default)s)",
        type=float,
    )
    sim_ttft_ms: float = _opt(
        20.0,
        "--sim-ttft-ms",
        help="simulated engine: delay before each request's first token (default: %(default)s)",
        type=float,
    )
    sim_itl_ms: float = _opt(
        10.0,
        "--sim-itl-ms",
        help="simulated engine: duration of every engine step (default: %(default)s)",
        type=float,
    )
    sim_tokens_per_step: int = _opt(
        1,
        "--sim-tokens-per-step",
        help="simulated engine: tokens per request per decode step, as speculative decoding "
        "emits (default: %(default)s)",
        type=int,
    )
    sim_disable_zos: bool = _opt(
        False,
        "--sim-disable-zos",
        help="simulated engine: return decode tokens in the same step (DeepInfer's "
        "zero-overhead scheduling returns them one step late, and is on by default)",
        action="store_true",
    )
    sim_fault: Literal["startup", "step-error", "step-hang"] | None = _opt(
        None,
        "--sim-fault",
        help="simulated engine: inject a failure on one rank, for tests and demos: its "
        "construction raises (startup), or a step raises (step-error) or never returns "
        "(step-hang) after --sim-fault-after-steps steps",
        choices=["startup", "step-error", "step-hang"],
    )
    sim_fault_rank: int = _opt(
        0, "--sim-fault-rank", help="simulated engine: the rank that fails (default: 0)", type=int
    )
    sim_fault_after_steps: int = _opt(
        0,
        "--sim-fault-after-steps",
        help="simulated engine: steps that succeed before the fault (default: 0)",
        type=int,
    )
    sim_collective_timeout: float = _opt(
        60.0,
        "--sim-collective-timeout",
        help="simulated engine: seconds a rank waits in a DP collective before it reports a "
        "lockstep violation (default: %(default)s)",
        type=float,
    )

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Names a request may use for this model."""
        assert self.served_model_name is not None, "resolve() sets the served model name"
        return (self.served_model_name,)

    @property
    def admission_capacity(self) -> int:
        """Requests admitted at once: running capacity of every rank plus the queue allowance."""
        return self.dp * self.max_num_seqs + self.max_queued_requests

    @property
    def dp(self) -> int:
        assert self.data_parallel_size is not None, "resolve() sets DP"
        return self.data_parallel_size

    @property
    def cp(self) -> int:
        assert self.context_parallel_size is not None, "resolve() sets CP"
        return self.context_parallel_size

    @property
    def context_limit(self) -> int:
        assert self.max_model_len is not None, "resolve() sets max_model_len"
        return self.max_model_len


def derive_parallelism(ep: int, dp: int | None, cp: int | None) -> tuple[int, int]:
    """Return (DP, CP) such that DP * CP == EP, or raise ConfigError with a one-line reason."""
    for name, value in (("--ep", ep), ("--dp", dp), ("--cp", cp)):
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be at least 1, got {value}")
    if dp is None and cp is None:
        return 1, ep
    if dp is None:
        assert cp is not None
        if ep % cp:
            raise ConfigError(f"--cp {cp} does not divide --ep {ep}: DP*CP must equal EP")
        return ep // cp, cp
    if cp is None:
        if ep % dp:
            raise ConfigError(f"--dp {dp} does not divide --ep {ep}: DP*CP must equal EP")
        return dp, ep // dp
    if dp * cp != ep:
        raise ConfigError(f"--dp {dp} times --cp {cp} is {dp * cp}, not --ep {ep}")
    return dp, cp


def resolve(config: ServerConfig) -> ServerConfig:
    """Validate a parsed configuration and fill every derived default."""
    if config.model is None and config.engine != "simulated":
        raise ConfigError("MODEL is required unless --engine simulated is given")
    dp, cp = derive_parallelism(
        config.expert_parallel_size, config.data_parallel_size, config.context_parallel_size
    )
    served = config.served_model_name or config.model or SIMULATED_DEFAULT_MODEL_NAME
    max_model_len = config.max_model_len or SIMULATED_DEFAULT_MAX_MODEL_LEN
    positive = {
        "--max-model-len": max_model_len,
        "--max-num-seqs": config.max_num_seqs,
        "--sim-tokens-per-step": config.sim_tokens_per_step,
    }
    for flag, value in positive.items():
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    non_negative: dict[str, float] = {
        "--max-queued-requests": config.max_queued_requests,
        "--request-timeout": config.request_timeout,
        "--step-timeout": config.step_timeout,
        "--startup-timeout": config.startup_timeout,
        "--shutdown-timeout": config.shutdown_timeout,
        "--sim-ttft-ms": config.sim_ttft_ms,
        "--sim-itl-ms": config.sim_itl_ms,
    }
    for flag, amount in non_negative.items():
        if amount < 0:
            raise ConfigError(f"{flag} must not be negative, got {amount}")
    if not 0.0 < config.gpu_memory_utilization <= 1.0:
        raise ConfigError(
            f"--gpu-memory-utilization must be in (0, 1], got {config.gpu_memory_utilization}"
        )
    if not 0 < config.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {config.port}")
    if not 0 <= config.sim_fault_rank < dp:
        raise ConfigError(f"--sim-fault-rank must be a DP rank in 0..{dp - 1}")
    if config.sim_fault_after_steps < 0:
        raise ConfigError("--sim-fault-after-steps must not be negative")
    if config.max_request_bytes < 1024:
        raise ConfigError("--max-request-bytes must be at least 1024")
    if config.body_read_timeout <= 0:
        raise ConfigError("--body-read-timeout must be positive")
    api_keys = tuple(config.api_key) or (
        (os.environ["DEEPINFER_API_KEY"],) if os.environ.get("DEEPINFER_API_KEY") else ()
    )
    if any(not key for key in api_keys):
        raise ConfigError("--api-key must not be empty")
    if config.sim_collective_timeout <= 0:
        raise ConfigError("--sim-collective-timeout must be positive")
    return dataclasses.replace(
        config,
        data_parallel_size=dp,
        context_parallel_size=cp,
        served_model_name=served,
        max_model_len=max_model_len,
        api_key=api_keys,
        allowed_origins=tuple(config.allowed_origins),
        allowed_methods=tuple(config.allowed_methods),
        allowed_headers=tuple(config.allowed_headers),
    )
