"""Construction of DeepInfer 0.1.0's LLMEngine in a rank process (`--engine deepinfer`).

Only rank processes import this module (through `DeepInferBackend.builder`), and only after the
rank environment was applied: the `deepinfer` package reads several variables at import. Every
EngineArgs field that matters is set on purpose here; `ENGINE_ARGS_FIELDS` lists them so a test
can check them against the package's dataclass.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from multiprocessing.process import BaseProcess
from typing import Any

from deepinfer_server.disaggregation.role import DisaggregationRole
from deepinfer_server.engines.backend import BuiltEngine, EngineSpec, SharedState
from deepinfer_server.engines.deepinfer.abilities import DeepInferAbilities
from deepinfer_server.engines.deepinfer.backend import DeepInferOptions
from deepinfer_server.engines.llm_engine_driver import LLMEngineDriver

logger = logging.getLogger(__name__)

#: The EngineArgs fields the server sets; the rest keep DeepInfer's defaults on purpose
#: (load_format "auto", seed 0, chunked_prefill off, no lookahead, ...).
ENGINE_ARGS_FIELDS = (
    "model",
    "tokenizer",
    "served_model_name",
    "trust_remote_code",
    "max_model_len",
    "data_parallel_size",
    "context_parallel_size",
    "expert_parallel_size",
    "engine_rank",
    "gpu_memory_utilization",
    "max_num_seqs",
    "max_num_batched_tokens",
    "stop_preempted_request",
    "disable_log_stats",
    "engine_type",
)

#: `--disaggregation-mode` -> the name of DeepInfer's EngineType.
ENGINE_TYPES = {
    DisaggregationRole.NULL: "NORMAL",
    DisaggregationRole.PREFILL: "PROMPT",
    DisaggregationRole.DECODE: "COMPLETION",
}

#: Names of the processes LLMEngine starts itself and keeps no handle to.
ENGINE_CHILD_PREFIXES = ("worker-cp", "multi-modal-worker")

_PROGRESS_INTERVAL_SECONDS = 60.0


def engine_args_kwargs(spec: EngineSpec) -> dict[str, Any]:
    """The keyword arguments of `EngineArgs` for this rank (DeepInfer is imported)."""
    from deepinfer.engine.engine_type import EngineType

    assert spec.model is not None, "the deepinfer engine needs a local checkpoint directory"
    options = spec.engine_options
    assert isinstance(options, DeepInferOptions)
    return {
        "model": spec.model,
        "tokenizer": spec.model,
        "served_model_name": spec.served_model_name,
        "trust_remote_code": options.trust_remote_code,
        # DeepInfer's own default is 4096, not the model's: always pass the server's.
        "max_model_len": spec.max_model_len,
        "data_parallel_size": spec.data_parallel_size,
        "context_parallel_size": spec.context_parallel_size,
        "expert_parallel_size": spec.expert_parallel_size,
        "engine_rank": spec.rank,
        "gpu_memory_utilization": options.gpu_memory_utilization,
        "max_num_seqs": spec.max_num_seqs,
        "max_num_batched_tokens": spec.max_num_batched_tokens,
        # A plain request preempted for lack of KV cache is recomputed (no duplicate tokens)
        # rather than ended with "insufficient_system_resource"; the server clamps max_tokens
        # to the context, so recomputation can never exceed the prompt limit. A structured
        # request ends all the same once its grammar has started (every one past its prefill:
        # scheduler.hpp `_preempt`): DeepInfer cannot recompute a grammar's state, and the
        # client gets a 503 insufficient_system_resource. A COMPLETION engine has no prefill to
        # recompute with: DeepInfer requires it to end them.
        "stop_preempted_request": spec.disaggregation_mode is DisaggregationRole.DECODE,
        "disable_log_stats": options.disable_log_stats,
        "engine_type": EngineType[ENGINE_TYPES[spec.disaggregation_mode]],
    }


def _report_progress(rank: int, done: threading.Event) -> None:
    started = time.monotonic()
    while not done.wait(_PROGRESS_INTERVAL_SECONDS):
        logger.info(
            "[startup] rank %d: still constructing the engine after %.0fs (loading weights, "
            "JIT-compiling kernels or warming up)",
            rank,
            time.monotonic() - started,
        )


def engine_children() -> list[BaseProcess]:
    """The CP workers and the multimodal worker this process started (snapshot)."""
    return [
        child
        for child in multiprocessing.active_children()
        if child.name.startswith(ENGINE_CHILD_PREFIXES)
    ]


def _engine_class(spec: EngineSpec, base: type[Any]) -> type[Any]:
    """DeepInfer's LLMEngine, or the server's subclass of it for the rank's role or cache."""
    if spec.disaggregation_mode.disaggregated:
        from deepinfer_server.engines.deepinfer.role_engines import role_engine
        from deepinfer_server.engines.role_settings import RoleSettings

        return role_engine(base, spec.disaggregation_mode, RoleSettings.of(spec))
    if spec.enable_prefix_caching:
        from deepinfer_server.engines.deepinfer.prefix_engine import (
            prefix_cache_settings,
            prefix_caching_engine,
        )

        return prefix_caching_engine(base, prefix_cache_settings(spec))
    return base


def build(spec: EngineSpec, shared: SharedState | None) -> BuiltEngine:
    """Construct the rank's LLMEngine; returns its driver and the children to watch."""
    del shared
    logger.info(
        "[startup] rank %d: importing DeepInfer (CUDA_VISIBLE_DEVICES=%s)",
        spec.rank,
        spec.environment.get("CUDA_VISIBLE_DEVICES"),
    )
    from deepinfer._C.engine import RequestOutput
    from deepinfer.engine.arg_utils import EngineArgs
    from deepinfer.engine.llm_engine import LLMEngine

    engine_class = _engine_class(spec, LLMEngine)
    args = EngineArgs(**engine_args_kwargs(spec))
    logger.info(
        "[startup] rank %d: constructing LLMEngine (weights, JIT kernels, warm-up; the first "
        "start can take many minutes)",
        spec.rank,
    )
    done = threading.Event()
    threading.Thread(target=_report_progress, args=(spec.rank, done), daemon=True).start()
    try:
        engine = engine_class.from_engine_args(args)
    finally:
        done.set()
    children = engine_children()
    logger.info(
        "[startup] rank %d: engine constructed; watching %s",
        spec.rank,
        ", ".join(child.name for child in children) or "no child processes",
    )
    abilities = _abilities(spec, engine)
    driver = LLMEngineDriver(
        engine, RequestOutput, abilities, count_drafts=spec.speculative_tokens > 0
    )
    connector = abilities.connector
    return BuiltEngine(
        driver, children, bootstrap_port=connector.bootstrap_port, layout=connector.layout
    )


def _abilities(spec: EngineSpec, engine: Any) -> DeepInferAbilities:
    """What the driver reads of the engine `_engine_class` built for `spec`: its role's
    connector, or its prefix cache."""
    if spec.disaggregation_mode.disaggregated:
        return DeepInferAbilities(engine, connector=engine.role)
    if spec.enable_prefix_caching:
        return DeepInferAbilities(engine, prefix_cache=engine.prefix_cache)
    return DeepInferAbilities(engine)
