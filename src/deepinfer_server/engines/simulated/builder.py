"""build: the simulated backend's builder, run inside a rank process."""

from __future__ import annotations

import importlib.util

import msgspec

from deepinfer_server.disaggregation.layout import KVLayout, checkpoint_identity
from deepinfer_server.engines.backend import BuiltEngine, EngineSpec, SharedState
from deepinfer_server.engines.llm_engine_driver import LLMEngineDriver
from deepinfer_server.engines.role_settings import RoleSettings
from deepinfer_server.engines.simulated.abilities import SimulatedAbilities
from deepinfer_server.engines.simulated.backend import SimulatedOptions
from deepinfer_server.engines.simulated.collectives import LockstepGroup
from deepinfer_server.engines.simulated.engine import LLMEngine, SimEngineArgs
from deepinfer_server.engines.simulated.kv_size import KVSize, kv_size_option
from deepinfer_server.engines.simulated.outputs import RequestOutput
from deepinfer_server.model.kv_block import BLOCK_SIZE
from deepinfer_server.model.tokenizer import load_tokenizer_json
from deepinfer_server.prefix_cache.host_tier import HostTierSettings
from deepinfer_server.prefix_cache.store_tier import (
    StoreTier,
    StoreTierSettings,
    mooncake_client,
)


def build(spec: EngineSpec, shared: SharedState | None) -> BuiltEngine:
    """Construct the simulated engine of one rank (the backend's `builder`)."""
    options = spec.engine_options
    assert isinstance(options, SimulatedOptions)
    assert isinstance(shared, LockstepGroup), "the simulated backend shares a LockstepGroup"
    kv_size = kv_size_option(options.sim_kv_bytes_per_token, spec.model, spec.speculative_tokens)
    host_tier = host_tier_settings(spec, options, kv_size)
    args = SimEngineArgs(
        tokenizer_json=load_tokenizer_json(spec.model),
        lockstep=shared,
        engine_rank=spec.rank,
        data_parallel_size=spec.data_parallel_size,
        max_model_len=spec.max_model_len,
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        ttft_ms=options.sim_ttft_ms,
        itl_ms=options.sim_itl_ms,
        itl_ms_per_request=options.sim_itl_ms_per_request,
        tokens_per_step=options.sim_tokens_per_step,
        speculative_tokens=spec.speculative_tokens,
        zero_overhead_scheduling=not options.sim_disable_zos,
        prefill_attempt_interval=spec.prefill_attempt_interval,
        prefill_any_attempt_interval=spec.prefill_any_attempt_interval,
        fault=options.sim_fault if spec.rank == options.sim_fault_rank else None,
        fault_after_steps=options.sim_fault_after_steps,
        kv_blocks=options.sim_kv_blocks,
        enable_prefix_caching=spec.enable_prefix_caching,
        prefix_cache_retention_share=spec.prefix_cache_retention_share,
        prefill_tokens_per_s=options.sim_prefill_tokens_per_s * spec.context_parallel_size,
        host_tier=host_tier,
        store_tier=store_tier(spec, options, host_tier),
        disaggregation_mode=spec.disaggregation_mode,
        role=RoleSettings.of(spec),
        kv_size=kv_size,
    )
    engine = LLMEngine.from_engine_args(args)
    abilities = SimulatedAbilities(engine, spec.enable_prefix_caching)
    return BuiltEngine(
        LLMEngineDriver(engine, RequestOutput, abilities, count_drafts=spec.speculative_tokens > 0),
        # Without xgrammar there is nothing to warm: the rank's grammar builder is "warm" at ready.
        after_ready=engine.prepare_structured_outputs if _warms(spec) else None,
        bootstrap_port=abilities.connector.bootstrap_port,
        layout=abilities.connector.layout,
    )


def host_tier_settings(
    spec: EngineSpec, options: SimulatedOptions, kv_size: KVSize | None
) -> HostTierSettings | None:
    """The prefix cache's host tier of a rank (None without `--kv-offload-host-gb`): it copies
    the KV rows `kv_size` gives (`--sim-kv-bytes-per-token`'s), by default the checkpoint's (as
    `auto`)."""
    if spec.kv_offload_host_gb <= 0 or not spec.enable_prefix_caching:
        return None
    size = kv_size or KVSize.of_checkpoint(spec.model, spec.speculative_tokens + 1)
    gpus = spec.context_parallel_size
    return HostTierSettings(
        budget_bytes=int(spec.kv_offload_host_gb * 1e9),
        bandwidth=options.sim_host_bandwidth_gbps * 1e9 * gpus,
        block_bytes=size.block_bytes,
        state_bytes=size.state_bytes,
        prefill_tokens_per_s=options.sim_prefill_tokens_per_s * gpus,
    )


def store_tier(
    spec: EngineSpec, options: SimulatedOptions, host: HostTierSettings | None
) -> StoreTier | None:
    """The host tier's shared store (None without `--kv-offload-store` or the host tier `host`):
    its pages are keyed by the layout of the rows the host tier copies and the checkpoint."""
    master = spec.kv_offload_store_master
    if host is None or spec.kv_offload_store is None or master is None:
        return None
    layout = KVLayout(
        engine="simulated",
        checkpoint=checkpoint_identity(spec.model) or spec.model,
        block_size=BLOCK_SIZE,
        block_bytes=host.block_bytes,
        state_bytes=host.state_bytes,
        dtype="uint8",
        speculative_tokens=spec.speculative_tokens,
    )
    settings = StoreTierSettings(
        identity=msgspec.json.encode(layout),
        bandwidth=options.sim_store_bandwidth_gbps * 1e9,
        lookup_timeout=options.sim_store_lookup_timeout_ms / 1000,
    )
    hostname = spec.disaggregation_host
    return StoreTier(settings, lambda: mooncake_client(master, hostname))


def _warms(spec: EngineSpec) -> bool:
    """Whether the rank warms its grammar builder once ready (`--grammar-warmup`, xgrammar)."""
    return spec.grammar_warmup and importlib.util.find_spec("xgrammar") is not None
