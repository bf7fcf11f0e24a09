"""The simulated backend's declarations: its options, its collectives, no GPU requirements.

Imported by the API process; the engine itself (`engine.py`) is built only in rank processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

from deepinfer_server.config.option_field import flag_option, float_option, int_option, option
from deepinfer_server.config.resolved import EngineDefaults
from deepinfer_server.engines.backend import EngineBackend, SharedState, check_store_tier
from deepinfer_server.engines.simulated.collectives import new_lockstep_group
from deepinfer_server.engines.simulated.kv_size import valid_kv_bytes
from deepinfer_server.errors import ConfigError

if TYPE_CHECKING:
    from deepinfer_server.config import ResolvedConfig


@dataclass(frozen=True)
class SimulatedOptions:
    """Options only the simulated engine reads."""

    sim_ttft_ms: float = float_option(
        20.0,
        "--sim-ttft-ms",
        help="simulated engine: delay before each request's first token (default: %(default)s)",
    )
    sim_itl_ms: float = float_option(
        10.0,
        "--sim-itl-ms",
        help="simulated engine: duration of every engine step (default: %(default)s)",
    )
    sim_itl_ms_per_request: float = float_option(
        0.0,
        "--sim-itl-ms-per-request",
        help="simulated engine: milliseconds a decode step lasts beyond --sim-itl-ms for each "
        "sequence it decodes (a linear cost model: a decode step of B sequences lasts "
        "--sim-itl-ms + B times this; a fixed part, the weights read and the launches, and a "
        "part that grows with the batch, each sequence's KV read and its share of the expert "
        "work). 0: a decode step costs the same whatever its batch (default: %(default)s)",
    )
    sim_tokens_per_step: int = int_option(
        1,
        "--sim-tokens-per-step",
        help="simulated engine: tokens per request per decode step, as speculative decoding "
        "emits (default: %(default)s)",
    )
    sim_disable_zos: bool = flag_option(
        "--sim-disable-zos",
        help="simulated engine: return decode tokens in the same step (DeepInfer's "
        "zero-overhead scheduling returns them one step late, and is on by default)",
    )
    sim_fault: Literal["startup", "step-error", "step-hang"] | None = option(
        None,
        "--sim-fault",
        help="simulated engine: inject a failure on one rank, for tests and demos: its "
        "construction raises (startup), or a step raises (step-error) or never returns "
        "(step-hang) after --sim-fault-after-steps steps",
        choices=["startup", "step-error", "step-hang"],
    )
    sim_fault_rank: int = int_option(
        0, "--sim-fault-rank", help="simulated engine: the rank that fails (default: 0)"
    )
    sim_fault_after_steps: int = int_option(
        0,
        "--sim-fault-after-steps",
        help="simulated engine: steps that succeed before the fault (default: 0)",
    )
    sim_kv_blocks: int | None = int_option(
        None,
        "--sim-kv-blocks",
        help="simulated engine: KV-cache blocks of 128 tokens per rank; when they run out, "
        "decode preempts as DeepInfer does (default: enough for --max-num-seqs sequences of "
        "--max-model-len tokens)",
    )
    sim_kv_bytes_per_token: str | None = option(
        None,
        "--sim-kv-bytes-per-token",
        help="simulated engine, prefill and decode servers: the bytes of KV each prompt token "
        "holds, which a transfer moves. auto: the checkpoint's, as DeepInfer 0.1.0 lays out "
        "its KV blocks and state slots (from its config.json: the KV-source layers' "
        "compressed main KV and indexer K per block, every layer's sliding window and the "
        "compression rings per sequence; the released DeepSeek-V4.1-Flash's without a "
        "checkpoint: 891 bytes a token and about 2.9 MB a sequence); N: N bytes a token. The "
        "rows are allocated for every KV block of the rank (--sim-kv-blocks bounds them). "
        "Default: 8 bytes a token (each position's token and writer)",
    )
    sim_prefill_tokens_per_s: float = float_option(
        20_000.0,
        "--sim-prefill-tokens-per-s",
        help="simulated engine: prompt tokens one GPU computes per second; a prompt step lasts "
        "the prompt tokens it computes (a prefix-cache hit computes only the rest) over this "
        "rate times the rank's CP GPUs, and at least one step. The default is an assumption: "
        "about one B200 prefilling DeepSeek-V4.1-Flash (DeepSeek's V3 service computed some 4k "
        "prompt tokens/s per H800 GPU; a B200 is about twice as fast and V4.1-Flash smaller). "
        "0: a prompt step lasts one step (default: %(default)s)",
    )
    sim_host_bandwidth_gbps: float = float_option(
        50.0,
        "--sim-host-bandwidth-gbps",
        help="simulated engine: GB/s between host memory and one GPU, each way, for the "
        "prefix cache's host tier (--kv-offload-host-gb): a copy of an entry's KV blocks and "
        "state slot (as --sim-kv-bytes-per-token sizes them; for the tier, the checkpoint's "
        "unless given, as auto) lasts its bytes over this rate times the rank's CP GPUs "
        "(default: %(default)s, about PCIe 5 x16)",
    )
    sim_store_bandwidth_gbps: float = float_option(
        25.0,
        "--sim-store-bandwidth-gbps",
        help="simulated engine: GB/s from the shared store (--kv-offload-store) to a rank's "
        "host memory: a prefix found there is copied to the host tier in its bytes over this "
        "rate, then restored from there (default: %(default)s, about one 200 Gb/s RDMA NIC)",
    )
    sim_store_lookup_timeout_ms: float = float_option(
        100.0,
        "--sim-store-lookup-timeout-ms",
        help="simulated engine: milliseconds a request's admission waits for the shared "
        "store's answer (--kv-offload-store) before it counts as a miss (default: %(default)s)",
    )
    sim_collective_timeout: float = float_option(
        60.0,
        "--sim-collective-timeout",
        help="simulated engine: seconds a rank waits in a DP collective before it reports a "
        "lockstep violation (default: %(default)s)",
    )


class SimulatedBackend(EngineBackend):
    """The CPU implementation of DeepInfer's LLMEngine contract (echoes the last user turn)."""

    name = "simulated"
    summary = "the CPU simulation of DeepInfer's engine contract"
    options_type = SimulatedOptions
    builder = "deepinfer_server.engines.simulated.builder:build"
    required_files = ("tokenizer.json",)
    download_patterns: ClassVar[list[str] | None] = ["*.json", "*.py", "*.model", "*.txt"]
    defaults = EngineDefaults(model_required=False, prefix_caching=True, kv_offload_host_gb=64.0)

    def validate_options(self, options: object, data_parallel_size: int) -> None:
        assert isinstance(options, SimulatedOptions)
        if options.sim_tokens_per_step < 1:
            raise ConfigError(
                f"--sim-tokens-per-step must be at least 1, got {options.sim_tokens_per_step}"
            )
        for flag, amount in (
            ("--sim-ttft-ms", options.sim_ttft_ms),
            ("--sim-itl-ms", options.sim_itl_ms),
            ("--sim-itl-ms-per-request", options.sim_itl_ms_per_request),
            ("--sim-fault-after-steps", options.sim_fault_after_steps),
            ("--sim-prefill-tokens-per-s", options.sim_prefill_tokens_per_s),
        ):
            if amount < 0:
                raise ConfigError(f"{flag} must not be negative, got {amount}")
        if not 0 <= options.sim_fault_rank < data_parallel_size:
            raise ConfigError(f"--sim-fault-rank must be a DP rank in 0..{data_parallel_size - 1}")
        if options.sim_kv_blocks is not None and options.sim_kv_blocks < 2:
            raise ConfigError(f"--sim-kv-blocks must be at least 2, got {options.sim_kv_blocks}")
        if not valid_kv_bytes(options.sim_kv_bytes_per_token):
            raise ConfigError(
                "--sim-kv-bytes-per-token must be auto or a positive number of bytes, got "
                f"{options.sim_kv_bytes_per_token}"
            )
        if options.sim_collective_timeout <= 0:
            raise ConfigError("--sim-collective-timeout must be positive")
        if options.sim_host_bandwidth_gbps <= 0:
            raise ConfigError("--sim-host-bandwidth-gbps must be positive")
        if options.sim_store_bandwidth_gbps <= 0:
            raise ConfigError("--sim-store-bandwidth-gbps must be positive")
        if options.sim_store_lookup_timeout_ms <= 0:
            raise ConfigError("--sim-store-lookup-timeout-ms must be positive")

    def preflight(self, config: ResolvedConfig, checkpoint: str | None) -> None:
        options = config.engine_options
        assert isinstance(options, SimulatedOptions)
        if config.speculative_tokens and options.sim_tokens_per_step > 1:
            raise ConfigError(
                "--sim-tokens-per-step and --speculative-tokens both set the tokens of a decode "
                "step: give one of them"
            )
        check_store_tier(config)

    def shared_state(self, config: ResolvedConfig) -> SharedState:
        options = config.engine_options
        assert isinstance(options, SimulatedOptions)
        return new_lockstep_group(config.data_parallel_size, options.sim_collective_timeout)
