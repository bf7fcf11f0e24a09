"""KVBlocks: the simulated engine's paged KV cache, shaped like DeepInfer 0.1.0's block manager.

What it reproduces of DeepInfer's `csrc/engine/block_manager.hpp` and scheduler: blocks of 128
tokens; block 0 is never allocatable; a sequence holds `ceil(tokens / 128)` blocks, all
allocated at its prefill; a prefill is refused for now (LATER) when the blocks are not free or
usage is above the 90% watermark, and for good (NEVER, the request ends "ignored") when it
needs at least the whole pool; a decode step grows
each running sequence, and while no block is free it preempts from the longest-output end.

It also exposes DeepInfer's read-out API, so the engine driver reads KV usage the same way on
both engines: `get_num_free_gpu_blocks()` (the scheduler's) and `cache_config.num_gpu_blocks`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

BLOCK_SIZE = 128
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


def blocks_for(num_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """Blocks a sequence of `num_tokens` tokens holds (`sequence.hpp` get_num_blocks)."""
    return -(-num_tokens // block_size)


class KVBlocks:
    """The block pool of one rank and the blocks each running sequence holds."""

    def __init__(self, num_gpu_blocks: int, block_size: int = BLOCK_SIZE) -> None:
        if num_gpu_blocks < 2:
            raise ValueError("the KV pool needs at least 2 blocks (block 0 is never used)")
        self.cache_config = CacheConfig(num_gpu_blocks, block_size)
        self._free = num_gpu_blocks - 1
        self._held: dict[str, int] = {}

    def get_num_free_gpu_blocks(self) -> int:
        """Blocks free for allocation, as DeepInfer's scheduler reports them."""
        return self._free

    def can_prefill(self, num_tokens: int) -> AllocStatus:
        """Whether a waiting sequence of `num_tokens` tokens can be prefilled now."""
        needed = blocks_for(num_tokens, self.cache_config.block_size)
        if needed >= self.cache_config.num_gpu_blocks:
            return AllocStatus.NEVER
        used = self.cache_config.num_gpu_blocks - 1 - self._free
        over_watermark = used > PREFILL_WATERMARK * self.cache_config.num_gpu_blocks
        if needed > self._free or over_watermark:
            return AllocStatus.LATER
        return AllocStatus.OK

    def allocate(self, request_id: str, num_tokens: int) -> None:
        """Hold enough blocks for `num_tokens` tokens (callers checked that they are free)."""
        needed = self._missing(request_id, num_tokens)
        assert needed <= self._free, "allocate() past the free blocks"
        self._free -= needed
        self._held[request_id] = self._held.get(request_id, 0) + needed

    def free(self, request_id: str) -> None:
        """Release every block of a sequence (finished, aborted or preempted)."""
        self._free += self._held.pop(request_id, 0)

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
            while needed > self._free and longest < i:
                victim = ordered[longest]
                longest += 1
                self.free(request_id(victim))
                preempted.append(victim)
            if needed > self._free:
                self.free(request_id(sequence))
                preempted.append(sequence)
                break
            self.allocate(request_id(sequence), tokens_after_step(sequence))
            scheduled.append(sequence)
            i -= 1
        return scheduled, preempted

    def _missing(self, request_id: str, num_tokens: int) -> int:
        needed = blocks_for(num_tokens, self.cache_config.block_size)
        return max(0, needed - self._held.get(request_id, 0))


def default_pool(max_num_seqs: int, max_model_len: int, block_size: int = BLOCK_SIZE) -> int:
    """A pool that holds `max_num_seqs` sequences of `max_model_len` tokens (never preempts)."""
    return max_num_seqs * blocks_for(max_model_len + 1, block_size) + 1
