"""The DeepInfer backend's declarations: options, checkpoint files, rank environments, checks.

Imported by the API process; it never imports `deepinfer` (that happens in `engine.py`,
inside the rank processes only).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil

from deepinfer_server.config.option_field import flag_option, float_option
from deepinfer_server.config.resolved import SPECULATIVE_TOKENS_VARIABLE
from deepinfer_server.engines.backend import EngineBackend, check_store_tier
from deepinfer_server.engines.deepinfer.environment import (
    physical_gpu_count,
    rank_environment,
    so_builder_cpus,
    visible_gpus,
)
from deepinfer_server.engines.deepinfer.preflight import check_role, run_preflight
from deepinfer_server.errors import ConfigError
from deepinfer_server.model.images import ImagePolicy, deepinfer_image_policy

if TYPE_CHECKING:
    from deepinfer_server.config import ResolvedConfig


@dataclass(frozen=True)
class DeepInferOptions:
    """Options only the DeepInfer engine reads."""

    gpu_memory_utilization: float = float_option(
        0.9,
        "--gpu-memory-utilization",
        help="fraction of GPU memory DeepInfer may use (default: %(default)s)",
    )
    trust_remote_code: bool = flag_option(
        "--trust-remote-code",
        help="allow the checkpoint's own tokenizer code (passed to the engine)",
    )
    disable_log_stats: bool = flag_option(
        "--disable-log-stats",
        help="turn off DeepInfer's periodic engine statistics log",
    )
    kv_offload_host_bandwidth_gbps: float = float_option(
        50.0,
        "--kv-offload-host-bandwidth-gbps",
        help="GB/s between host memory and the GPU, each way, that the prefix cache's host "
        "tier (--kv-offload-host-gb) assumes when it decides whether restoring a prompt's "
        "prefix beats computing it (docs/development/gpu-validation.md measures it; "
        "default: %(default)s, about PCIe 5 x16)",
    )
    kv_offload_prefill_tokens_per_s: float = float_option(
        20_000.0,
        "--kv-offload-prefill-tokens-per-s",
        help="prompt tokens a prompt step computes per second, which a host-tier restore "
        "must beat (a restore of a prefix shorter than its copy's worth is recomputed; "
        "default: %(default)s)",
    )
    kv_offload_store_segment_gb: float = float_option(
        4.0,
        "--kv-offload-store-segment-gb",
        help="host memory each rank gives the shared Mooncake Store's pool "
        "(--kv-offload-store; its global segment: a prompt's pages take its KV bytes and a "
        "state row; default: %(default)s)",
    )
    kv_offload_store_buffer_gb: float = float_option(
        1.0,
        "--kv-offload-store-buffer-gb",
        help="each rank's Mooncake Store transfer buffer, which one lookup's pages must fit "
        "in (its local buffer; default: %(default)s)",
    )


class DeepInferBackend(EngineBackend):
    """DeepSeek's DeepInfer 0.1.0 LLMEngine, one per DP rank."""

    name = "deepinfer"
    summary = "DeepInfer on SM100 GPUs"
    options_type = DeepInferOptions
    builder = "deepinfer_server.engines.deepinfer.engine:build"
    required_files = ("config.json", "tokenizer.json", "tokenizer_config.json")

    def validate_options(self, options: object, data_parallel_size: int) -> None:
        assert isinstance(options, DeepInferOptions)
        if not 0.0 < options.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"--gpu-memory-utilization must be in (0, 1], got {options.gpu_memory_utilization}"
            )
        for flag, value in (
            ("--kv-offload-host-bandwidth-gbps", options.kv_offload_host_bandwidth_gbps),
            ("--kv-offload-prefill-tokens-per-s", options.kv_offload_prefill_tokens_per_s),
            ("--kv-offload-store-segment-gb", options.kv_offload_store_segment_gb),
            ("--kv-offload-store-buffer-gb", options.kv_offload_store_buffer_gb),
        ):
            if value <= 0:
                raise ConfigError(f"{flag} must be positive, got {value:g}")

    def check_installed(self) -> None:
        if importlib.util.find_spec("deepinfer") is None:
            raise ConfigError(
                "--engine deepinfer needs the DeepInfer package, which is not importable here "
                "(install DeepInfer or add its source to PYTHONPATH; or use --engine simulated)"
            )

    def image_policy(self, checkpoint: str | None, tokenizer_json: str) -> ImagePolicy:
        if checkpoint is None:
            return ImagePolicy.refused("the engine runs without a checkpoint directory")
        return deepinfer_image_policy(checkpoint, tokenizer_json)

    def prompt_logprobs_unavailable(self) -> str | None:
        # LLMEngine.add_request forces prompt_logprobs off under YoCo prefill truncation
        # (llm_engine.py 529-537): the values would come back as nulls, without a word.
        mode = os.environ.get("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "off").strip() or "off"
        if mode == "off":
            return None
        return (
            "this server's engine computes no prompt logprobs: DeepInfer's YoCo prefill "
            f"truncation is on (DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE={mode})"
        )

    def preflight(self, config: ResolvedConfig, checkpoint: str | None) -> None:
        if config.kv_offload_host_gb > 0 and config.context_parallel_size > 1:
            raise ConfigError(
                "--kv-offload-host-gb with --engine deepinfer needs --context-parallel-size 1: "
                "the host tier copies the driver worker's KV rows only, and each CP worker "
                "holds its own; drop the option (or pass 0)"
            )
        check_store_tier(config)
        if config.disaggregation_mode.disaggregated:
            check_role(config.disaggregation_mode, config.enable_prefix_caching, os.environ)
        run_preflight(
            config.max_model_len,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            checkpoint,
            speculative_tokens=config.speculative_tokens,
        )

    def rank_environments(
        self, config: ResolvedConfig, master_port: int
    ) -> Sequence[dict[str, str]]:
        gpus = visible_gpus(os.environ)
        # Read by DeepInfer at import of deepinfer.config (config.py:193-194).
        cadence = {
            "DEEPINFER_PREFILL_ATTEMPT_INTERVAL": str(config.prefill_attempt_interval),
            "DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL": str(config.prefill_any_attempt_interval),
            # Read by DeepInfer's Python (environ.py) and its C++ scheduler (utils.hpp), which
            # must agree: set for both before anything from deepinfer is imported.
            SPECULATIVE_TOKENS_VARIABLE: str(config.speculative_tokens),
        }
        node_gpus = physical_gpu_count() or len(gpus)
        physical_cpus = psutil.cpu_count(logical=False) or os.cpu_count() or 1
        allowed_cpus = os.sched_getaffinity(0)
        environments = []
        for rank in range(config.data_parallel_size):
            environment = rank_environment(
                rank,
                gpus,
                config.context_parallel_size,
                config.expert_parallel_size,
                master_port,
            )
            driver_gpu = int(environment["CUDA_VISIBLE_DEVICES"].split(",")[0])
            environment["DEEPINFER_SO_BUILDER_CPUS"] = so_builder_cpus(
                driver_gpu,
                node_gpus,
                physical_cpus,
                allowed_cpus,
                os.environ.get("DEEPINFER_SO_BUILDER_CPUS"),
            )
            environments.append({**environment, **cadence})
        return environments
