"""The simulated engine's prefill/decode roles, as DeepInfer 0.1.0's PROMPT and COMPLETION engines.

PROMPT (`PrefillRole`): the engine only prefills. Each sequence ends for its client after the
prompt step's token (its answer is that one token), and its KV blocks and state slot stay
pinned as a hold (`disaggregation.held.HeldKV`): DeepInfer's `send_processed_prompts` hook,
whose sequences are freed once the peer has them. Its provenance is written into the rank's
`KVMemory` and a `KVTransferParams` handoff is kept for the driver to report.

COMPLETION (`DecodeRole`): the engine only decodes. A request comes with a handoff; it waits
(in order, for at most the transfer timeout) until blocks for its prompt and a state slot are
free and the running cap allows, reserves them, and is pulled off the loop
(`disaggregation.pulls.Pulls`). A checked pull enters `running` with the prefill's token
forced as its first output, as `Scheduler.fork_seq(blocks, sp_token)` enters `prompted`: the
next decode step goes on from it, with no prompt step. A failed or timed-out pull frees what
it reserved and ends the request "kv_transfer_failed:<reason>"; blocks a started pull may
still write into are freed only when that pull has returned, those of a pull still queued on
its peer at once. A request from a peer that is sick (a pull from it timed out) fails at once
("peer_unhealthy").
"""

from __future__ import annotations

import functools
import secrets
import time
from dataclasses import dataclass

from deepinfer_server.disaggregation.handoff.params import KVTransferParams
from deepinfer_server.disaggregation.transfer.agent import TransferAgent
from deepinfer_server.disaggregation.transfer.connector import (
    DecodeConnector,
    PrefillConnector,
    transfer_failed,
)
from deepinfer_server.engines.role_settings import RoleSettings
from deepinfer_server.engines.simulated.kv_blocks import AllocStatus, KVBlocks
from deepinfer_server.engines.simulated.kv_memory import KVMemory, writer_id
from deepinfer_server.engines.simulated.kv_size import KVSize
from deepinfer_server.engines.simulated.outputs import OutputRecord
from deepinfer_server.engines.simulated.request_table import RequestTable
from deepinfer_server.engines.simulated.sequence import FINISH_LENGTH, FINISH_STOP, Sequence
from deepinfer_server.engines.simulated.state_slots import StateSlots
from deepinfer_server.engines.simulated.token_generator import TokenGenerator
from deepinfer_server.model.kv_block import BLOCK_SIZE, blocks_for


class PrefillRole(PrefillConnector):
    """The PROMPT engine's hold of prefilled prompts for decode servers."""

    def __init__(
        self,
        kv: KVBlocks,
        slots: StateSlots,
        agent: TransferAgent,
        settings: RoleSettings,
        size: KVSize | None = None,
    ) -> None:
        self._kv = kv
        self._slots = slots
        self._agent = agent
        self.memory = KVMemory(kv.cache_config.num_gpu_blocks, slots.size, agent, size)
        super().__init__(
            settings.bootstrap_port, settings.rank, settings.hold_timeout, settings.release_key
        )
        self.publish(
            agent.describe(self.memory.layout(settings.speculative_tokens, settings.checkpoint))
        )
        self._writer = writer_id(self.engine_id)
        self._rank = settings.rank

    def hold(self, sequence: Sequence) -> None:
        """`sequence` ended after its prompt step: pin its prompt's blocks and state slot for
        a decode server and describe them (called before the table frees them)."""
        if sequence.finish_reason not in (FINISH_STOP, FINISH_LENGTH) or not sequence.state_slot:
            return  # aborted, or never prefilled: nothing to hand off
        transfer_id = secrets.token_hex(16)
        owner = f"pd-hold:{transfer_id}"
        blocks = self._kv.table(sequence.request_id)[: blocks_for(len(sequence.prompt))]
        self._kv.share(owner, blocks)
        slot = sequence.state_slot
        self._slots.pin(slot)
        first_token = sequence.output[0]
        self.memory.write_prompt(blocks, sequence.prompt, slot, first_token, self._writer)

        def free() -> None:
            self._kv.free(owner)
            self._slots.release(slot)

        self.keep(transfer_id, free)
        self.handoffs[sequence.request_id] = KVTransferParams(
            remote_host=self._agent.host,
            remote_port=self._agent.port,
            remote_bootstrap_port=self.bootstrap.port,
            remote_dp_rank=self._rank,
            remote_engine_id=self.engine_id,
            transfer_id=transfer_id,
            remote_block_ids=blocks,
            remote_kv_address=self.memory.kv_address,
            remote_state_address=self.memory.state_address,
            remote_state_slot=slot,
            first_token_id=first_token,
            prompt_length=len(sequence.prompt),
            block_size=BLOCK_SIZE,
        )

    def close(self) -> None:
        """Stop the bootstrap port, free every hold and unregister the KV memory."""
        super().close()
        self.memory.close()


@dataclass
class _Pending:
    sequence: Sequence
    params: KVTransferParams
    arrived: float
    deadline: float
    #: The pull is running (its blocks and slot are reserved).
    pulling: bool = False
    #: The request ended (aborted, timed out) while its pull ran: free on its return.
    abandoned: bool = False


class DecodeRole(DecodeConnector):
    """The COMPLETION engine's admission and pulls of prefilled prompts."""

    def __init__(
        self,
        table: RequestTable,
        generator: TokenGenerator,
        agent: TransferAgent,
        max_num_seqs: int,
        settings: RoleSettings,
        size: KVSize | None = None,
    ) -> None:
        super().__init__(agent)
        self._table = table
        self._generator = generator
        self._kv = table.kv
        self._slots = table.cache.slots
        self.memory = KVMemory(self._kv.cache_config.num_gpu_blocks, self._slots.size, agent, size)
        self.publish(
            agent.describe(self.memory.layout(settings.speculative_tokens, settings.checkpoint))
        )
        self._max_num_seqs = max_num_seqs
        self._timeout = settings.transfer_timeout
        #: Requests whose KV is not in place yet, in arrival order.
        self._pending: dict[str, _Pending] = {}

    def __len__(self) -> int:
        """Requests waiting for KV room or pulling (abandoned pulls excluded)."""
        return sum(not p.abandoned for p in self._pending.values())

    @property
    def busy(self) -> bool:
        """Whether anything is still in flight, abandoned pulls included."""
        return bool(self._pending)

    def add(self, sequence: Sequence, params: KVTransferParams) -> None:
        now = time.monotonic()
        self._pending[sequence.request_id] = _Pending(sequence, params, now, now + self._timeout)

    def abort(self, request_ids: set[str]) -> list[Sequence]:
        """Abort the requests among `request_ids` that wait for their KV; returns them."""
        aborted: list[Sequence] = []
        for request_id in request_ids & self._pending.keys():
            pending = self._pending[request_id]
            if pending.abandoned:
                continue
            aborted.append(pending.sequence)
            self._end(pending)
        return aborted

    def step(self) -> list[OutputRecord]:
        """Take the finished pulls (checked ones enter `running` with their first token),
        fail the requests past their deadline, then reserve room for the waiting ones."""
        records: list[OutputRecord] = []
        now = time.monotonic()
        for result in self.pulls.take_done():
            pending = self._pending.get(result.request_id)
            if pending is None:
                continue
            if pending.abandoned:
                self._free(pending.sequence)
                del self._pending[result.request_id]
                continue
            del self._pending[result.request_id]
            if result.failure is not None:
                self._free(pending.sequence)
                records.append(self._failed(pending.sequence, result.failure.reason))
                continue
            self.stats.bytes += result.nbytes
            self.stats.seconds.append(result.seconds)
            self.stats.wait_seconds.append(now - pending.arrived)
            sequence = pending.sequence
            sequence.forced_token = pending.params.first_token_id
            self._table.running.append(sequence)
            records.extend(self._generator.generate(sequence, budget=1))
        for pending in list(self._pending.values()):
            if not pending.abandoned and pending.deadline <= now:
                reason = "timeout" if pending.pulling else "no_kv_room"
                records.append(self._failed(pending.sequence, reason))
                self._end(pending, timed_out=True)
        records.extend(self._admit())
        return records

    def _admit(self) -> list[OutputRecord]:
        """Reserve blocks and a state slot for the waiting requests, in order; a prompt that
        can never fit ends at once."""
        records: list[OutputRecord] = []
        for pending in list(self._pending.values()):
            if pending.pulling or pending.abandoned:
                continue
            sequence = pending.sequence
            if not self.pulls.healthy(pending.params):
                records.append(self._failed(sequence, "peer_unhealthy"))
                self._end(pending)
                continue
            running = len(self._table.running) + sum(p.pulling for p in self._pending.values())
            status = self._kv.can_prefill(len(sequence.prompt) + 1)
            if status is AllocStatus.NEVER:
                records.append(self._failed(sequence, "no_kv_room"))
                self._end(pending)
                continue
            if status is not AllocStatus.OK or not self._slots.free_count:
                return records
            if running >= self._max_num_seqs:
                return records
            sequence.state_slot = self._slots.take()
            self._kv.allocate(sequence.request_id, len(sequence.prompt) + 1)
            blocks = self._kv.table(sequence.request_id)[: blocks_for(len(sequence.prompt))]
            slot = sequence.state_slot
            params = pending.params
            self.pulls.submit(
                sequence.request_id,
                params,
                self.memory.pieces(params, blocks, slot),
                functools.partial(self.memory.check, params, blocks, slot, sequence.prompt),
            )
            pending.pulling = True
        return records

    def _end(self, pending: _Pending, timed_out: bool = False) -> None:
        """The request ends before its KV is in place: free what it holds now, or (a pull is
        running into its blocks) when the pull returns."""
        request_id = pending.sequence.request_id
        if pending.pulling:
            if not self.pulls.abandon(request_id, timed_out):
                pending.abandoned = True
                return
            self._free(pending.sequence)  # the pull never started
        del self._pending[request_id]
        self.pulls.release_only(pending.params)

    def _free(self, sequence: Sequence) -> None:
        self._kv.free(sequence.request_id)
        if sequence.state_slot:
            self._slots.release(sequence.state_slot)
            sequence.state_slot = 0

    def _failed(self, sequence: Sequence, reason: str) -> OutputRecord:
        self.stats.failures[reason] += 1
        return sequence.ignored_output(transfer_failed(reason))
