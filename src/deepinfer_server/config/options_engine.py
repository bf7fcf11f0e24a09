"""The engine's option groups: what is served, where, on how many GPUs, and how the engine
schedules and times its requests."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal

from deepinfer_server.config.option_field import float_option, int_option, option


@dataclass(frozen=True)
class PlacementOptions:
    """The model, the engine that serves it, the listen address and the parallel layout."""

    model: str | None = option(
        None,
        "model",
        help="checkpoint directory or Hugging Face repository id (optional with "
        "--engine simulated)",
        nargs="?",
    )
    engine: str = option(
        "deepinfer",
        "--engine",
        help="inference engine (default: %(default)s); the choices come from the engine registry",
    )
    served_model_name: tuple[str, ...] = option(
        (),
        "--served-model-name",
        help="model names clients may use; the first is the one responses report (default: "
        "MODEL as given, or 'deepseek-flash' for the simulated engine without MODEL)",
        nargs="+",
    )
    host: str = option("0.0.0.0", "--host", help="HTTP listen address (default: %(default)s)")
    port: int = int_option(
        8000,
        "--port",
        help="HTTP port; 0 takes a free one the system picks, named in the start-up line "
        "(default: %(default)s)",
    )
    expert_parallel_size: int | None = int_option(
        None,
        "--expert-parallel-size",
        "--ep",
        help="expert-parallel size EP, the number of GPUs; DP*CP must equal EP (default: DP*CP)",
    )
    data_parallel_size: int | None = int_option(
        None,
        "--data-parallel-size",
        "--dp",
        help="data-parallel ranks, one engine process each (default: 1, or EP/CP)",
    )
    context_parallel_size: int | None = int_option(
        None,
        "--context-parallel-size",
        "--cp",
        help="context-parallel GPUs per DP rank (default: EP/DP, or 1 without --ep)",
    )
    max_model_len: int | None = int_option(
        None,
        "--max-model-len",
        help="context length in tokens, prompt plus output (default: the engine's, 32768)",
    )


@dataclass(frozen=True)
class SchedulingOptions:
    """How many requests run and wait, how prompts are prefilled and cached, and how long
    steps, requests and start-up may take."""

    max_num_seqs: int = int_option(
        16,
        "--max-num-seqs",
        help="running sequences per DP rank (default: %(default)s)",
    )
    max_queued_requests: int = int_option(
        512,
        "--max-queued-requests",
        help="requests admitted beyond running capacity, waiting in the server's queue for a "
        "slot, before 429 (default: %(default)s)",
    )
    queue_timeout: float = float_option(
        300.0,
        "--queue-timeout",
        help="seconds an admitted request may wait for its first token (in the queue, then "
        "prefill) before it ends with 429 queue_timeout; 0 disables (default: %(default)s)",
    )
    clamp_max_tokens: bool = option(
        True,
        "--clamp-max-tokens",
        help="lower a max_tokens (max_completion_tokens, max_output_tokens, Anthropic's "
        "max_tokens) that does not fit after the prompt to the room --max-model-len leaves; the "
        "answer then ends with a length finish if it fills that room (agent CLIs that do not "
        "know the window ask for more than it leaves); --no-clamp-max-tokens refuses such a "
        "request with 400 context_length_exceeded instead, as OpenAI, Anthropic and vLLM do "
        "(default: on); a prompt that alone fills the window is refused either way",
        action=argparse.BooleanOptionalAction,
    )
    max_num_batched_tokens: int | None = int_option(
        None,
        "--max-num-batched-tokens",
        help="tokens per engine step, passed to DeepInfer (default: DeepInfer's)",
    )
    prefill_attempt_interval: int | None = int_option(
        None,
        "--prefill-attempt-interval",
        help="engine steps between the points where new prompts may be prefilled when every "
        "DP rank has one waiting (DEEPINFER_PREFILL_ATTEMPT_INTERVAL; default: that variable, "
        "else DeepInfer's 70); lower favours time to first token, higher favours throughput",
    )
    prefill_any_attempt_interval: int | None = int_option(
        None,
        "--prefill-any-attempt-interval",
        help="engine steps between the points where new prompts are prefilled when any DP rank "
        "has one waiting (DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL; default: that variable, else "
        "DeepInfer's 100)",
    )
    speculative_tokens: int | None = int_option(
        None,
        "--speculative-tokens",
        help="speculative decoding (DeepInfer's MTP): draft tokens the model proposes per "
        "sequence per decode step, verified in the same step, so one step can emit up to N+1 "
        "tokens; the answers are the same, only faster or slower. 0 turns it off "
        "(DEEPINFER_USE_NEXTN_DECODE; default: that variable, else 0 until a GPU run measures "
        "the gain)",
    )
    enable_prefix_caching: bool | None = option(
        None,
        "--enable-prefix-caching",
        help="reuse the KV cache and state of earlier requests' prompts for a new request that "
        "starts with the same tokens (agent turns resend the whole conversation), and route "
        "such requests to the DP rank that holds their prefix; --no-enable-prefix-caching "
        "turns it off (default: on for --engine simulated, off for --engine deepinfer until it "
        "is validated on GPUs)",
        action=argparse.BooleanOptionalAction,
    )
    prefix_cache_scope: Literal["key", "global"] = option(
        "key",
        "--prefix-cache-scope",
        help="who shares cached prompt prefixes: `key`, only requests authenticated with the "
        "same API key (another key's request never reuses, nor times, what one key sent); "
        "`global`, every request, for single-tenant deployments that want reuse across keys "
        "(a client can then learn whether another key sent a prompt from its cached_tokens "
        "and latency); either way a request's `cache_salt` keeps it apart from other salts "
        "(default: %(default)s)",
        choices=["key", "global"],
    )
    prefix_cache_retention_share: float = float_option(
        0.25,
        "--prefix-cache-retention-share",
        help="the share of a prefix-cache tier (the host tier's blocks, else the KV pool's) the "
        "prompts one partition (an API key with its cache_salt) asked to keep may pin, "
        "Anthropic's cache_control and OpenAI's prompt_cache_retention; a write beyond it is "
        "kept unpinned (default: %(default)s)",
    )
    kv_offload_host_gb: float | None = option(
        None,
        "--kv-offload-host-gb",
        help="host memory (GB, per DP rank) for a second prefix-cache tier: prompt prefixes "
        "evicted from the rank's KV pool are copied there instead of dropped, and a request "
        "that starts with one is restored from there when the copy back is faster than "
        "computing it; 0 turns it off (default: 64 for --engine simulated with the prefix "
        "cache on, 0 for --engine deepinfer until it is validated on GPUs)",
        type=float,
    )
    kv_offload_store: Literal["mooncake"] | None = option(
        None,
        "--kv-offload-store",
        help="a third prefix-cache tier shared by every server that names the same store: each "
        "cached prompt prefix is written there in the background, and a request that starts "
        "with one another replica or prefill server computed is restored from there through the "
        "host tier (it needs --kv-offload-host-gb); `mooncake`: Mooncake Store (the "
        "disaggregation extra), its master given by --kv-offload-store-master. Losing the store "
        "costs only misses (default: none)",
        choices=["mooncake"],
    )
    kv_offload_store_master: str | None = option(
        None,
        "--kv-offload-store-master",
        help="HOST:PORT of the store's master (`mooncake_master --rpc_port PORT`), with "
        "--kv-offload-store",
    )
    step_timeout: float = float_option(
        300.0,
        "--step-timeout",
        help="seconds a rank's loop may go without completing an engine step or iteration "
        "(busy or idle) before it is treated as failed (a hung engine); 0 disables "
        "(default: %(default)s)",
    )
    request_timeout: float = float_option(
        600.0,
        "--request-timeout",
        help="seconds a request may run before it is cancelled; 0 disables (default: %(default)s)",
    )
    startup_timeout: float = float_option(
        3600.0,
        "--startup-timeout",
        help="seconds every rank may take to become ready (default: %(default)s)",
    )
