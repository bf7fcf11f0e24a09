"""KVBlocks: the simulated engine's paged KV cache, shaped like DeepInfer 0.1.0's block manager.

What it reproduces (`csrc/engine/block_manager.hpp`, `scheduler.hpp`): blocks of 128 tokens
with IDs 1..N-1 (block 0 is never allocatable), reference counts and a free list; a sequence's
table holds `ceil(tokens / 128)` blocks, all allocated at its prefill; a fork of a cached
sequence first pins the parent's blocks up to the fork point and keeps `fork_point // 128` of
them at its prefill (`share`, `keep_first`); a prefill is refused for now (LATER) when the
blocks are not free or usage is above the 90% watermark, and for good (NEVER, the request ends
"ignored") when it needs at least the whole pool; a decode step grows each running sequence,
and while no block is free it preempts from the longest-output end.

It also exposes DeepInfer's read-out API, so the engine driver reads KV usage the same way on
both engines: `get_num_free_gpu_blocks()` (the scheduler's) and `cache_config.num_gpu_blocks`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from deepinfer_server.model.kv_block import BLOCK_SIZE, blocks_for

#: A rank admits a prefill only while at most this share of its blocks is in use.
PREFILL_WATERMARK = 0.9

T = TypeVar("T")


class AllocStatus(enum.Enum):
    """DeepInfer's `AllocStatus`: allocate now, wait for blocks, or never fits."""

    OK = "ok"
    LATER = "later"
    NEVER = "never"


@dataclass(frozen=True)
class CacheConfig:
    """The fields of DeepInfer's `cache_config` that KV usage is computed from."""

    num_gpu_blocks: int
    block_size: int = BLOCK_SIZE


class KVBlocks:
    """The block pool of one rank and each owner's block table (a sequence, or a cached one)."""

    def __init__(self, num_gpu_blocks: int) -> None:
        if num_gpu_blocks < 2:
            raise ValueError("the KV pool needs at least 2 blocks (block 0 is never used)")
        self.cache_config = CacheConfig(num_gpu_blocks)
        #: Free block IDs; the next allocation takes the last one.
        self._free: list[int] = list(range(num_gpu_blocks - 1, 0, -1))
        self._refs = [0] * num_gpu_blocks
        self._tables: dict[str, list[int]] = {}

    def get_num_free_gpu_blocks(self) -> int:
        """Blocks free for allocation, as DeepInfer's scheduler reports them."""
        return len(self._free)

    def can_prefill(self, num_tokens: int, kept: int = 0) -> AllocStatus:
        """Whether a waiting sequence of `num_tokens` tokens can be prefilled now; a fork keeps
        `kept` blocks of its parent's and needs only the rest."""
        blocks = blocks_for(num_tokens)
        if blocks >= self.cache_config.num_gpu_blocks:
            return AllocStatus.NEVER
        needed = blocks - kept
        used = self.cache_config.num_gpu_blocks - 1 - len(self._free)
        over_watermark = used > PREFILL_WATERMARK * self.cache_config.num_gpu_blocks
        if needed > len(self._free) or over_watermark:
            return AllocStatus.LATER
        return AllocStatus.OK

    def allocate(self, owner: str, num_tokens: int) -> None:
        """Grow `owner`'s table to hold `num_tokens` tokens (callers checked the free blocks)."""
        needed = self._missing(owner, num_tokens)
        assert needed <= len(self._free), "allocate() past the free blocks"
        table = self._tables.setdefault(owner, [])
        for _ in range(needed):
            block = self._free.pop()
            self._refs[block] = 1
            table.append(block)

    def table(self, owner: str) -> list[int]:
        """`owner`'s block IDs, in token order (a copy)."""
        return list(self._tables.get(owner, ()))

    def share(self, owner: str, blocks: list[int]) -> None:
        """Start `owner`'s table with these blocks of another table, pinning each (a fork)."""
        assert owner not in self._tables, "a fork starts with no blocks of its own"
        for block in blocks:
            self._refs[block] += 1
        self._tables[owner] = list(blocks)

    def keep_first(self, owner: str, count: int) -> None:
        """Drop the pins of `owner`'s blocks past the first `count` (a fork's prefill keeps the
        whole blocks of its fork point and computes the rest into blocks of its own)."""
        table = self._tables.get(owner, [])
        for block in table[count:]:
            self._unref(block)
        del table[count:]

    def rename(self, owner: str, new_owner: str) -> None:
        """Hand `owner`'s table to `new_owner` (a finished sequence becomes a cache entry)."""
        self._tables[new_owner] = self._tables.pop(owner, [])

    def free(self, owner: str) -> None:
        """Release every block of `owner`'s table (a block is free once no table holds it)."""
        for block in self._tables.pop(owner, ()):
            self._unref(block)

    def _unref(self, block: int) -> None:
        self._refs[block] -= 1
        assert self._refs[block] >= 0, f"block {block} freed twice"
        if self._refs[block] == 0:
            self._free.append(block)

    def plan_decode(
        self,
        running: Sequence[T],
        request_id: Callable[[T], str],
        output_len: Callable[[T], int],
        tokens_after_step: Callable[[T], int],
    ) -> tuple[list[T], list[T]]:
        """Grow every running sequence for one decode step: (scheduled, preempted).

        As DeepInfer's decode scheduling (`scheduler.hpp` 622-645): sequences are taken from
        the shortest-output end, and while a sequence's next block is not free, victims are
        taken from the longest-output end (a sequence that still does not fit is itself the
        victim). Victims' blocks are freed here; the caller requeues them.
        """
        ordered = sorted(running, key=output_len, reverse=True)
        longest, i = 0, len(ordered) - 1
        scheduled: list[T] = []
        preempted: list[T] = []
        while i >= longest:
            sequence = ordered[i]
            needed = self._missing(request_id(sequence), tokens_after_step(sequence))
            while needed > len(self._free) and longest < i:
                victim = ordered[longest]
                longest += 1
                self.free(request_id(victim))
                preempted.append(victim)
            if needed > len(self._free):
                self.free(request_id(sequence))
                preempted.append(sequence)
                break
            self.allocate(request_id(sequence), tokens_after_step(sequence))
            scheduled.append(sequence)
            i -= 1
        return scheduled, preempted

    def _missing(self, owner: str, num_tokens: int) -> int:
        needed = blocks_for(num_tokens)
        return max(0, needed - len(self._tables.get(owner, ())))


def default_pool(max_num_seqs: int, max_model_len: int) -> int:
    """A pool that holds `max_num_seqs` sequences of `max_model_len` tokens (never preempts)."""
    return max_num_seqs * blocks_for(max_model_len + 1) + 1
