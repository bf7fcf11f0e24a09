"""The twin's KV cache and state slots: what a forward would have written, checked before use.

DeepInfer's clone path (`clone_and_zero_states_and_blocks`) copies whole rows of the tensors
below with `memcpy` in the CPU build, exactly as it copies GPU rows, so a clone the scheduler
or the server asks for moves the same bytes it would move on a GPU.

- A KV block is `int32[block_size, 2]`: per position, `(token, position + 1)`; 0 = never written.
- A state slot is `int64[1 + 2 * (R + 1)]`: the position `n` the state has reached, then a ring
  of the last R + 1 positions q as `(q, digest(tokens[:q]))`, R =
  DEEPINFER_MAX_BACKTRACKING_TOKENS. It imitates V4.1's rings, which keep room for rolling back
  speculative tokens: the state is usable at any q in [n - R, n] the ring still holds.

Before each scheduled sequence's forward (prompt and decode steps) the positions it attends to,
[0, start) with start = seqlen_k - seqlen_q, must hold exactly its own tokens, and its state slot
must be at `start` (or a rollback within budget). Then the step's positions [start, seqlen_k)
are written and the state advanced. A decode step with MTP drafts writes the drafts it verifies
after the sequence's tokens (the worker appends them to `tokens`): an accepted draft is the
token the next step reads there; from the first rejected one on, the next step starts there
and writes over them, its state rolled back within the ring. Positions past the known tokens
are written as -1.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Access:
    """What one scheduled sequence's forward reads and writes."""

    request_id: str
    state_id: int
    block_table: list[int]
    start: int
    end: int
    tokens: list[int]


def digest(tokens: list[int] | np.ndarray) -> int:
    """A 63-bit digest of a token prefix."""
    data = np.asarray(tokens, dtype="<i4").tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


class TwinKV:
    """One CP worker's KV blocks and state slots, with the violations it has seen."""

    def __init__(self, num_blocks: int, num_state_slots: int, block_size: int, ring: int) -> None:
        self.block_size = block_size
        self.ring = ring
        self.gpu_blocks = torch.zeros((num_blocks, block_size, 2), dtype=torch.int32)
        self.gpu_states = torch.zeros((num_state_slots, 1 + 2 * (ring + 1)), dtype=torch.int64)
        self.violations: list[str] = []

    def run(self, accesses: list[Access]) -> list[str]:
        """Check then write each access; the violations found in this step."""
        found: list[str] = []
        for access in accesses:
            found.extend(self._check(access))
        for access in accesses:
            self._write(access)
        self.violations.extend(found)
        return found

    def _positions(self, access: Access, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        table = torch.tensor(access.block_table, dtype=torch.int64)
        positions = torch.arange(stop, dtype=torch.int64)
        return table[positions // self.block_size], positions % self.block_size

    def _check(self, access: Access) -> list[str]:
        name = f"request {access.request_id!r} (state {access.state_id})"
        needed = -(-access.end // self.block_size)
        if len(access.block_table) < needed or 0 in access.block_table[:needed]:
            return [f"{name}: block table {access.block_table} cannot hold {access.end} tokens"]
        if access.start > len(access.tokens):
            return [f"{name}: reads {access.start} positions but has {len(access.tokens)} tokens"]
        if access.start == 0:
            return []
        problems = self._check_state(name, access)
        blocks, offsets = self._positions(access, access.start)
        seen = self.gpu_blocks[blocks, offsets]
        expected = torch.stack(
            [
                torch.tensor(access.tokens[: access.start], dtype=torch.int32),
                torch.arange(1, access.start + 1, dtype=torch.int32),
            ],
            dim=1,
        )
        wrong = torch.nonzero((seen != expected).any(dim=1)).flatten()
        if wrong.numel():
            p = int(wrong[0])
            problems.append(
                f"{name}: KV position {p} (block {int(blocks[p])}) holds "
                f"{seen[p].tolist()}, expected {expected[p].tolist()} "
                f"({wrong.numel()} of {access.start} positions wrong)"
            )
        return problems

    def _check_state(self, name: str, access: Access) -> list[str]:
        state = self.gpu_states[access.state_id]
        reached = int(state[0])
        start = access.start
        if reached < start:
            return [f"{name}: state at {reached}, behind the {start} tokens it must have seen"]
        if reached - start > self.ring:
            return [f"{name}: state at {reached}, a rollback to {start} exceeds {self.ring}"]
        slot = 1 + 2 * (start % (self.ring + 1))
        position, value = int(state[slot]), int(state[slot + 1])
        if position != start or value != digest(access.tokens[:start]):
            return [f"{name}: state ring at {start} holds another prefix (position {position})"]
        return []

    def _write(self, access: Access) -> None:
        state = self.gpu_states[access.state_id]
        if access.start == 0:
            # A new owner: nothing of the slot's previous sequence may be read (DeepInfer never
            # zeroes it either: its zero_states list is never filled).
            state.zero_()
        known = min(access.end, len(access.tokens))
        if access.end > access.start:
            blocks, offsets = self._positions(access, access.end)
            blocks, offsets = blocks[access.start :], offsets[access.start :]
            values = torch.full((access.end - access.start, 2), -1, dtype=torch.int32)
            values[:, 1] = torch.arange(access.start + 1, access.end + 1, dtype=torch.int32)
            if known > access.start:
                values[: known - access.start, 0] = torch.tensor(
                    access.tokens[access.start : known], dtype=torch.int32
                )
            self.gpu_blocks[blocks, offsets] = values
        for position in range(max(access.start + 1, access.end - self.ring), access.end + 1):
            slot = 1 + 2 * (position % (self.ring + 1))
            state[slot] = position
            state[slot + 1] = digest(access.tokens[:position]) if position <= known else -1
        state[0] = access.end
