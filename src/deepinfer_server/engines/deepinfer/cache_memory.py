"""CacheMemory: a DeepInfer rank's KV blocks and state slots as the transfer library sees them.

DeepInfer's cache engine (`deepinfer/worker/cache_engine.py`, CP = 1: the driver worker's own)
keeps every KV block as one row of `gpu_blocks` and every sequence's state as one row of
`gpu_states`; its clone path (`clone_and_zero_states_and_blocks`) copies whole rows. A
prefilled prompt moves the same way: its blocks' rows and its state slot's row, registered
with the rank's transfer agent and read by the decode rank into rows it reserved. The state
row is moved whole, in the inference layout both engines keep: `StateBlock` says a PROMPT to
COMPLETION transfer moves both its stored and its dropped region, rearranged only under
DEEPINFER_PREFILL_STORE_EXTRA_STATE (the kv-store ring), which the roles refuse.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from deepinfer_server.disaggregation.handoff.params import KVTransferParams
from deepinfer_server.disaggregation.layout import KVLayout
from deepinfer_server.disaggregation.transfer.agent import TransferAgent
from deepinfer_server.engines.role_settings import RoleSettings
from deepinfer_server.model.kv_block import BLOCK_SIZE

#: Bytes of each sampled window of a row (its start, middle and end) the rows' digest covers.
DIGEST_WINDOW = 64


def _row_bytes(tensor: Any) -> int:
    return int(tensor.stride(0)) * int(tensor.element_size())


def _windows(tensor: Any, rows: Sequence[int]) -> bytes:
    """The start, middle and end windows of `rows` of `tensor`, as bytes (a gather of a few
    bytes per row: cheap on a device, whatever the row size)."""
    import torch

    flat = tensor.reshape(int(tensor.shape[0]), -1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    width = int(flat.shape[1])
    edge = min(DIGEST_WINDOW, width)
    middle = (width - edge) // 2
    index = torch.tensor(list(rows), dtype=torch.long, device=flat.device)
    picked = torch.cat(
        (flat[index, :edge], flat[index, middle : middle + edge], flat[index, width - edge :]),
        dim=1,
    )
    return bytes(picked.cpu().numpy().tobytes())


def rows_layout(
    blocks: Any, states: Any, checkpoint: str | None, speculative_tokens: int
) -> KVLayout:
    """The layout of a rank's cache rows (`blocks`: `gpu_blocks`, `states`: `gpu_states`):
    their sizes and dtype, and what DeepInfer sizes them from (the backtracking depth of a
    state row, the speculative tokens, the checkpoint, DeepInfer's version)."""
    import deepinfer
    from deepinfer import envs

    version = getattr(deepinfer, "__version__", None)
    return KVLayout(
        engine="deepinfer",
        deepinfer_version=None if version is None else str(version),
        checkpoint=checkpoint,
        block_size=BLOCK_SIZE,
        block_bytes=_row_bytes(blocks),
        state_bytes=_row_bytes(states),
        dtype=str(blocks.dtype),
        backtracking_tokens=int(envs.DEEPINFER_MAX_BACKTRACKING_TOKENS),
        speculative_tokens=speculative_tokens,
    )


def transfer_agent(engine: Any, settings: RoleSettings) -> TransferAgent:
    """The rank's transfer agent over the transport its settings ask for (NVLink only when the
    cache rows are in GPU memory)."""
    on_gpu = bool(engine.driver_worker.cache_engine.gpu_blocks.is_cuda)
    return TransferAgent(settings.host, settings.ib_device, settings.transport, on_gpu)


class CacheMemory:
    """One rank's KV block rows and state rows, registered with its transfer agent."""

    def __init__(self, cache_engine: Any, agent: TransferAgent) -> None:
        self._blocks = cache_engine.gpu_blocks
        self._states = cache_engine.gpu_states
        for tensor in (self._blocks, self._states):
            if not tensor.is_contiguous():
                raise RuntimeError("DeepInfer's cache rows are not contiguous: cannot move them")
        self.block_bytes = _row_bytes(self._blocks)
        self.state_bytes = _row_bytes(self._states)
        self._agent = agent
        agent.register(self.kv_address, self.block_bytes * int(self._blocks.shape[0]))
        agent.register(self.state_address, self.state_bytes * int(self._states.shape[0]))

    @property
    def kv_address(self) -> int:
        return int(self._blocks.data_ptr())

    @property
    def state_address(self) -> int:
        return int(self._states.data_ptr())

    def layout(self, settings: RoleSettings) -> KVLayout:
        """These rows as the layout handshake describes them (`rows_layout`)."""
        return rows_layout(
            self._blocks, self._states, settings.checkpoint, settings.speculative_tokens
        )

    def close(self) -> None:
        self._agent.unregister(self.kv_address)
        self._agent.unregister(self.state_address)

    def digest(self, blocks: Sequence[int], slot: int) -> str:
        """A digest of sampled windows of `blocks`' rows (in that order) and of state row
        `slot`: what a prefill rank hands off and a decode rank compares after its pull."""
        digest = hashlib.blake2b(digest_size=16)
        digest.update(_windows(self._blocks, blocks))
        digest.update(_windows(self._states, [slot]))
        return digest.hexdigest()

    def pieces(
        self, params: KVTransferParams, blocks: Sequence[int], slot: int
    ) -> list[tuple[int, int, int]]:
        """(local, remote, length) for every block row of the prompt and its state row."""
        size = self.block_bytes
        pieces = [
            (self.kv_address + local * size, params.remote_kv_address + remote * size, size)
            for local, remote in zip(blocks, params.remote_block_ids, strict=True)
        ]
        pieces.append(
            (
                self.state_address + slot * self.state_bytes,
                params.remote_state_address + params.remote_state_slot * self.state_bytes,
                self.state_bytes,
            )
        )
        return pieces


def allocate(manager: Any, count: int) -> list[int]:
    """`count` blocks of one of DeepInfer's `BlockManager`s (KV blocks or state slots), each
    pinned once: the caller owns them until it unpins them."""
    manager.lock()
    try:
        return [int(block) for block in manager.allocate_nolock(count)]
    finally:
        manager.unlock()
