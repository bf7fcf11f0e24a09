"""PromptRole: what DeepInfer's PROMPT engine does for decode servers, on its hooks.

DeepInfer 0.1.0 binds no sequence's block table to Python, so the role places each prompt in
blocks and a state slot it allocated itself: the sequence DeepInfer built (`add_request`
with `enqueue=False`) enters the scheduler through `Scheduler.fork_seq(blocks=...)`, whose
fork pins exactly those blocks and that slot and waits for its prefill (a fork's
`num_cached_tokens` is set back to 0, so the prefill computes the whole prompt into them;
DeepInfer's prefill keeps a waiting sequence's own non-empty block table). Forks enter at the
front of the waiting queue, so a batch is placed in reverse, and only when nothing waits.

After the prompt step `send_processed_prompts` (DeepInfer's hook for this) takes the
sequences out of the scheduler's `running` list, where a PROMPT engine leaves them, and holds
each prefilled one's blocks and slot (`disaggregation.held.HeldKV`) with a `KVTransferParams`
handoff for the driver; the hold ends in `Scheduler.free_seq` when a decode server releases
it or it times out. A PROMPT engine never finalizes its sequences: everything it allocated is
freed here.
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from deepinfer_server.disaggregation.handoff.params import KVTransferParams
from deepinfer_server.disaggregation.transfer.connector import PrefillConnector
from deepinfer_server.engines.deepinfer.cache_memory import CacheMemory, allocate, transfer_agent
from deepinfer_server.engines.deepinfer.role_grammar import build_grammar, without_grammar
from deepinfer_server.engines.role_settings import RoleSettings
from deepinfer_server.model.kv_block import BLOCK_SIZE, blocks_for

logger = logging.getLogger(__name__)

#: The branch name of placed prompts (no leading "_": DeepInfer's prefill keeps their table).
BRANCH = "pd_prompt"
#: fork_seq needs a computed prefix of at least one token, and a fork whose prompt is not
#: all but one token computed waits for a prefill: three tokens at least.
MIN_PROMPT_TOKENS = 3


@dataclass
class _Placed:
    seq: Any
    blocks: list[int]
    slot: int


class PromptRole(PrefillConnector):
    """The PROMPT engine's placement of prompts and hold of their KV."""

    def __init__(self, engine: Any, settings: RoleSettings) -> None:
        self._engine = engine
        self._settings = settings
        self.agent = transfer_agent(engine, settings)
        self.memory = CacheMemory(engine.driver_worker.cache_engine, self.agent)
        super().__init__(
            settings.bootstrap_port, settings.rank, settings.hold_timeout, settings.release_key
        )
        self.publish(self.agent.describe(self.memory.layout(settings)))
        #: Sequences DeepInfer built, not placed yet (in arrival order).
        self._queue: deque[Any] = deque()
        #: Placed sequences by seq_id, until their prompt step ends (or they are aborted).
        self._placed: dict[int, _Placed] = {}

    @property
    def busy(self) -> bool:
        """Whether prompts wait for placement (DeepInfer's scheduler does not know them)."""
        return bool(self._queue)

    # add_request

    def add(self, add: Any, args: tuple[Any, ...]) -> Any:
        """`LLMEngine.add_request(*args)` for a PROMPT engine: its answer is the prompt step's
        token, and the prompt is placed in blocks this role knows."""
        (user_id, request_id, params, prompt, images, arrival, _extra, _enqueue, chunks) = args
        params, so_args = without_grammar(_one_token(params))
        if images is not None:
            raise ValueError("a prefill server on DeepInfer's engine does not take images yet")
        if _field(params, "prompt_logprobs"):
            raise ValueError(
                "a prefill server on DeepInfer's engine computes no prompt logprobs "
                "(Scheduler.fork_seq refuses them)"
            )
        prompt = np.asarray(prompt)
        if prompt.size < MIN_PROMPT_TOKENS:
            raise ValueError(
                f"a prefill server needs a prompt of at least {MIN_PROMPT_TOKENS} tokens"
            )
        seq = add(user_id, request_id, params, prompt, None, arrival, None, False, chunks)
        if seq is None:
            return None
        usable = int(self._engine.cache_config.num_gpu_blocks) - 1
        if prompt.size > self._prompt_limit() or blocks_for(prompt.size) > usable:
            # Never placeable: DeepInfer's own path ends it ("prompt_length_exceeded").
            self._engine.scheduler.add_sequence(seq)
        elif so_args is not None:
            build_grammar(self._engine, seq, so_args, self._grammar_built)
        else:
            self._queue.append(seq)
        return seq

    def _grammar_built(self, seq: Any) -> None:
        """Queue a sequence whose matcher is attached; a failed build ends it as DeepInfer's
        own enqueue does (its prefill drops it with the grammar's finish)."""
        if seq.so_matcher.is_aborted():
            from deepinfer._C.engine import SequenceStatus

            seq.status = SequenceStatus.FINISHED_SO_FAILED
            self._engine.scheduler.add_sequence(seq)
            return
        self._queue.append(seq)

    def _prompt_limit(self) -> int:
        config = self._engine.scheduler_config
        limit = int(config.max_model_len)
        if not config.chunked_prefill:
            limit = min(limit, int(config.max_num_batched_tokens))
        return limit

    # step

    def place(self) -> None:
        """Place queued prompts while nothing waits in DeepInfer's queue and their blocks and
        state slots are free (a step's worth: its running slots and batched tokens)."""
        scheduler = self._engine.scheduler
        if not self._queue or scheduler.get_sum_prompt_len_waiting()[0]:
            return
        blocks_free = int(scheduler.get_num_free_gpu_blocks())
        slots_free = int(self._engine.state_manager.get_num_free_blocks())
        config = self._engine.scheduler_config
        budget = int(config.max_num_batched_tokens)
        batch: list[Any] = []
        while self._queue and len(batch) < int(config.max_num_seqs):
            seq = self._queue[0]
            length = int(seq.get_prompt_len())
            needed = blocks_for(length)
            if batch and length > budget:
                break
            if needed > blocks_free or slots_free < 1:
                break
            budget -= length
            blocks_free -= needed
            slots_free -= 1
            batch.append(self._queue.popleft())
        for seq in reversed(batch):
            self._place(seq)

    def _place(self, seq: Any) -> None:
        engine = self._engine
        needed = blocks_for(int(seq.get_prompt_len()))
        blocks = allocate(engine.block_manager, needed)
        (slot,) = allocate(engine.state_manager, 1)
        seq.num_cached_tokens = 1
        seq.state_id = slot
        fork = engine.scheduler.fork_seq(
            seq,
            np.asarray(blocks, dtype=np.int32),
            BRANCH,
            seq.sampling_params,
            seq.so_matcher,
            -1,
            -1,
            seq.seq_id,
            time.time() * 1000.0,  # milliseconds, as add_sequence stamps
        )
        fork.num_cached_tokens = 0
        seq.state_id = -1
        # The fork holds its own pins now.
        engine.block_manager.unpin_blocks(np.asarray(blocks, dtype=np.int32))
        engine.state_manager.unpin_blocks(np.asarray([slot], dtype=np.int32))
        self._placed[int(fork.seq_id)] = _Placed(fork, blocks, slot)

    def send_processed_prompts(self) -> None:
        """Take the prompt step's sequences out of `running`; hold the prefilled ones."""
        scheduler = self._engine.scheduler
        running = list(scheduler.running)
        if not running:
            return
        from deepinfer._C.engine import SequenceStatus

        ended = [seq for seq in running if seq.status != SequenceStatus.RUNNING]
        if len(ended) != len(running):
            scheduler.running = [seq for seq in running if seq.status == SequenceStatus.RUNNING]
        else:
            scheduler.running = []
        prefilled = (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH_CAPPED)
        for seq in ended:
            placed = self._placed.pop(int(seq.seq_id), None)
            length = int(seq.get_prompt_len())
            if placed is None or seq.status not in prefilled or seq.num_cached_tokens < length:
                scheduler.free_seq(seq)
                continue
            self._hold(placed, length)

    def _hold(self, placed: _Placed, length: int) -> None:
        seq = placed.seq
        transfer_id = secrets.token_hex(16)
        blocks = placed.blocks[: blocks_for(length)]
        self.keep(transfer_id, functools.partial(self._engine.scheduler.free_seq, seq))
        self.handoffs[seq.request_id] = KVTransferParams(
            remote_host=self.agent.host,
            remote_port=self.agent.port,
            remote_bootstrap_port=self.bootstrap.port,
            remote_dp_rank=self._settings.rank,
            remote_engine_id=self.engine_id,
            transfer_id=transfer_id,
            remote_block_ids=blocks,
            remote_kv_address=self.memory.kv_address,
            remote_state_address=self.memory.state_address,
            remote_state_slot=placed.slot,
            first_token_id=int(seq.data.get_token_ids()[length]),
            prompt_length=length,
            block_size=BLOCK_SIZE,
            kv_digest=self.memory.digest(blocks, placed.slot),
        )

    # abort

    def abort(self, request_ids: set[str]) -> int:
        """Drop queued prompts among `request_ids` (returns how many) and their handoffs."""
        for request_id in request_ids:
            self.handoffs.pop(request_id, None)
        before = len(self._queue)
        self._queue = deque(seq for seq in self._queue if seq.request_id not in request_ids)
        return before - len(self._queue)

    def abort_request(
        self, abort: Callable[[list[str]], tuple[int, int]], ids: list[str]
    ) -> tuple[int, int]:
        """`LLMEngine.abort_request(ids)` (DeepInfer's is `abort`) for a PROMPT engine: the
        queued prompts too, and the placed ones DeepInfer aborted are freed."""
        queued = self.abort(set(ids))
        found, tokens = abort(ids)
        self.free_aborted(set(ids))
        return found + queued, tokens

    def before_step(self) -> None:
        """Free released or expired holds and place the waiting prompts."""
        self.collect()
        self.place()

    def before_flush(self) -> None:
        """Free released or expired holds."""
        self.collect()

    def free_aborted(self, request_ids: set[str]) -> None:
        """Free placed prompts DeepInfer just aborted while they waited: its prefill drops
        them without freeing (a PROMPT engine's sequences are the caller's to free)."""
        from deepinfer._C.engine import SequenceStatus

        for seq_id, placed in list(self._placed.items()):
            seq = placed.seq
            if seq.request_id in request_ids and seq.status == SequenceStatus.FINISHED_ABORTED:
                self._engine.scheduler.free_seq(seq)
                del self._placed[seq_id]

    def close(self) -> None:
        """Stop the bootstrap port, free every hold and unregister the KV memory."""
        super().close()
        self.memory.close()


def _field(params: Any, name: str) -> Any:
    return params.get(name) if isinstance(params, dict) else getattr(params, name, None)


def _one_token(params: Any) -> Any:
    """The request's sampling parameters with `max_tokens` 1 (a copy when a dict)."""
    if params is None:
        return {"max_tokens": 1}
    if isinstance(params, dict):
        return {**params, "max_tokens": 1}
    params.max_tokens = 1
    return params
