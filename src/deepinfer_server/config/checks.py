"""The range checks `resolve()` makes on the options as given, each failure a ConfigError
naming the flag."""

from __future__ import annotations

from collections.abc import Mapping

from deepinfer_server.config.media_origins import parse_origin
from deepinfer_server.config.options import ServerConfig
from deepinfer_server.disaggregation.role import DisaggregationRole
from deepinfer_server.errors import ConfigError


def check_ranges(config: ServerConfig, max_model_len: int) -> None:
    """Raise ConfigError for the first option out of its range."""
    _at_least_one(
        {
            "--max-model-len": max_model_len,
            "--max-num-seqs": config.max_num_seqs,
            "--stream-interval": config.stream_interval,
            "--max-queued-compiles-per-key": config.max_queued_compiles_per_key,
        }
    )
    _not_negative(
        {
            "--max-queued-requests": config.max_queued_requests,
            "--request-timeout": config.request_timeout,
            "--queue-timeout": config.queue_timeout,
            "--step-timeout": config.step_timeout,
            "--startup-timeout": config.startup_timeout,
            "--sse-keepalive-seconds": config.sse_keepalive_seconds,
            "--shutdown-timeout": config.shutdown_timeout,
        }
    )
    if not 0 <= config.port < 65536:
        raise ConfigError(
            f"--port must be in 0..65535 (0: one the system picks), got {config.port}"
        )
    _check_media(config)
    _positive(
        {
            "--body-read-timeout": config.body_read_timeout,
            "--header-timeout": config.header_timeout,
            "--write-timeout": config.write_timeout,
            "--grammar-queue-timeout": config.grammar_queue_timeout,
        }
    )
    _check_admission(config)
    _check_disaggregation(config)
    _check_headers(config)
    _at_least_one(
        {
            "--max-receive-buffer-mb": config.max_receive_buffer_mb,
            "--response-store-max-mb": config.response_store_max_mb,
            "--response-store-key-max-mb": config.response_store_key_max_mb,
            "--response-store-max-response-mb": config.response_store_max_response_mb,
            "--batch-max-file-mb": config.batch_max_file_mb,
            "--batch-max-lines": config.batch_max_lines,
            "--batch-max-active": config.batch_max_active,
            "--files-key-max-count": config.files_key_max_count,
            "--batch-concurrency": config.batch_concurrency,
        }
    )


def check_decode_layout(config: ServerConfig, context_parallel_size: int) -> None:
    """Raise ConfigError for a decode server with context parallelism."""
    if config.disaggregation_mode is DisaggregationRole.DECODE and context_parallel_size > 1:
        # DeepInfer asserts it: a COMPLETION engine has no context-parallel prefill to split.
        raise ConfigError(
            "--disaggregation-mode decode needs --cp 1 (DeepInfer's COMPLETION engine)"
        )


def _at_least_one(values: Mapping[str, int]) -> None:
    for flag, value in values.items():
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")


def _not_negative(amounts: Mapping[str, float]) -> None:
    for flag, amount in amounts.items():
        if amount < 0:
            raise ConfigError(f"{flag} must not be negative, got {amount}")


def _positive(seconds: Mapping[str, float]) -> None:
    for flag, value in seconds.items():
        if value <= 0:
            raise ConfigError(f"{flag} must be positive")


def _check_media(config: ServerConfig) -> None:
    _positive({"--media-fetch-timeout": config.media_fetch_timeout})
    for entry in config.allowed_media_domains:
        try:
            parse_origin(entry)
        except ValueError as exc:
            raise ConfigError(f"--allowed-media-domains: {exc}") from exc
    if config.max_images_per_request < 0 or config.max_image_bytes < 1:
        raise ConfigError("--max-images-per-request must be >= 0 and --max-image-bytes >= 1")
    if config.max_request_bytes < 1024:
        raise ConfigError("--max-request-bytes must be at least 1024")


def _check_admission(config: ServerConfig) -> None:
    if not 0 < config.prefix_cache_retention_share <= 1:
        raise ConfigError(
            "--prefix-cache-retention-share must be in (0, 1], got "
            f"{config.prefix_cache_retention_share}"
        )
    if not 0 < config.key_running_share <= 1:
        raise ConfigError(f"--key-running-share must be in (0, 1], got {config.key_running_share}")
    if not 0 < config.key_queued_share <= 1:
        raise ConfigError(f"--key-queued-share must be in (0, 1], got {config.key_queued_share}")
    _at_least_one(
        {
            "--api-server-count": config.api_server_count,
            "--max-connections": config.max_connections,
        }
    )


def _check_disaggregation(config: ServerConfig) -> None:
    if not 0 <= config.disaggregation_bootstrap_port < 65536:
        raise ConfigError(
            "--disaggregation-bootstrap-port must be in 0..65535, got "
            f"{config.disaggregation_bootstrap_port}"
        )
    if config.disaggregation_transport == "rdma" and not config.disaggregation_ib_device:
        raise ConfigError(
            "--disaggregation-transport rdma needs --disaggregation-ib-device (the RDMA "
            "devices to use, for example mlx5_0)"
        )
    _positive(
        {
            "--disaggregation-kv-hold-timeout": config.disaggregation_kv_hold_timeout,
            "--disaggregation-transfer-timeout": config.disaggregation_transfer_timeout,
        }
    )


def _check_headers(config: ServerConfig) -> None:
    if (
        config.max_header_line_bytes < 1024
        or config.max_header_bytes < config.max_header_line_bytes
    ):
        raise ConfigError(
            "--max-header-line-bytes must be at least 1024 and --max-header-bytes at least as "
            f"large (got {config.max_header_line_bytes} and {config.max_header_bytes})"
        )
