"""CompletionRole: how DeepInfer's COMPLETION engine takes prompts a prefill server computed.

A request comes with its `KVTransferParams` handoff. DeepInfer builds the sequence
(`add_request` with `enqueue=False`); it waits here, in order and for at most the transfer
timeout, until blocks for its prompt and a state slot are free and the running cap allows.
Then the role reserves them (DeepInfer's block and state managers) and the seam pulls the
prompt's block rows and state row into them off the engine's thread
(`disaggregation.pulls.Pulls`). A pulled sequence enters as `Scheduler.fork_seq(blocks=...,
sp_token=<the prefill's first token>)` makes it: `prompted`, with that token forced; DeepInfer
admits it by cloning its state slot and its last block (its prompt's last token is computed
again, by the first decode step), and the role drops its own pins once the fork holds its
own, so a finished sequence frees everything (`finalize_seq`). A failed or timed-out pull
frees what it reserved and ends the request "kv_transfer_failed:<reason>"; blocks a started
pull may still write into are freed only when that pull has returned, those of a pull still
queued on its peer at once. A request from a peer that is sick (a pull from it timed out)
fails at once ("peer_unhealthy"). A pull is checked against the handoff's digest of its rows
(`CacheMemory.digest`): rows that are not those the prefill rank computed end the request
"kv_transfer_failed:kv_mismatch".
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from deepinfer_server.disaggregation.handoff.params import KVTransferParams
from deepinfer_server.disaggregation.transfer.agent import TransferError
from deepinfer_server.disaggregation.transfer.connector import DecodeConnector, transfer_failed
from deepinfer_server.engines.deepinfer.cache_memory import CacheMemory, allocate, transfer_agent
from deepinfer_server.engines.deepinfer.fork_seq import fork_seq
from deepinfer_server.engines.deepinfer.role_grammar import (
    GRAMMAR_FAILED,
    build_grammar,
    without_grammar,
)
from deepinfer_server.engines.role_settings import RoleSettings
from deepinfer_server.model.kv_block import blocks_for

#: The branch name of pulled sequences.
BRANCH = "pd_completion"


@dataclass
class _Pending:
    seq: Any
    params: KVTransferParams
    arrived: float
    deadline: float
    blocks: list[int] = field(default_factory=list)
    slot: int = 0
    #: The pull is running or done (its blocks and slot are reserved).
    pulling: bool = False
    #: The pull is done and checked: the sequence enters once its grammar is built.
    pulled: bool = False
    #: Its grammar's matcher is attached (or it has none).
    grammar_ready: bool = True
    #: The request ended (aborted, timed out) while its pull ran: free on its return.
    abandoned: bool = False


def _check_digest(
    memory: CacheMemory, params: KVTransferParams, blocks: list[int], slot: int
) -> None:
    """DeepInfer's KV is opaque bytes: the pulled rows' sampled windows must have the digest the
    prefill rank handed off (rows read from the wrong place, or overwritten, are caught here;
    a handoff without a digest is not checked)."""
    if params.kv_digest is None:
        return
    if memory.digest(blocks, slot) != params.kv_digest:
        raise TransferError(
            "kv_mismatch",
            "the pulled KV rows are not those the prefill server computed (their digest differs)",
        )


class CompletionRole(DecodeConnector):
    """The COMPLETION engine's admission and pulls of prefilled prompts."""

    def __init__(self, engine: Any, settings: RoleSettings) -> None:
        self._engine = engine
        self._timeout = settings.transfer_timeout
        self.agent = transfer_agent(engine, settings)
        super().__init__(self.agent)
        self.memory = CacheMemory(engine.driver_worker.cache_engine, self.agent)
        self.publish(self.agent.describe(self.memory.layout(settings)))
        self._pending: dict[str, _Pending] = {}
        #: Prompt tokens this engine computed: the last one of each pulled prompt.
        self.prompt_tokens_computed = 0

    @property
    def busy(self) -> bool:
        """Whether anything is still in flight, abandoned pulls included."""
        return bool(self._pending)

    def add(self, add: Any, args: tuple[Any, ...]) -> Any:
        """`LLMEngine.add_request(*args)` for a COMPLETION engine: the sequence waits for its
        KV here instead of in DeepInfer's queue."""
        (user_id, request_id, params, prompt, images, arrival, extra, _enqueue, _chunks) = args
        handoff = (extra or {}).get("kv_transfer_params")
        if handoff is None:
            raise ValueError(
                "a COMPLETION engine cannot prefill: the request needs the kv_transfer_params "
                "of a prefill server's answer"
            )
        if not isinstance(handoff, KVTransferParams):
            raise TypeError("kv_transfer_params must be a KVTransferParams")
        if images is not None:
            raise ValueError("a decode server on DeepInfer's engine does not take images yet")
        wants = params.get("prompt_logprobs") if isinstance(params, dict) else None
        if wants or getattr(params, "prompt_logprobs", False):
            raise ValueError(
                "a decode server computes no prompt logprobs: its prompt was computed elsewhere"
            )
        params, so_args = without_grammar(params)
        seq = add(user_id, request_id, params, prompt, None, arrival, None, False, None)
        if seq is None:
            return None
        if int(seq.get_prompt_len()) != handoff.prompt_length:
            raise ValueError("kv_transfer_params describe a prompt of another length")
        now = time.monotonic()
        pending = _Pending(seq, handoff, now, now + self._timeout)
        self._pending[request_id] = pending
        if so_args is not None:
            pending.grammar_ready = False
            build_grammar(self._engine, seq, so_args, self._grammar_built)
        return seq

    def _grammar_built(self, seq: Any) -> None:
        pending = self._pending.get(seq.request_id)
        if pending is None or pending.seq is not seq or pending.abandoned:
            return
        if seq.so_matcher.is_aborted():
            self.ended.append((seq.request_id, GRAMMAR_FAILED))
            self._end(pending)
            return
        pending.grammar_ready = True

    def abort(self, request_ids: set[str]) -> set[str]:
        """End the requests among `request_ids` that wait for their KV; returns them."""
        found: set[str] = set()
        for request_id in request_ids & self._pending.keys():
            pending = self._pending[request_id]
            if pending.abandoned:
                continue
            found.add(request_id)
            self._end(pending)
        return found

    def abort_request(
        self, abort: Callable[[list[str]], tuple[int, int]], ids: list[str]
    ) -> tuple[int, int]:
        """`LLMEngine.abort_request(ids)` (DeepInfer's is `abort`) for a COMPLETION engine:
        requests still waiting for their KV end here, the rest in DeepInfer."""
        waiting = self.abort(set(ids))
        rest = [rid for rid in ids if rid not in waiting]
        found, tokens = abort(rest) if rest else (0, 0)
        return found + len(waiting), tokens

    def before_step(self) -> None:
        """Admit, pull and enter what can go on (`advance`)."""
        self.advance()

    def before_flush(self) -> None:
        """Nothing: a flush admits no request."""

    def send_processed_prompts(self) -> None:
        """Nothing: DeepInfer calls it on PROMPT engines only."""

    def advance(self) -> None:
        """Before a step: pulled prompts enter the scheduler, failed and late ones end, and
        the waiting ones get room in order."""
        now = time.monotonic()
        for result in self.pulls.take_done():
            pending = self._pending.pop(result.request_id, None)
            if pending is None:
                continue
            if pending.abandoned:
                self._unreserve(pending)
            elif result.failure is not None:
                self._unreserve(pending)
                self._fail(pending, result.failure.reason)
            else:
                self.stats.bytes += result.nbytes
                self.stats.seconds.append(result.seconds)
                self.stats.wait_seconds.append(now - pending.arrived)
                pending.pulled = True
                self._pending[result.request_id] = pending
        for pending in list(self._pending.values()):
            if pending.pulled and pending.grammar_ready:
                del self._pending[pending.seq.request_id]
                self._enter(pending)
        for pending in list(self._pending.values()):
            if not pending.abandoned and pending.deadline <= now:
                self._fail(pending, "timeout" if pending.pulling else "no_kv_room")
                self._end(pending, timed_out=True)
        self._admit()

    def _enter(self, pending: _Pending) -> None:
        seq, params = pending.seq, pending.params
        engine = self._engine
        seq.num_cached_tokens = params.prompt_length
        seq.state_id = pending.slot
        fork_seq(
            engine.scheduler,
            seq,
            pending.blocks,
            BRANCH,
            seq,
            so_matcher=seq.so_matcher,
            sp_token=params.first_token_id,
        )
        seq.state_id = -1
        # The fork pinned the blocks and the slot itself.
        self._unreserve(pending)
        self.prompt_tokens_computed += 1

    def _admit(self) -> None:
        engine = self._engine
        scheduler = engine.scheduler
        cap = int(engine.scheduler_config.max_num_seqs)
        usable = int(engine.cache_config.num_gpu_blocks) - 1
        for pending in list(self._pending.values()):
            if pending.pulling or pending.abandoned:
                continue
            if not self.pulls.healthy(pending.params):
                self._fail(pending, "peer_unhealthy")
                self._end(pending)
                continue
            needed = blocks_for(pending.params.prompt_length)
            if needed + 1 > usable:
                self._fail(pending, "no_kv_room")
                self._end(pending)
                continue
            pulling = sum(p.pulling and not p.abandoned for p in self._pending.values())
            live = int(scheduler.get_num_unfinished_seqs()) + pulling
            if live >= cap:
                return
            # Room for the admission's copy of the last block and every live sequence's next
            # token; two state slots: this one and the admission's clone.
            if int(scheduler.get_num_free_gpu_blocks()) < needed + 1 + live:
                return
            if int(engine.state_manager.get_num_free_blocks()) < 2:
                return
            pending.blocks = allocate(engine.block_manager, needed)
            (pending.slot,) = allocate(engine.state_manager, 1)
            pending.pulling = True
            self.pulls.submit(
                pending.seq.request_id,
                pending.params,
                self.memory.pieces(pending.params, pending.blocks, pending.slot),
                functools.partial(
                    _check_digest, self.memory, pending.params, pending.blocks, pending.slot
                ),
            )

    def _end(self, pending: _Pending, timed_out: bool = False) -> None:
        """The request ends before its KV is in place: free what it holds now, or (a pull is
        running into its blocks) when the pull returns."""
        request_id = pending.seq.request_id
        if pending.pulling and not pending.pulled:
            if not self.pulls.abandon(request_id, timed_out):
                pending.abandoned = True
                return
            self._unreserve(pending)  # the pull never started
            pending.pulling = False
        del self._pending[request_id]
        if pending.pulled:
            self._unreserve(pending)  # its pull already told the prefill side
        else:
            self.pulls.release_only(pending.params)

    def _unreserve(self, pending: _Pending) -> None:
        if pending.blocks:
            self._engine.block_manager.unpin_blocks(np.asarray(pending.blocks, dtype=np.int32))
            pending.blocks = []
        if pending.slot:
            self._engine.state_manager.unpin_blocks(np.asarray([pending.slot], dtype=np.int32))
            pending.slot = 0

    def _fail(self, pending: _Pending, reason: str) -> None:
        self.stats.failures[reason] += 1
        self.ended.append((pending.seq.request_id, transfer_failed(reason)))

    def computed_prompt_tokens(self) -> int:
        """The last token of each pulled prompt (its fork computes it again)."""
        return self.prompt_tokens_computed

    def close(self) -> None:
        """Stop the transfer threads and unregister the KV memory."""
        super().close()
        self.memory.close()
