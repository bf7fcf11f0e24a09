"""KVMemory: the simulated engine's KV cache as real bytes, for prefill/decode disaggregation.

The simulated model computes nothing, so what a position of the KV cache holds is its
provenance: the token it was computed from and the engine that computed it (two int32 per
position, `block_size` positions per block, indexed by block ID as `KVBlocks` hands them out).
A state slot holds the prompt's length, the first token sampled after it and the writer. A
prefill rank writes these at its prompt step; a decode rank's pull copies them with the
transfer library into its own blocks and slot and checks that every position it will attend
to holds exactly its prompt's tokens, written by the prefill engine that promised them.

Given a `KVSize` (`kv_size`: the real model's bytes per block and per state slot), each block
and slot is a row of that many bytes, the provenance at its start: a transfer moves as many
bytes as DeepInfer's would. Without one the rows are the provenance alone.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from deepinfer_server.disaggregation.handoff.params import KVTransferParams
from deepinfer_server.disaggregation.layout import KVLayout
from deepinfer_server.disaggregation.transfer.agent import TransferAgent, TransferError
from deepinfer_server.engines.simulated.kv_size import KVSize
from deepinfer_server.model.kv_block import BLOCK_SIZE

_STATE_FIELDS = 4
_INT32 = 4


def writer_id(engine_id: str) -> int:
    """The int32 an engine's ID is recorded as."""
    return int(engine_id, 16) & 0x7FFFFFFF


class KVMemory:
    """One rank's KV positions and state slots, registered with its transfer agent."""

    def __init__(
        self, num_blocks: int, num_slots: int, agent: TransferAgent, size: KVSize | None = None
    ) -> None:
        provenance = BLOCK_SIZE * 2 * _INT32
        block_bytes = max(provenance, size.block_bytes if size else 0)
        state_bytes = max(_STATE_FIELDS * _INT32, size.state_bytes if size else 0)
        #: The registered rows: one per block, one per state slot.
        self.blocks: npt.NDArray[np.uint8] = np.zeros((num_blocks, block_bytes), dtype=np.uint8)
        self.slots: npt.NDArray[np.uint8] = np.zeros((num_slots, state_bytes), dtype=np.uint8)
        #: Views of their starts: each position's (token, writer), each slot's fields.
        self.kv = _int32_view(self.blocks, provenance).reshape(num_blocks, BLOCK_SIZE, 2)
        self.state = _int32_view(self.slots, _STATE_FIELDS * _INT32)
        self._agent = agent
        agent.register(self.kv_address, self.blocks.nbytes)
        agent.register(self.state_address, self.slots.nbytes)

    @property
    def kv_address(self) -> int:
        return int(self.blocks.ctypes.data)

    @property
    def state_address(self) -> int:
        return int(self.slots.ctypes.data)

    def layout(self, speculative_tokens: int, checkpoint: str | None) -> KVLayout:
        """These rows as the layout handshake describes them."""
        return KVLayout(
            engine="simulated",
            checkpoint=checkpoint,
            block_size=BLOCK_SIZE,
            block_bytes=self.blocks[0].nbytes,
            state_bytes=self.slots[0].nbytes,
            dtype=str(self.kv.dtype),
            speculative_tokens=speculative_tokens,
        )

    def close(self) -> None:
        self._agent.unregister(self.kv_address)
        self._agent.unregister(self.state_address)

    # The prefill side

    def write_prompt(
        self, blocks: list[int], prompt: list[int], slot: int, first_token: int, writer: int
    ) -> None:
        """Record a computed prompt in `blocks` and its state in `slot`."""
        flat = self.kv[blocks].reshape(-1, 2)
        flat[: len(prompt), 0] = prompt
        flat[: len(prompt), 1] = writer
        self.kv[blocks] = flat.reshape(len(blocks), BLOCK_SIZE, 2)
        self.state[slot] = (len(prompt), first_token, writer, 0)

    # The decode side

    def pieces(
        self, params: KVTransferParams, blocks: list[int], slot: int
    ) -> list[tuple[int, int, int]]:
        """(local, remote, length) for every block of the prompt and its state slot."""
        block_bytes = self.blocks[0].nbytes
        pieces = [
            (
                self.kv_address + local * block_bytes,
                params.remote_kv_address + remote * block_bytes,
                block_bytes,
            )
            for local, remote in zip(blocks, params.remote_block_ids, strict=True)
        ]
        slot_bytes = self.slots[0].nbytes
        pieces.append(
            (
                self.state_address + slot * slot_bytes,
                params.remote_state_address + params.remote_state_slot * slot_bytes,
                slot_bytes,
            )
        )
        return pieces

    def check(
        self, params: KVTransferParams, blocks: list[int], slot: int, prompt: list[int]
    ) -> None:
        """Raise TransferError("kv_mismatch") unless the pulled KV is exactly `prompt`'s,
        written by the prefill engine `params` name, and its state promises the same."""
        writer = writer_id(params.remote_engine_id)
        flat = self.kv[blocks].reshape(-1, 2)[: len(prompt)]
        tokens_ok = bool(np.array_equal(flat[:, 0], np.asarray(prompt, dtype=np.int32)))
        writers_ok = bool((flat[:, 1] == writer).all())
        length, first_token, state_writer, _ = (int(v) for v in self.state[slot])
        state_ok = (length, first_token, state_writer) == (
            len(prompt),
            params.first_token_id,
            writer,
        )
        if not (tokens_ok and writers_ok and state_ok):
            raise TransferError(
                "kv_mismatch",
                "the pulled KV does not hold this prompt as its prefill engine computed it",
            )


def _int32_view(rows: npt.NDArray[np.uint8], nbytes: int) -> npt.NDArray[np.int32]:
    """The first `nbytes` of every row of `rows`, as int32 (a view: writes land in the rows)."""
    return rows[:, :nbytes].view(np.int32)
