"""`deepinfer.worker.worker` in the twin: DeepInfer's GPU worker with a CPU model.

`LLMEngine._init_workers` imports `EngineCallbacks` and `Worker` from this module. The step
follows `Worker.execute_model_step` (worker/worker.py) exactly: forward the current step,
post-process the previous one, correct the current step's metadata under zero-overhead
scheduling with DeepInfer's own `prepare_zos_inputs` / `update_metadata_for_sampling_zos`,
sample, `pre_sampler_sync`, then post-process at once (prompt steps, ZOS off) or defer to the
next step (ZOS decode steps). Post-processing is the engine's own `post_process` (scheduler
`process_outputs`, `build_request_outputs`). Distributed set-up is DeepInfer's own
(`_init_distributed_environment`: a gloo world, every group on gloo through the twin's
platform). The KV cache and state slots (`kv.py`) hold, per position, the token a forward wrote
there, in as many blocks and slots as DeepInfer computes for the checkpoint's layout (block
counts from the twin's `DEEPINFER_TWIN_KV_BLOCKS`): before each forward the worker checks that
every scheduled sequence sees exactly its own token prefix and a state at the right position
(`DEEPINFER_TWIN_CHECK_KV`: "1", the default, raises on a violation in the driver; "0" only
records it; every CP worker records its own, read with `twin_kv_report`). CP workers receive
the step's reads and writes from the driver, as DeepInfer's receive the model inputs.
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from deepinfer import envs
from deepinfer._C.engine import (
    SchedulerOutputs,
    clone_and_zero_states_and_blocks,
    update_prompt_logprobs,
)
from deepinfer.logger import init_logger
from deepinfer.model_executor.parallel_utils.parallel_state import PG, cp_broadcast_object
from deepinfer.sequence import DeepInferTopkInfo, MTPPredictInfo, SampledInfo, SamplerOutput
from deepinfer.worker.base import _init_distributed_environment, set_pdeathsig
from deepinfer.worker.cache_engine import CacheEngine
from deepinfer.worker.zos_status import WorkerStepState

from deepinfer_twin.kv import Access, TwinKV
from deepinfer_twin.model import TwinModel

try:
    from deepinfer._C import twin_probe
except ImportError as exc:  # a twin built before the probe existed
    raise ImportError(
        "this DeepInfer twin has no twin_probe: rebuild it with scripts/build_deepinfer_twin.py"
    ) from exc

logger = init_logger(__name__)


@dataclass
class EngineCallbacks:
    """Callbacks injected by the engine, invoked on the driver worker only (as DeepInfer's)."""

    post_process_fn: Callable[[WorkerStepState], np.ndarray] | None = None
    pre_sampler_sync_fn: Callable[[SchedulerOutputs], None] | None = None


class Worker:
    """The driver worker of one DP rank (CP = 1)."""

    def __init__(
        self,
        engine_type: Any,
        model_config: Any,
        parallel_config: Any,
        scheduler_config: Any,
        cache_config: Any,
        local_rank: int,
        cp_rank: int,
        distributed_init_method: str,
        is_driver_worker: bool = False,
        engine_callbacks: EngineCallbacks | None = None,
    ) -> None:
        self.engine_type = engine_type
        self.model_config = model_config
        self.parallel_config = parallel_config
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.local_rank = local_rank
        self.cp_rank = cp_rank
        self.is_driver_worker = is_driver_worker
        self.engine_callbacks = engine_callbacks
        self.global_rank = (
            parallel_config.engine_rank * parallel_config.context_parallel_size + cp_rank
        )
        # MTP: decode steps verify the drafts the twin's model proposed (`TwinModel.verify`).
        self.nextn = envs.DEEPINFER_USE_NEXTN_DECODE
        self.prev_step_state: WorkerStepState | None = None
        self.decode_perf_curve: list[tuple[int, float]] = []
        self.cache_engine: TwinKV | None = None
        self.raise_on_violation = os.environ.get("DEEPINFER_TWIN_CHECK_KV", "1") != "0"
        self.model: TwinModel | None = None
        _init_distributed_environment(parallel_config, cp_rank, distributed_init_method)
        if not is_driver_worker:
            self._slave_loop()

    # What LLMEngine calls through `_run_workers`

    def run_workers(
        self, method: str, driver_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> Any:
        """As WorkerBase.run_workers: the method name goes to the CP workers first."""
        cp_group = PG.cpu_cp_group
        if cp_group and cp_group.size() > 1:
            cp_broadcast_object((method, kwargs))
        return getattr(self, method)(**(driver_kwargs or {}), **kwargs)

    def _slave_loop(self) -> None:
        """A CP worker (WorkerBase.start_slave_worker_loop): it dies with its parent and runs
        what the driver broadcasts; `stop` ends the process."""
        set_pdeathsig(signal.SIGKILL)
        while True:
            method, kwargs = cp_broadcast_object(None)
            getattr(self, method)(**kwargs)

    def load_model(self, skip_load: bool = False) -> None:
        del skip_load
        self.model = TwinModel(
            self.model_config.model, self.model_config.get_vocab_size(), eos_id=1
        )

    def profile_num_available_blocks(self) -> int:
        """Blocks for the twin's "GPU": DEEPINFER_TWIN_KV_BLOCKS, else room for every sequence
        at full length; summed over the world and rounded as DeepInfer does (base.py)."""
        block_size = self.cache_config.block_size
        per_seq = math.ceil(self.model_config.runtime_max_model_len / block_size) + 1
        default = self.model_config.max_num_seqs * per_seq + 1
        blocks = int(os.environ.get("DEEPINFER_TWIN_KV_BLOCKS", default))
        total = torch.tensor(blocks, dtype=torch.int64)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=PG.world_group())
        num_gpu_blocks = int(total.item()) // PG.world_group().size() // 2 * 2
        self.cache_config.num_gpu_blocks = num_gpu_blocks
        return num_gpu_blocks

    def init_cache_engine(self) -> None:
        state_shape = CacheEngine.get_state_shape(
            self.model_config.model_cfg.gpt, self.model_config.max_num_seqs
        )
        num_state_seqs = int(state_shape[0])
        self.cache_engine = TwinKV(
            self.cache_config.num_gpu_blocks,
            num_state_seqs,
            self.cache_config.block_size,
            envs.DEEPINFER_MAX_BACKTRACKING_TOKENS,
        )
        self.cache_config.num_state_seqs = num_state_seqs
        self.cache_config.bytes_of_state_per_seqs = self.cache_engine.gpu_states[0].nbytes
        self.cache_config.bytes_per_block = self.cache_engine.gpu_blocks[0].nbytes

    def warm_up_model(self, *, capture_max_graph_only: bool = False) -> None:
        del capture_max_graph_only
        self.decode_perf_curve = []

    def clone_and_zero_states_and_blocks_on_default_stream(
        self,
        clone_states: np.ndarray,
        clone_blocks: np.ndarray,
        zero_states: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        assert self.cache_engine is not None
        return clone_and_zero_states_and_blocks(
            self.cache_engine.gpu_states,
            self.cache_engine.gpu_blocks,
            clone_states,
            clone_blocks,
            zero_states,
        )

    def twin_kv_run(self, accesses: list[Access]) -> list[str]:
        """Check and write one step's KV and state accesses on this worker's cache."""
        assert self.cache_engine is not None
        return self.cache_engine.run(accesses)

    def twin_kv_report(self) -> list[str]:
        """Every CP worker's violations so far (collective over the CP group)."""
        assert self.cache_engine is not None
        own = [f"cp{self.cp_rank}: {problem}" for problem in self.cache_engine.violations]
        cp_group = PG.cpu_cp_group
        if not cp_group or cp_group.size() == 1:
            return own
        gathered: list[list[str] | None] = [None] * cp_group.size()
        dist.all_gather_object(gathered, own, group=cp_group)
        return [problem for part in gathered for problem in part or []]

    def stop(self) -> None:
        """WorkerBase.stop: two world barriers, the broadcast queue, then the group."""
        dist.barrier()
        dist.barrier()
        PG.cleanup_shm_broadcast()
        dist.destroy_process_group()
        if not self.is_driver_worker:
            os._exit(0)

    # The step (worker.py execute_model_step)

    @torch.inference_mode()
    def execute_model_step(
        self,
        is_prompt: bool,
        is_placeholder: bool,
        seq_metadata_list: list[Any] | None = None,
        scheduler_outputs: Any = None,
    ) -> np.ndarray:
        if not self.is_driver_worker:
            return np.empty(0, dtype=np.uint64)  # CP followers: the forward's collectives only
        assert self.engine_callbacks is not None and self.model is not None
        metadata = list(seq_metadata_list or [])
        # 2. post-process the previous step
        request_outputs = self._post_process_step(self.prev_step_state)
        # 3. correct the current step's metadata with the previous step's tokens (ZOS)
        prev = self.prev_step_state
        if not is_placeholder and prev is not None and not prev.is_placeholder:
            remap_cpu, seqlens_q_cpu, has_overlap = _zos_remap(metadata, prev.seq_metadata_list)
            if has_overlap:
                scheduler_outputs.update_metadata_for_sampling_zos(
                    metadata, seqlens_q_cpu, remap_cpu, self.nextn
                )
        seqs = list(scheduler_outputs.scheduled_seqs)
        if not is_placeholder:
            self._forward_kv(metadata, seqs, is_prompt)
        sampler_output = (
            SamplerOutput(post_funcs=[])
            if is_placeholder
            else self._sample(metadata, seqs, is_prompt)
        )
        self.engine_callbacks.pre_sampler_sync_fn(scheduler_outputs)
        for seq in scheduler_outputs.finished_seqs:
            self.model.forget(seq.request_id, seq.seq_id)
        state = WorkerStepState(
            seq_metadata_list=metadata,
            scheduler_outputs=scheduler_outputs,
            sampler_output=sampler_output,
            is_prompt=is_prompt,
            is_placeholder=is_placeholder,
            sample_end_evt=torch.cuda.Event(enable_timing=True),
        )
        # 4. prompt steps and non-ZOS steps at once; ZOS decode steps with the next step
        if is_prompt or not envs.DEEPINFER_ZERO_OVERHEAD_SCHEDULING:
            request_outputs = np.concatenate([request_outputs, self._post_process_step(state)])
            self.prev_step_state = None
        else:
            self.prev_step_state = state
        return request_outputs

    def flush_inflight_reqs(self) -> np.ndarray:
        if not self.is_driver_worker:
            return np.empty(0, dtype=np.uint64)
        request_outputs = self._post_process_step(self.prev_step_state)
        self.prev_step_state = None
        return request_outputs

    def _forward_kv(self, metadata: list[Any], seqs: list[Any], is_prompt: bool) -> None:
        """What the forward reads (checked) and writes, on every CP worker. A decode step with
        drafts writes them after the sequence's tokens: the accepted ones are read as its
        tokens by the next step, the rejected ones are written over."""
        assert self.model is not None
        drafting = self.nextn > 0 and not is_prompt
        accesses = [
            Access(
                request_id=seq.request_id,
                state_id=int(seq.state_id),
                block_table=list(twin_probe.block_table(seq)),
                start=int(meta.seqlen_k) - int(meta.seqlen_q),
                end=int(meta.seqlen_k),
                tokens=list(seq.data.get_token_ids())
                + (self.model.draft_tokens(seq, int(meta.seqlen_q) - 1) if drafting else []),
            )
            for meta, seq in zip(metadata, seqs, strict=True)
        ]
        if not accesses:
            return
        cp_group = PG.cpu_cp_group
        if cp_group and cp_group.size() > 1:
            cp_broadcast_object(("twin_kv_run", {"accesses": accesses}))
        found = self.twin_kv_run(accesses)
        if found and self.raise_on_violation:
            raise AssertionError("the twin's KV check failed: " + "; ".join(found))

    def _sample(self, metadata: list[Any], seqs: list[Any], is_prompt: bool) -> SamplerOutput:
        assert self.model is not None
        if self.nextn > 0:
            if not is_prompt:
                return self._verify(metadata, seqs)
            for seq in seqs:
                self.model.proposed_none(seq)
        tokens, logprobs, top_ids, top_values, so_status = self.model.sample(
            metadata, seqs, is_prompt
        )
        count = len(tokens)
        topk = max((len(ids) for ids in top_ids), default=0)
        top = DeepInferTopkInfo()
        if topk:
            padded_ids = [ids + [0] * (topk - len(ids)) for ids in top_ids]
            padded_values = [values + [-9999.0] * (topk - len(values)) for values in top_values]
            top = DeepInferTopkInfo(
                topk=topk,
                logps=torch.tensor(padded_values, dtype=torch.float),
                tokens=torch.tensor(padded_ids, dtype=torch.int32),
            )
        sampled = SampledInfo(
            bs=count,
            token_ids=torch.tensor(tokens, dtype=torch.int32),
            token_logprobs=torch.tensor(logprobs, dtype=torch.float32),
            topk_tokens=top,
        )
        output = SamplerOutput(sampled_token=sampled, so_status=so_status, post_funcs=[])
        if is_prompt:
            output.prompt_logprobs = self.model.prompt_logprobs(seqs)
        else:
            output.num_generated_tokens = [count]
            output.num_verified_tokens = [count]
        return output

    def _verify(self, metadata: list[Any], seqs: list[Any]) -> SamplerOutput:
        """A decode step with drafts, in the layout of DeepInfer's MTP sampler: the step's own
        tokens per sequence, the verified drafts flat over the step's positions (from each
        sequence's `first_token_positions`, -1 from the first rejected one), the next drafts."""
        assert self.model is not None
        steps = [
            self.model.verify(meta, seq, self.nextn)
            for meta, seq in zip(metadata, seqs, strict=True)
        ]
        topk = max((len(ids) for step in steps for ids in step.top_ids), default=0)
        first_positions, flat_ids, flat_logprobs = [], [], []
        flat_top_ids: list[list[int]] = []
        flat_top_values: list[list[float]] = []
        for meta, step in zip(metadata, steps, strict=True):
            first_positions.append(len(flat_ids))
            width = int(meta.seqlen_q)
            accepted = len(step.tokens) - 1
            for index in range(width):
                ok = index < accepted
                flat_ids.append(step.tokens[index] if ok else -1)
                flat_logprobs.append(step.logprobs[index] if ok else 0.0)
                ids = step.top_ids[index] if ok else []
                values = step.top_values[index] if ok else []
                flat_top_ids.append(ids + [0] * (topk - len(ids)))
                flat_top_values.append(values + [-9999.0] * (topk - len(values)))
        golden_top_ids = [step.top_ids[-1] + [0] * (topk - len(step.top_ids[-1])) for step in steps]
        golden_top_values = [
            step.top_values[-1] + [-9999.0] * (topk - len(step.top_values[-1])) for step in steps
        ]

        def top(ids: list[list[int]], values: list[list[float]]) -> DeepInferTopkInfo:
            if not topk:
                return DeepInferTopkInfo()
            return DeepInferTopkInfo(
                topk=topk,
                logps=torch.tensor(values, dtype=torch.float),
                tokens=torch.tensor(ids, dtype=torch.int32),
            )

        count = len(steps)
        sampled = SampledInfo(
            bs=count,
            token_ids=torch.tensor([step.tokens[-1] for step in steps], dtype=torch.int32),
            token_logprobs=torch.tensor([step.logprobs[-1] for step in steps], dtype=torch.float32),
            topk_tokens=top(golden_top_ids, golden_top_values),
        )
        verified = SampledInfo(
            bs=count,
            nextn=self.nextn,
            is_verified_token=True,
            token_ids=torch.tensor(flat_ids, dtype=torch.int32),
            token_logprobs=torch.tensor(flat_logprobs, dtype=torch.float32),
            topk_tokens=top(flat_top_ids, flat_top_values),
        )
        accepted_counts = [len(step.tokens) - 1 for step in steps]
        return SamplerOutput(
            sampled_token=sampled,
            verified_tokens=verified,
            first_token_positions=torch.tensor(first_positions, dtype=torch.int32),
            predict_tokens=MTPPredictInfo(
                token_ids=torch.tensor([step.drafts for step in steps], dtype=torch.int32)
            ),
            so_status=[step.so_status for step in steps],
            num_generated_tokens=[count + sum(accepted_counts)],
            num_verified_tokens=[count + sum(int(m.seqlen_q) - 1 for m in metadata)],
            num_accepted_tokens_gpu=torch.tensor(accepted_counts, dtype=torch.int32),
            post_funcs=[],
        )

    def _post_process_step(self, step_state: WorkerStepState | None) -> np.ndarray:
        if step_state is None:
            return np.empty(0, dtype=np.uint64)
        output = step_state.sampler_output
        for function in output.post_funcs or []:
            function()
        if output.post_funcs:
            output.post_funcs.clear()
        if step_state.is_prompt and not step_state.is_placeholder:
            output.prompt_logprobs = update_prompt_logprobs(
                step_state.seq_metadata_list, output.prompt_logprobs
            )
        assert self.engine_callbacks is not None and self.engine_callbacks.post_process_fn
        return self.engine_callbacks.post_process_fn(step_state)


def _zos_remap(metadata: list[Any], previous: list[Any]) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """`prepare_zos_inputs` (csrc/engine/zos.cpp 142-196) for nextn = 0, in unpinned memory.

    DeepInfer's function allocates its result in pinned host memory, which a CPU build of torch
    cannot provide; the remap rule is the same: the previous batch's index of each current
    sequence (by seq_id, placeholders excluded), with the current seqlen_q values.
    """
    same_order = len(metadata) == len(previous)
    remap = [-1] * len(metadata)
    if same_order:
        for index, (current, prior) in enumerate(zip(metadata, previous, strict=True)):
            if prior.is_placeholder or current.seq_id != prior.seq_id:
                same_order = False
                break
            remap[index] = index
    has_overlap = same_order and bool(metadata)
    if not same_order:
        prior_index = {
            prior.seq_id: index for index, prior in enumerate(previous) if not prior.is_placeholder
        }
        for index, current in enumerate(metadata):
            remap[index] = prior_index.get(current.seq_id, -1)
            has_overlap |= remap[index] >= 0
    seqlens_q = [int(current.seqlen_q) for current in metadata]
    return (
        torch.tensor(remap, dtype=torch.int32),
        torch.tensor(seqlens_q, dtype=torch.int32),
        has_overlap,
    )
